"""The optimizer and the jitted update one fit trains with, built once in `Trainer.fit`'s set-up.

    module.configure_optimizers()  ->  the callbacks' wrap_optimizer (e.g. NaNGuard's skip)
      ->  float32 master weights for bfloat16 params (`rlbolt.master_weights.wrap`)
      ->  its state, born sharded (`rlbolt.distributed.layout.init_optimizer`)
      ->  the memory plan, logged and checked before anything compiles
      ->  the jitted update (`rlbolt.update.make_update_fn`), donating what it replaces

What the update donates depends on the mode (`donated_fields`): sync mode donates the
parameters too, async mode only the optimizer state, since its producer may still roll out with
parameters published before the update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from rlbolt import master_weights as masters
from rlbolt.distributed import layout
from rlbolt.update import make_update_fn


class UpdateSetup(NamedTuple):
    """What `setup_update` builds.

    Attributes:
      update: the jitted `update(params, opt_state, micro_batches) -> (params, opt_state, metrics)`.
      optimizer: the optax transformation the update runs (wrapped by the callbacks and for masters).
      params: the parameters to train (a copy of the module's when the update donates them).
      opt_state: the optimizer state, placed.
      memory_plan: the per-device memory plan (`rlbolt.distributed.memory.MemoryPlan`).
    """

    update: Callable
    optimizer: Any
    params: Any
    opt_state: Any
    memory_plan: Any


def donated_fields(lag_steps: int) -> tuple[str, ...]:
    """The TrainState fields each update donates: the parameters and the optimizer state in sync
    mode (`lag_steps` 0), only the optimizer state when the producer runs ahead (it may still read
    published parameters while later ones train)."""
    return ("params", "opt_state") if lag_steps == 0 else ("opt_state",)


def setup_update(module: Any, params: Any, sharding: Any, *, grad_accum_steps: int, donate: tuple[str, ...],
                 master_weights: str = "auto", wrap_optimizer: Callable[[Any], Any] | None = None,
                 device_memory_bytes: int | None = None) -> UpdateSetup:
    """Builds the optimizer, its placed state, the memory plan and the jitted update of a fit.

    Args:
      module: the RLModule, set up (`configure_optimizers`, `training_step`, `memory_plan`,
        `frozen_params`, `with_frozen` are read).
      params: the module's initial parameters, placed on `sharding`.
      sharding: the train role's `rlbolt.distributed.ShardingPlan`.
      grad_accum_steps: train micro batches per mini batch (`BatchPlan.grad_accum_steps`).
      donate: the TrainState fields the update donates (`donated_fields`).
      master_weights: "auto" (float32 masters for narrower params) or "none" (`rlbolt.master_weights`).
      wrap_optimizer: `optimizer -> optimizer`, the callbacks' `wrap_optimizer` (None: unchanged).
      device_memory_bytes: the per-device budget the memory plan is checked against (None: what the
        backend reports).

    Returns:
      The update, the optimizer, the parameters to train, the optimizer state and the memory plan.
    """
    if "params" in donate:  # the module may keep init_params' arrays (the KL reference does)
        params = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, params)
    optimizer = module.configure_optimizers()
    if wrap_optimizer is not None:
        optimizer = wrap_optimizer(optimizer)  # e.g. NaNGuard(action="skip")
    optimizer = masters.wrap(optimizer, params, master_weights)  # float32 masters for bf16
    opt_state = layout.init_optimizer(optimizer, params, sharding)
    memory_plan = layout.memory_plan(module.memory_plan(sharding), params, opt_state, sharding,
                                     device_bytes=device_memory_bytes)  # before anything compiles
    update = make_update_fn(module.training_step, optimizer, grad_accum_steps, frozen=module.frozen_params(),
                            with_frozen=module.with_frozen, sharding=sharding, params=params, opt_state=opt_state,
                            donate=donate)
    return UpdateSetup(update, optimizer, params, opt_state, memory_plan)


__all__ = ["UpdateSetup", "donated_fields", "setup_update"]
