"""DAPO (arXiv 2503.14476) on GSM8K.

Run: `python recipes/dapo_gsm8k.py [--config PATH] [section.key=value ...]`
(CPU: the tiny random model and built-in rows; GPU: see the header of configs/dapo_gsm8k.yaml.)

Where this departs from the paper:
- Dynamic sampling refills at most plan.max_refill_rounds times (4 here); the paper samples
  until the batch is full. If the cap is hit the step fails with a clear error.
- The overlong ramp is max_new_tokens // 4 wide (the paper: 4096 of 20480 tokens).
- No KL term (as in the paper); algorithm.beta > 0 adds it back.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlbolt.app.build import build_run, parse_args
from rlbolt.modules import DAPO

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "dapo_gsm8k.yaml"


def main(argv: Sequence[str] | None = None, callbacks: Sequence = ()):
    """Trains DAPO with the config (and overrides) in `argv`; returns (final state, trainer)."""
    cfg = parse_args(argv, DEFAULT_CONFIG, algorithm="dapo", description=__doc__)
    module, trainer, train_rows, val_rows = build_run(cfg, callbacks=callbacks)
    assert isinstance(module, DAPO)
    state = trainer.fit(module, train_rows, val_rows)
    return state, trainer


if __name__ == "__main__":
    main()
