"""Dr.GRPO ("Understanding R1-Zero-Like Training", arXiv 2503.20783) on GSM8K.

Run: `python recipes/drgrpo_gsm8k.py [--config PATH] [section.key=value ...]`
(CPU: the tiny random model and built-in rows; GPU: see the header of configs/drgrpo_gsm8k.yaml.)

Where this departs from the paper:
- The length constant of the seq-mean-token-sum-norm loss is rollout.max_new_tokens.
- No KL term, as in the paper (algorithm.beta > 0 adds a k3 KL in the loss).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlbolt.app.build import build_run, parse_args
from rlbolt.modules import DrGRPO

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "drgrpo_gsm8k.yaml"


def main(argv: Sequence[str] | None = None, callbacks: Sequence = ()):
    """Trains DrGRPO with the config (and overrides) in `argv`; returns (final state, trainer)."""
    cfg = parse_args(argv, DEFAULT_CONFIG, algorithm="drgrpo", description=__doc__)
    module, trainer, train_rows, val_rows = build_run(cfg, callbacks=callbacks)
    assert isinstance(module, DrGRPO)
    state = trainer.fit(module, train_rows, val_rows)
    return state, trainer


if __name__ == "__main__":
    main()
