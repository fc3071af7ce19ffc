"""Log-prob scorers: frozen models that score the policy's sampled tokens, behind one `.logps(batch)`.

`LMPolicyModule.scorers` maps a column's stem to its scorer: `"ref"` (the KL reference, when
`algorithm.beta > 0`) fills `ref_logps`, `"teacher"` (on-policy distillation) fills
`teacher_logps`. Each scorer is one of

    ColocatedScorer        a frozen copy on the training devices (the reference, a teacher), or LoRA's
                           base with the adapters off (no copy: it reads the policy's frozen base)
    PlacedReference        a frozen copy on devices of its own (`placement.reference` / `.teacher`;
                           modules/reference.py)

and all of them answer the same three things: `logps(batch, group_size)` -> [N, C] float32 host
rows, `params` (the copy they hold, which `CPUOffload` may swap for a host copy between calls;
None when they hold none) and `on_train_devices` (whether the copy counts in the training
devices' memory plan).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from rlbolt.batch import Batch
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.modules.policy_model import local_rows, rows_on_mesh


class LogpsScorer(Protocol):
    """What `compute_logps` asks of a frozen model that scores the sampled tokens."""

    params: Any
    on_train_devices: bool

    def logps(self, batch: Batch, group_size: int = 1) -> np.ndarray:
        """[N, C] float32 log-probs (this process's rows) of `batch`'s completion tokens."""
        ...


class ColocatedScorer:
    """A frozen model's logps forward on the training devices.

    Args:
      forward: the jitted logps forward (`policy_model.jitted_logps`; the reference shares the
        policy's, so it compiles once).
      params: its parameters (placed on `sharding`), or None with `read_params`.
      sharding: the training role's ShardingPlan, or None (one device).
      read_params: where the parameters are read at each call instead of a copy held here (LoRA's
        reference: the policy's frozen base with the adapters off, so beta > 0 costs no memory).
    """

    on_train_devices = True

    def __init__(self, forward: Callable[..., jax.Array], params: Any, sharding: ShardingPlan | None, *,
                 read_params: Callable[[], Any] | None = None):
        self.forward = forward
        self.params = params
        self._read = read_params
        self.sharding = sharding

    def logps(self, batch: Batch, group_size: int = 1) -> np.ndarray:
        """[N, C] float32 host rows: the frozen model's logps of `batch`, each group's prompt once
        when `group_size` > 1 (the batch's layout was checked by the caller)."""
        params = self.params if self._read is None else self._read()
        return local_rows(self.sharding, self.forward(params, *rows_on_mesh(self.sharding, batch),
                                                      group_size=group_size))


def idle_copies(scorers: dict[str, Any]) -> dict[str, Any]:
    """What a module's card declares as idle copies (`ModuleCard.idle_copies`): the reference
    scorer when it holds a frozen copy on the training devices (beta > 0, no LoRA), as "ref_params".

    Args:
      scorers: the module's scorers by column stem.
    """
    ref = scorers.get("ref")
    return {"ref_params": ref} if ref is not None and ref.on_train_devices and ref.params is not None else {}
