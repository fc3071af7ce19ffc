"""GSPO (Group Sequence Policy Optimization, arXiv 2507.18071) on GSM8K.

Run: `python recipes/gspo_gsm8k.py [--config PATH] [section.key=value ...]`
(CPU: the tiny random model and built-in rows; GPU: see the header of configs/gspo_gsm8k.yaml.)

Where this departs from the paper:
- The GSPO-token form is used (its value and gradient equal GSPO's with sequence advantages).
- Clip ranges 3e-4 / 4e-4 as in the paper; with num_iterations 1 they only bite after the first
  mini batch, so this config uses two mini batches per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlbolt.app.build import build_run, parse_args
from rlbolt.modules import GSPO

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "gspo_gsm8k.yaml"


def main(argv: Sequence[str] | None = None, callbacks: Sequence = ()):
    """Trains GSPO with the config (and overrides) in `argv`; returns (final state, trainer)."""
    cfg = parse_args(argv, DEFAULT_CONFIG, algorithm="gspo", description=__doc__)
    module, trainer, train_rows, val_rows = build_run(cfg, callbacks=callbacks)
    assert isinstance(module, GSPO)
    state = trainer.fit(module, train_rows, val_rows)
    return state, trainer


if __name__ == "__main__":
    main()
