"""GRPO (DeepSeekMath, arXiv 2402.03300) on GSM8K.

Run: `python recipes/grpo_gsm8k.py [--config PATH] [section.key=value ...]`
(CPU: the tiny random model and built-in rows; GPU: see the header of configs/grpo_gsm8k.yaml.)

Where this departs from the paper:
- Outcome supervision only (one reward per completion, Sec. 4.1.2), no process supervision.
- The group std is the unbiased one (ddof 1), as in TRL / verl; the paper does not say which.
- The reference model stays frozen (the paper's iterative GRPO refreshes it; we do not).
- KL is the k3 estimator in the loss, as in Eq. 4, with beta 0.04.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlbolt.app.build import build_run, parse_args
from rlbolt.modules import GRPO

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "grpo_gsm8k.yaml"


def main(argv: Sequence[str] | None = None, callbacks: Sequence = ()):
    """Trains GRPO with the config (and overrides) in `argv`; returns (final state, trainer)."""
    cfg = parse_args(argv, DEFAULT_CONFIG, algorithm="grpo", description=__doc__)
    module, trainer, train_rows, val_rows = build_run(cfg, callbacks=callbacks)
    assert isinstance(module, GRPO)
    state = trainer.fit(module, train_rows, val_rows)
    return state, trainer


if __name__ == "__main__":
    main()
