"""RLOO ("Back to Basics", Ahmadian et al., arXiv 2402.14740) on GSM8K.

Run: `python recipes/rloo_gsm8k.py [--config PATH] [section.key=value ...]`
(CPU: the tiny random model and built-in rows; GPU: see the header of configs/rloo_gsm8k.yaml.)

Where this departs from the paper:
- The policy loss is the PPO-clip surrogate; with one update per batch (num_iterations 1,
  mini batch = global batch) the ratio is 1 and it reduces to the paper's REINFORCE estimator.
- The KL penalty (k-estimator algorithm.kl_kind, beta 0.04) is folded into the sequence reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlbolt.app.build import build_run, parse_args
from rlbolt.modules import RLOO

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "rloo_gsm8k.yaml"


def main(argv: Sequence[str] | None = None, callbacks: Sequence = ()):
    """Trains RLOO with the config (and overrides) in `argv`; returns (final state, trainer)."""
    cfg = parse_args(argv, DEFAULT_CONFIG, algorithm="rloo", description=__doc__)
    module, trainer, train_rows, val_rows = build_run(cfg, callbacks=callbacks)
    assert isinstance(module, RLOO)
    state = trainer.fit(module, train_rows, val_rows)
    return state, trainer


if __name__ == "__main__":
    main()
