"""REINFORCE++ (arXiv 2501.03262) on GSM8K.

Run: `python recipes/reinforcepp_gsm8k.py [--config PATH] [section.key=value ...]`
(CPU: the tiny random model and built-in rows; GPU: see the header of configs/reinforcepp_gsm8k.yaml.)

Where this departs from the paper:
- PPO-clip on the token advantages (as the paper), KL (k-estimator algorithm.kl_kind) per
  token in the reward with beta 0.01; advantages whitened over the whole global batch.
- Group sampling (num_generations 4) is kept for comparability; the paper samples one per prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlbolt.app.build import build_run, parse_args
from rlbolt.modules import ReinforcePP

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "reinforcepp_gsm8k.yaml"


def main(argv: Sequence[str] | None = None, callbacks: Sequence = ()):
    """Trains ReinforcePP with the config (and overrides) in `argv`; returns (final state, trainer)."""
    cfg = parse_args(argv, DEFAULT_CONFIG, algorithm="reinforcepp", description=__doc__)
    module, trainer, train_rows, val_rows = build_run(cfg, callbacks=callbacks)
    assert isinstance(module, ReinforcePP)
    state = trainer.fit(module, train_rows, val_rows)
    return state, trainer


if __name__ == "__main__":
    main()
