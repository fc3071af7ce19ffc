"""PPO for language models (Ouyang et al. 2203.02155; PPO 1707.06347) on GSM8K.

Run: `python recipes/ppo_gsm8k.py [--config PATH] [section.key=value ...]`
(CPU: the tiny random model and built-in rows; GPU: see the header of configs/ppo_gsm8k.yaml.)

Where this departs from the paper:
- The critic is a linear value head on the policy's final hidden states (shared trunk),
  not a separate value model; its loss (value_coef 0.5, clipped at 0.2) also trains the trunk.
- Advantages: GAE (gamma 1, lambda 0.95) on the old values, whitened over the global batch.
- KL to the reference (k1 here) is in the token reward, as in InstructGPT.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rlbolt.app.build import build_run, parse_args
from rlbolt.modules import PPO

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "ppo_gsm8k.yaml"


def main(argv: Sequence[str] | None = None, callbacks: Sequence = ()):
    """Trains PPO with the config (and overrides) in `argv`; returns (final state, trainer)."""
    cfg = parse_args(argv, DEFAULT_CONFIG, algorithm="ppo", description=__doc__)
    module, trainer, train_rows, val_rows = build_run(cfg, callbacks=callbacks)
    assert isinstance(module, PPO)
    state = trainer.fit(module, train_rows, val_rows)
    return state, trainer


if __name__ == "__main__":
    main()
