"""What `Trainer.fit` builds before its first step, in the order it builds it. Each function takes
what it needs and returns what the Trainer keeps:

    fit_callbacks  the Trainer's callbacks, a former fit's own validation replaced by this fit's
    place_roles    role -> ShardingPlan, this process's groups across processes (joined and wired to
                   the WeightStore), and every batch size checked against them
    init_module    module.setup(context), then its parameters from `param_key(seed)`, placed
    describe_run   the RunInfo every callback hook receives (after init_params: the module's card)
    setup_update   the optimizer (configure_optimizers -> the callbacks' wrap_optimizer -> float32
                   masters for bfloat16 params), its state born sharded, the memory plan (logged and
                   checked before anything compiles), the jitted update donating what it replaces
    first_state    step 0's TrainState; its rng is the run's base key, fold_in(PRNGKey(seed), 1)

What the update donates depends on the mode (`donated_fields`): sync mode donates the parameters
too, async mode only the optimizer state, since its producer may still roll out with parameters
published before the update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from rlbolt import master_weights as masters
from rlbolt.callback import Callback, CallbackList
from rlbolt.callbacks.evaluation import FIT_VALIDATION, Evaluation
from rlbolt.distributed import layout
from rlbolt.distributed.process_groups import ProcessGroups, join_placement
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.run_info import Control, RunInfo, total_steps
from rlbolt.setup_context import SetupContext
from rlbolt.state import TrainState
from rlbolt.update import make_update_fn


def fit_callbacks(callbacks: Iterable[Callback], val_data: Sequence[dict] | None, *, every_n_steps: int | None,
                  at_start: bool, legacy: Any) -> CallbackList:
    """A fit's callbacks: `callbacks` without a former fit's own validation, plus (given rows in
    `val_data`) this fit's `Evaluation.of_fit` (every n steps, at the start, after the last step),
    which runs after every other callback.

    Args:
      callbacks: the Trainer's callbacks.
      val_data: the fit's validation rows, or None.
      every_n_steps: the Trainer's `val_every_n_steps`.
      at_start: the Trainer's `val_at_start`.
      legacy: what an old-signature hook receives (the Trainer; see `CallbackList`).
    """
    kept = [cb for cb in callbacks if cb.state_key != FIT_VALIDATION]  # not a former fit's
    if val_data is not None and len(val_data) > 0:
        kept.append(Evaluation.of_fit(val_data, every_n_steps=every_n_steps, at_start=at_start))
    return CallbackList(kept, legacy=legacy)


def place_roles(placement: Any, mesh: Any, weights: Any, *, mode: str, plan: Any, val_data: Any,
                timeout_s: float | None) -> tuple[dict[str, ShardingPlan], ProcessGroups | None]:
    """Each role's ShardingPlan, the placement joined (`join_placement`), the batch sizes checked.

    Args:
      placement: the Trainer's `rlbolt.distributed.placement.Placement`.
      mesh: the Trainer's `mesh` argument (`Placement.plans`).
      weights: the Trainer's `WeightStore` (across processes each publish becomes a push).
      mode: "sync" or "async".
      plan: the checked BatchPlan.
      val_data: the fit's validation rows, or None.
      timeout_s: the wait for the other process group (`Trainer.prefetch_timeout_s`).

    Returns:
      (role -> ShardingPlan, this process's `ProcessGroups` across processes, else None).
    """
    plans = placement.plans(mesh)
    groups = join_placement(placement, plans, weights, mode=mode, plan=plan, val_data=val_data, timeout_s=timeout_s)
    layout.check_batch_plan(plan, plans["train"], mode, reference=plans["reference"], across_groups=groups is not None)
    return plans, groups


def param_key(seed: int) -> jax.Array:
    """The key a run's parameters are initialised from: `fold_in(PRNGKey(seed), 0)`."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), 0)


def init_module(module: Any, context: SetupContext) -> Any:
    """Sets `module` up (`module.setup(context)`, kept as `module.context`) and returns its initial
    parameters (`init_params(param_key(seed))`), placed on the train role's plan."""
    module.context = context
    module.setup(context)
    return context.shardings["train"].place(module.init_params(param_key(context.seed)))


def describe_run(module: Any, plan: Any, source: Any, callbacks: CallbackList, weights: Any, *,
                 settings: Mapping[str, Any], run_dir: Any, lag_steps: int, donated: tuple[str, ...],
                 control: Control, timeline: Any) -> RunInfo:
    """The RunInfo every callback hook receives (built after the module's setup: its card is built).

    Args:
      module: the RLModule, set up.
      plan: the checked BatchPlan.
      source: the PromptSource (`max_epochs` of it bound the prompts the run may consume).
      callbacks: the fit's CallbackList (the RunInfo lists them and reads their states).
      weights: the fit's WeightStore (its retained weights are checkpointed).
      settings: the Trainer's settings as a checkpoint and a dashboard record them (`mode`,
        `max_steps`, `max_epochs` among them).
      run_dir: where callbacks write.
      lag_steps: how many steps the producer runs ahead of training.
      donated: the TrainState fields each update donates (`donated_fields`).
      control: the fit's Control.
      timeline: the fit's `rlbolt.timeline.Timeline`.
    """
    max_steps, max_epochs = settings["max_steps"], settings["max_epochs"]
    max_prompts = None if max_epochs is None else max_epochs * len(source)
    return RunInfo(run_dir=run_dir, plan=plan, mode=settings["mode"], lag_steps=lag_steps, max_steps=max_steps,
                   max_epochs=max_epochs, total_steps=total_steps(max_steps, max_prompts, plan.prompts_per_step),
                   max_prompts=max_prompts, is_main_process=jax.process_index() == 0, card=module.card(),
                   module=module, settings=dict(settings), donated=donated, control=control, timeline=timeline,
                   callbacks=tuple(callbacks), retained_weights=weights.retained, callback_states=callbacks.state_dict)


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


def build_optimizer(module: Any, params: Any, sharding: Any, master_weights: str = "auto",
                    wrap_optimizer: Callable[[Any], Any] | None = None) -> tuple[Any, Any]:
    """A fit's optimizer and its state, born sharded like `params`: `module.configure_optimizers()`,
    then the callbacks' `wrap_optimizer`, then float32 masters for narrower params (`rlbolt.master_weights`).
    `rlbolt plan` builds its abstract run's optimizer here too.

    Args:
      module: the RLModule, set up.
      params: its parameters, placed on `sharding` (arrays or abstract values).
      sharding: the train role's `rlbolt.distributed.ShardingPlan`.
      master_weights: "auto" or "none" (`rlbolt.master_weights`).
      wrap_optimizer: `optimizer -> optimizer` (None: unchanged).
    """
    optimizer = module.configure_optimizers()
    if wrap_optimizer is not None:
        optimizer = wrap_optimizer(optimizer)  # e.g. NaNGuard(action="skip")
    optimizer = masters.wrap(optimizer, params, master_weights)  # float32 masters for bf16
    return optimizer, layout.init_optimizer(optimizer, params, sharding)


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
    optimizer, opt_state = build_optimizer(module, params, sharding, master_weights, wrap_optimizer)
    memory_plan = layout.memory_plan(module.memory_plan(sharding), params, opt_state, sharding,
                                     device_bytes=device_memory_bytes)  # before anything compiles
    update = make_update_fn(module.training_step, optimizer, grad_accum_steps, frozen=module.frozen_params(),
                            with_frozen=module.with_frozen, sharding=sharding, params=params, opt_state=opt_state,
                            donate=donate)
    return UpdateSetup(update, optimizer, params, opt_state, memory_plan)


def first_state(params: Any, opt_state: Any, seed: int, sharding: ShardingPlan) -> TrainState:
    """Step 0's TrainState; its rng, the run's base key `fold_in(PRNGKey(seed), 1)` (every rollout key
    derives from it), is replicated: every process saves it.

    Args:
      params: the parameters to train (`UpdateSetup.params`).
      opt_state: the optimizer state (`UpdateSetup.opt_state`).
      seed: the Trainer's seed.
      sharding: the train role's ShardingPlan.
    """
    return TrainState(step=0, params=params, opt_state=opt_state, policy_version=0, data_position=0,
                      rng=sharding.place(jax.random.fold_in(jax.random.PRNGKey(seed), 1)))


__all__ = ["UpdateSetup", "build_optimizer", "describe_run", "donated_fields", "first_state", "fit_callbacks", "init_module", "param_key",
           "place_roles", "setup_update"]
