"""Trainer: the generic fit loop. Read `fit` top to bottom; everything else is a helper.

    producer threads (Producer, around an ExperienceDock): prompts -> on_rollout -> compute_logps
                                       -> on_advantage, each stage at its own dispatch size
    main thread (fit):                 for each iteration, for each mini batch: one jitted update
                                       (grad accumulation over train micro batches inside it)
                                       -> publish weights -> callbacks.on_step_end(StepInfo)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rlbolt.callback import Callback, CallbackList
from rlbolt.data.source import PromptSource
from rlbolt.distributed import any_process, host_value
from rlbolt.distributed.agree import set_default_group
from rlbolt.distributed.placement import Placement
from rlbolt.distributed.process_groups import ProcessGroups
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.fit_checks import MODES, check_fit, check_trainer_settings, lag_steps
from rlbolt.fit_setup import describe_run, donated_fields, first_state, fit_callbacks, init_module, place_roles, setup_update
from rlbolt.module import RLModule
from rlbolt.plan import BatchPlan
from rlbolt.producer import STAGE_ROLES, ProducedStep, Producer
from rlbolt.setup_context import SetupContext
from rlbolt.signals import StopOnSignal
from rlbolt.state import StepInfo, TrainState
from rlbolt.step_metrics import step_metrics
from rlbolt.timeline import Timeline
from rlbolt.train_batch import run_updates
from rlbolt.utils.runlock import hold_run_dir
from rlbolt.utils.step_beacon import record_step
from rlbolt.validation import run_validation
from rlbolt.producer.weights import WeightStore
from rlbolt.producer.remote_rollout import remote_stages, run_rollout_group
from rlbolt.run_info import Control, ControlField, Restore, RunInfo

__all__ = ["MODES", "Trainer"]  # MODES (now fit_checks') stays importable from here


class Trainer:
    """Runs an RLModule over a prompt source.

    Args:
      plan: the batch sizes (validated when the BatchPlan is built).
      max_steps: global steps to run (None: until max_epochs).
      max_epochs: passes over the prompts (default 1 when max_steps is None).
      seed: seeds parameter init and every rollout key (keys are derived per step and sample).
      data_seed: seeds the per-epoch shuffle (default: seed).
      shuffle: reshuffle prompts every epoch.
      callbacks: Callback instances, run in order after the module's own hooks.
      mode: "sync" (on-policy: step s rolls out with the weights after step s-1) or "async"
        (the producer runs ahead with older weights, bounded by `max_staleness`).
      max_staleness: async only: the most policy versions a trained sample may lag the policy.
        The producer then runs `(max_staleness + 1) // updates_per_step - 1` steps ahead.
      val_every_n_steps: validate every n steps (and always after the last step when val_data is
        given); `fit` refuses it without val_data (see `rlbolt.fit_checks`). `fit(val_data=...)`
        installs an `Evaluation` callback with these settings, run after every other callback.
      val_batch_size: prompts per validation batch (default prompts_per_step).
      val_at_start: also validate the starting parameters before the first step (logged at step 0;
        not on a resume): the "before" of a before/after comparison.
      run_dir: where callbacks write (metrics, checkpoints); default runs/<time>.
      prefetch_timeout_s: fail if the producer yields nothing for this long (None: wait); across process
        groups, how long a process waits for the other group (None: 1800 s), named in the error.
      mesh: the devices to run on: a `rlbolt.distributed.MeshSpec` / `{data, fsdp, expert, context, tp}` dict
        (-1 = the rest), a `jax.sharding.Mesh`, a `ShardingPlan`, or None (all devices on fsdp).
      device_memory_bytes: refuse a plan whose per-device memory exceeds this (default: what
        the backend reports; CPU reports nothing, then the plan is only logged).
      placement: "colocated" (every role on `mesh`) or role -> sub-mesh (`{"train": {"devices": [0, 4]},
        "rollout": {"devices": [4, 8], "mesh": {"tp": 2}}}`, `rlbolt.distributed.placement`): rollout
        (and the reference or the distillation teacher, given a range) on its own devices, weights
        resharded after each update. Across processes (sync or async) each process runs its group's part
        only: the training group this loop, the rollout group the rollouts
        (`rlbolt.distributed.process_groups`); there `fit` returns the state as set up.
      master_weights: "auto" (default): when a trainable parameter is narrower than float32
        (`model.param_dtype: bfloat16`), the optimizer keeps float32 master weights and runs on
        them (float32 AdamW moments; the params are the masters' casts: `rlbolt.master_weights`);
        "none": the optimizer runs on the parameters in their own dtype.

    The update donates what it replaces (`rlbolt.fit_setup`): the optimizer state always, the
    parameters in sync mode; the trainer trains its own copy of what `module.init_params` returned
    (a module may keep those arrays), and `StepInfo.previous_state` holds None for the donated fields.

    Attributes:
      timeline: every stage call and update as start/end events (`rlbolt.timeline.Timeline`, written by TimelineLogger).
    """

    def __init__(self, plan: BatchPlan, *, max_steps: int | None = None, max_epochs: int | None = None,
                 seed: int = 0, data_seed: int | None = None, shuffle: bool = True,
                 callbacks: Sequence[Callback] = (), mode: str = "sync", max_staleness: int | None = None,
                 val_every_n_steps: int | None = None, val_batch_size: int | None = None, val_at_start: bool = False,
                 run_dir: str | Path | None = None, prefetch_timeout_s: float | None = None,
                 mesh: Any = None, device_memory_bytes: int | None = None, placement: Any = "colocated",
                 master_weights: str = "auto"):
        check_trainer_settings(plan, mode=mode, master_weights=master_weights, max_steps=max_steps,
                               max_epochs=max_epochs, val_every_n_steps=val_every_n_steps)
        self.master_weights = master_weights
        self.donated: tuple[str, ...] = ()  # the TrainState fields each update donates (set in fit)
        self.plan, self.max_steps, self.seed = plan, max_steps, seed
        self.max_epochs = max_epochs if max_epochs is not None or max_steps is not None else 1
        self.data_seed, self.shuffle = (seed if data_seed is None else data_seed), shuffle
        self.callbacks = CallbackList(callbacks, legacy=self)
        self.mode, self.lag_steps = mode, lag_steps(mode, max_staleness, plan)
        self.max_staleness = max_staleness if mode == "async" else plan.updates_per_step - 1
        self.val_every_n_steps, self.val_batch_size = val_every_n_steps, val_batch_size or plan.prompts_per_step
        self.val_at_start = bool(val_at_start)
        self.run_dir = Path(run_dir) if run_dir is not None else Path("runs") / time.strftime("%Y%m%d-%H%M%S")
        self.prefetch_timeout_s = prefetch_timeout_s
        self.mesh_spec, self.device_memory_bytes = mesh, device_memory_bytes
        self.placement, self.plans = Placement.of(placement), {}
        self.groups: ProcessGroups | None = None  # a placement across processes: this process's group (set in fit)
        self.agree_with: tuple[int, ...] | None = None  # processes that agree on a stop (None: every process)
        self.sharding: ShardingPlan | None = None  # the train role's plan (of self.plans: role -> plan), set in fit
        self.weights = WeightStore(self.lag_steps)
        self.timeline = Timeline()  # stage start/end events; TimelineLogger writes them to the run dir
        self.control = Control(self.validate)  # stop requests, the interrupted flag (new for each fit)
        self.run: RunInfo | None = None  # what the callbacks receive (built in fit, after the module's setup)
        self.module: RLModule | None = None
        self.source: PromptSource | None = None

    @property
    def is_main_process(self) -> bool:
        return jax.process_index() == 0

    should_stop = ControlField("stop_requested")
    """THE stop flag (`Control.stop_requested`): a callback (`run.control.request_stop()`) or a signal sets
    it; fit ends after the current step. Setting it False raises (a stop cannot be taken back)."""
    interrupted = ControlField()
    """Whether the last fit was stopped by SIGINT/SIGTERM or a KeyboardInterrupt."""
    stop_signal = ControlField()
    """The signal that stopped the last fit (None: none)."""

    def sharding_for(self, role: str) -> ShardingPlan:
        """The ShardingPlan of a role ("train", "rollout", "reference", "teacher"): the trainer's mesh for
        every role when colocated, else the role's sub-mesh (None before fit)."""
        return self.plans.get(role, self.sharding)

    # ------------------------------------------------------------------------------------------
    def fit(self, module: RLModule, train_data: Any, val_data: Sequence[dict] | None = None) -> TrainState:
        """Trains `module` on `train_data` (dict rows or a grain MapDataset); returns the final state.

        The run directory is locked while a callback writes there (one writer per directory).
        SIGINT/SIGTERM end the loop after the current step (`rlbolt.signals`): `interrupted` and
        `stop_signal` are set, `on_fit_end` saves and flushes, and the step's state is returned.
        """
        self.control = Control(self.validate)
        self.callbacks = fit_callbacks(self.callbacks, val_data, every_n_steps=self.val_every_n_steps,
                                       at_start=self.val_at_start, legacy=self)
        writes = self.is_main_process and any(cb.writes_run_dir for cb in self.callbacks)
        with hold_run_dir(self.run_dir, writes), StopOnSignal(self.control.stop_on_signal) as signals, \
                contextlib.ExitStack() as on_exit:
            on_exit.callback(set_default_group, None)  # the process group a placement across processes set
            state = self._setup(module, train_data, val_data)
            if self.groups is not None and self.groups.role == "rollout":  # a rollout for each push; no callbacks
                run_rollout_group(module, self.plan, self.source, self.groups, state.params,  # a resume's step, rng
                                  self.plans["rollout"].share, **self.groups.receive_start(),
                                  max_steps=self.max_steps, max_prompts=self.run.max_prompts, lag=self.lag_steps)
                return state  # its parameters live on the training group
            if self.groups is not None:
                on_exit.callback(self.groups.end)  # the rollout group's loop returns
            return self._fit_training(module, state, signals)

    def _fit_training(self, module: RLModule, state: TrainState, signals) -> TrainState:
        state = self.callbacks.on_restore(self.run, state, apply=self._apply_restore)  # ModelCheckpoint resumes here
        state = self.last_state = self.callbacks.on_fit_start(self.run, state)
        producer = self._producer(module, state)
        signals.defer()  # from here a signal ends the run at the next step boundary
        try:
            # across groups the rows' wait (GroupLink) has the deadline: its error names the silent process
            timeout_s = self.prefetch_timeout_s if self.groups is None else None
            with producer.start(state.step, state.data_position, timeout_s=timeout_s,
                                should_stop=self._stop_while_waiting) as produced_steps:
                waited = time.perf_counter()
                for produced in produced_steps:
                    state, info = self._step(state, produced, waited)
                    if not self._end_step(state, info):
                        break
                    waited = time.perf_counter()
                if any_process(self.stop_signal is not None, self.agree_with):
                    return self._end_on_signal(produced_steps, state)
        except KeyboardInterrupt as exc:  # raised by a hook: callbacks may save, threads are joined
            self.interrupted = True
            self.callbacks.on_exception(self.run, exc)
            return state
        except BaseException as exc:
            self.callbacks.on_exception(self.run, exc)
            raise
        self.callbacks.on_fit_end(self.run, state)
        return state

    def _apply_restore(self, restore: Restore) -> TrainState:
        """What an `on_restore` returned, applied (`Restore.apply`); across groups each publish is a push,
        so the rollout group is told where to start first."""
        if self.groups is not None:
            self.groups.send_start(restore.state.step, restore.state.data_position, host_value(restore.state.rng))
        return restore.apply(self.callbacks, self.weights)

    def _producer(self, module: RLModule, state: TrainState) -> Producer:
        """The producer of the steps after `state`, whose weights it publishes (across groups: starting there too)."""
        if self.groups is not None:
            self.groups.send_start(state.step, state.data_position, host_value(state.rng))
        self.weights.publish(state.step, state.params, state.policy_version)
        return Producer(module, self.plan, self.source, self.weights, host_value(state.rng), max_steps=self.max_steps,
                        max_prompts=self.run.max_prompts, timeline=self.timeline, share=self.sharding.share,
                        **remote_stages(self.groups, self.sharding.share))

    def _step(self, state: TrainState, produced, began: float) -> tuple[TrainState, StepInfo]:
        """One global step on a produced batch: the hooks, the update, and the step's `StepInfo` (the callbacks'
        own metrics added, then read-only) for `on_step_end`. `began`: when the wait for this batch began."""
        data_wait = time.perf_counter() - began
        self.callbacks.on_step_start(self.run, state.step)
        self.callbacks.on_rollout_end(self.run, produced)
        before = state
        state, update, staleness = self._train_on(state, produced)
        metrics = step_metrics(produced.batch, produced.metrics, update, staleness, data_wait_s=data_wait,
                               step_s=time.perf_counter() - began)
        info = StepInfo(state.step, state, metrics, self.source.epoch(state.data_position), produced.batch,
                        previous_state=before.replace(**{name: None for name in self.donated}),
                        is_last=self.run.is_last_step(state.step, state.data_position))
        return state, self.callbacks.add_step_metrics(self.run, info)

    def _train_on(self, state: TrainState, produced: ProducedStep) -> tuple[TrainState, dict[str, float], np.ndarray]:
        """num_iterations passes of mini-batch updates over one global batch; returns the new state,
        the update metrics (means over the updates, and time/update) and each trained sample's staleness."""
        t0, began = time.perf_counter(), self.timeline.clock()
        state = self.callbacks.on_update_start(self.run, state)
        batch = produced.batch.numeric().to_host()  # every process holds the whole global batch
        params, opt_state, version, metrics, staleness = run_updates(
            self._update, batch, self.plan, self.sharding, state.params, state.opt_state, state.policy_version)
        state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                              policy_version=version, data_position=produced.data_position)
        self.last_state = state  # the state before the update was donated to it: save this one on an exception
        state = self.callbacks.on_update_end(self.run, state)
        metrics["time/update"] = time.perf_counter() - t0
        self.timeline.record("update", produced.step, began, self.timeline.clock(), samples=produced.batch.num_samples,
                             role=STAGE_ROLES["update"])
        return state, metrics, staleness

    def _end_step(self, state: TrainState, info: StepInfo) -> bool:
        """After a step's update: `on_step_end` (validation when due), then False when the run stops here, else
        the weights published (after the callbacks: a deterministic hook order in sync mode). Every process
        stops after the same step, agreed before publishing: the producer's collectives cannot interleave."""
        self.callbacks.on_step_end(self.run, info)
        self.last_state = state
        record_step(f"step {state.step}")  # for `rlbolt launch`'s line if this process dies
        if any_process(self.should_stop, self.agree_with):
            return False
        self.weights.publish(state.step, state.params, state.policy_version)
        return True

    def _end_on_signal(self, produced_steps, state: TrainState) -> TrainState:
        """SIGINT/SIGTERM: save first (`on_fit_end`), then join the producer, maybe mid-rollout."""
        self.interrupted = True
        produced_steps.request_stop()
        self.callbacks.on_fit_end(self.run, state)
        produced_steps.stop(strict=False)
        return state

    # ------------------------------------------------------------------------------------------
    def _setup(self, module: RLModule, train_data: Any, val_data: Sequence[dict] | None) -> TrainState:
        """Everything the loop runs with, in the order it is built (`rlbolt.fit_setup`); returns step 0's state."""
        self.module = module
        self.plan = check_fit(self.plan, module, train_data, val_data, val_every_n_steps=self.val_every_n_steps,
                              val_at_start=self.val_at_start, callbacks=self.callbacks)
        self.source = train_data if isinstance(train_data, PromptSource) else PromptSource(train_data, shuffle=self.shuffle, seed=self.data_seed)
        self.plans, self.groups = place_roles(self.placement, self.mesh_spec, self.weights, mode=self.mode, plan=self.plan,
                                              val_data=val_data, timeout_s=self.prefetch_timeout_s)
        self.sharding, self.agree_with = self.plans["train"], None if self.groups is None else self.groups.mine
        params = init_module(module, SetupContext(plan=self.plan, seed=self.seed, mode=self.mode, shardings=self.plans))
        self.donated = donated_fields(self.lag_steps)
        self.run = describe_run(module, self.plan, self.source, self.callbacks, self.weights, settings=self._settings(),
                                run_dir=self.run_dir, lag_steps=self.lag_steps, donated=self.donated,
                                control=self.control, timeline=self.timeline)  # after init_params: the module's card
        built = setup_update(module, params, self.sharding, grad_accum_steps=self.plan.grad_accum_steps,
                             donate=self.donated, master_weights=self.master_weights,
                             wrap_optimizer=lambda tx: self.callbacks.wrap_optimizer(self.run, tx),
                             device_memory_bytes=self.device_memory_bytes)
        self.optimizer, self.memory_plan, self._update = built.optimizer, built.memory_plan, built.update
        self.last_state = first_state(built.params, built.opt_state, self.seed, self.sharding)
        return self.last_state

    def validate(self, params: Any, val_data: Sequence[dict], step: int, *,
                 num_samples: int | None = None) -> dict[str, float]:
        """Runs `validation_step` over `val_data` in batches; returns `val/*` means (sample-weighted).

        Args:
          params: the parameters to validate.
          val_data: the rows.
          step: the global step just completed.
          num_samples: k of pass@k, passed to `validation_step(..., num_samples=k)` (None: not passed,
            the module's own setting).
        """
        options = {} if num_samples is None else {"num_samples": num_samples}
        metrics = run_validation(self.module.validation_step, params, val_data, batch_size=self.val_batch_size,
                                 seed=self.seed, share=self.sharding.share, timeline=self.timeline, step=step,
                                 options=options)
        self.callbacks.on_validation_end(self.run, step, metrics)
        return metrics

    def _settings(self) -> dict[str, Any]:
        """The Trainer's settings as a checkpoint and a dashboard record them (`RunInfo.settings`)."""
        return {"seed": self.seed, "data_seed": self.data_seed, "shuffle": self.shuffle, "mode": self.mode,
                "max_staleness": self.max_staleness, "max_steps": self.max_steps, "max_epochs": self.max_epochs,
                "val_every_n_steps": self.val_every_n_steps, "val_batch_size": self.val_batch_size}

    def _stop_while_waiting(self) -> bool:
        """A stop that ends the wait for the next step at once; with several processes a stop waits
        for the step boundary, where every process agrees on it (`any_process`)."""
        return self.should_stop and jax.process_count() == 1

