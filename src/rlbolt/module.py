"""RLModule: the hooks a user overrides to define an RL algorithm, with sensible defaults.

Hook order for one global step (docs/architecture.md pins it with a golden trace test):

    producer stages:  on_rollout -> compute_logps -> (on_reward) -> on_advantage   (per micro batch / global batch)
    main thread:      training_step (jitted; once per train micro batch, summed per mini batch)

Hooks receive parameters explicitly (`params`) rather than reading shared state, so the producer
thread and the training thread never race on weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from rlbolt.batch import Batch
from rlbolt.config.algorithms import register_algorithm
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.setup_context import SetupContext


@dataclasses.dataclass(frozen=True)
class ModuleCard:
    """What a module declares about its language model, for whoever needs it without knowing the
    module's class: export (`HFExport`, `rlbolt export`), checkpoint metadata, the config guard,
    LearningRateMonitor, Throughput and MetricsLogger read this, never the module's attributes.

    Attributes:
      model: the policy network (an `rlbolt.models.Decoder`, the module's own object; `hf_model`
        builds an export from it).
      model_config: its `ModelConfig` (layers, heads, head size...).
      policy_params: `params -> the policy's parameters` inside the trainable pytree (PPO nests them
        beside its value head; the identity for most modules).
      hf_model: `params -> Decoder` to export (a LoRA run's adapters merged into its base).
      tokenizer: the tokenizer object (None: none).
      tokenizer_folder: a folder holding the tokenizer's files to copy beside an export (None: none).
      lr_schedule: `count -> learning rate` of optimizer update `count` (None: the optimizer has its own).
      hparams: the settings a dashboard and a checkpoint record (None: none).
      idle_copies: name -> a holder whose `.params` is a frozen parameter pytree the module reads
        only inside `compute_logps` (the LM policy's colocated reference as "ref_params"), so
        `CPUOffload` may keep it in host memory between logps stages by setting `.params`.
    """

    model: Any
    model_config: Any
    policy_params: Callable[[Any], Any]
    hf_model: Callable[[Any], Any]
    tokenizer: Any = None
    tokenizer_folder: str | None = None
    lr_schedule: Callable[[int], float] | None = None
    hparams: Mapping[str, Any] | None = None
    idle_copies: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class RLModule:
    """Base class of every algorithm. Override the hooks; the Trainer calls them.

    Class attributes:
      algorithm_name: set it to make the class an algorithm a config can name (`algorithm.name`);
        defining the class registers it. None (the default): not selectable by name.
      algorithm_defaults: what the algorithm fills in for `algorithm.*` fields left None (e.g.
        `{"clip_high": 0.28}`; a value may be a function of the resolved config). Inherited.
      whole_groups: stages in which this module computes a group statistic, so their micro
        batches must hold whole groups ("rollout", "logps", "train", "mini"). The Trainer checks
        the BatchPlan against it before compiling anything.

    Attributes set by the Trainer before `setup`:
      context: the run's `SetupContext` (plan, seed, mode, each role's ShardingPlan), the same
        object `setup` receives; hooks read the plan from it. None before `setup`.
    """

    whole_groups: tuple[str, ...] = ()
    context: SetupContext | None = None
    algorithm_name: str | None = None
    algorithm_defaults: Mapping[str, Any] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class that sets its own `algorithm_name` registers it: `algorithm.name` in a config
        (and `rlbolt fit`) then builds this class (`rlbolt.config.algorithms`)."""
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("algorithm_name") is not None:
            register_algorithm(cls)

    # -- set-up ---------------------------------------------------------------------------
    def setup(self, context: SetupContext) -> None:
        """Builds or loads models, tokenizer and reward functions. Called once by `fit`, with the
        run's `SetupContext` (also set as `self.context` before the call)."""

    def init_params(self, rng: jax.Array) -> Any:
        """Returns the trainable parameter pytree. Default: the `nnx.Param`s of `self.model`."""
        model = getattr(self, "model", None)
        if model is None:
            raise NotImplementedError(
                f"{type(self).__name__}.init_params: set `self.model` (an nnx.Module) in setup() "
                "or override init_params(rng) to return the parameter pytree"
            )
        from flax import nnx

        return nnx.state(model, nnx.Param)

    def check_plan(self, plan: Any) -> None:
        """Refuses a BatchPlan this module cannot learn with (raise `rlbolt.plan.PlanError`).

        Called by `fit` before `setup`, so nothing is built or compiled for a run that would
        train silently wrong; e.g. a group-relative advantage needs `num_generations >= 2`.
        Default: every plan is fine."""

    def frozen_params(self) -> Any:
        """Parameters the model uses but never trains (a LoRA run's base weights), or None.

        The Trainer passes them into the jitted update as an argument (a captured constant would
        be copied into the executable) and differentiates only the `init_params` pytree, so no
        gradient of them is ever formed; `with_frozen` joins the two for `training_step`.
        """
        return None

    def with_frozen(self, params: Any, frozen: Any) -> Any:
        """What `training_step` receives: the trainable `params` joined with `frozen_params()`.

        Called inside the jitted update on traced arrays. Default: `params` (nothing frozen).
        """
        return params

    def frozen_identity(self) -> dict | None:
        """What identifies `frozen_params()`, as JSON data (e.g. its folder and a fingerprint of its
        weights). ModelCheckpoint records it and refuses to resume against a different one."""
        return None

    def card(self) -> ModuleCard | None:
        """The module's language model as a `ModuleCard` (export, checkpoint metadata, LR and FLOP
        monitors read it), valid after `setup`. Default: None (no language model: those skip)."""
        return None

    def configure_optimizers(self) -> optax.GradientTransformation:
        """The optimizer (schedules live inside it). Default: AdamW, lr 1e-6, grad-norm clip 1.0."""
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6))

    def memory_plan(self, sharding: ShardingPlan) -> dict[str, int]:
        """Per-device bytes of what this module keeps on the devices besides the trainable params
        and optimizer state (a frozen reference model, a KV cache), for the Trainer's memory
        plan, computed before anything compiles. Default: nothing.

        Args:
          sharding: the trainer's `rlbolt.distributed.ShardingPlan`.
        """
        return {}

    # -- producer-side hooks (host; may call jitted functions) --------------------------------
    def on_rollout(self, params: Any, batch: Batch) -> Batch:
        """Prompts -> completions. `batch` holds the prompt rows (one row per sample, each prompt
        repeated num_generations times) plus `group_ids`, `policy_version`, `prompt_index` and
        `sample_keys` ([N, 2] uint32, one PRNG key per sample). Must add the "rollout" stage
        columns (see rlbolt.batch) and usually `sampler_logps`."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_rollout(params, batch)")

    def compute_logps(self, params: Any, batch: Batch) -> Batch:
        """Adds `old_logps` (and `ref_logps` when a KL term needs them) in logps micro chunks.

        Default: with one iteration the behaviour policy is the sampling policy, so the sampler's
        logps are the old logps and no forward pass is spent."""
        if "old_logps" in batch:
            return batch
        if self.context is not None and self.context.plan.num_iterations == 1 and "sampler_logps" in batch:
            return batch.with_columns(old_logps=batch["sampler_logps"])
        raise NotImplementedError(
            f"{type(self).__name__}.compute_logps: num_iterations > 1 (or no sampler_logps column) needs a "
            "forward pass for old_logps; override compute_logps(params, batch)"
        )

    def on_reward(self, batch: Batch) -> Batch:
        """Adds `rewards` [N], sample by sample, per reward micro batch
        (`plan.reward_micro_batch_size`), so scoring overlaps the rollout of later samples.

        Optional: only a module that overrides it gets a reward stage; otherwise
        `on_advantage` computes the rewards itself (on the whole global batch)."""
        return batch

    def on_advantage(self, batch: Batch) -> Batch:
        """Adds `rewards` [N] (unless `on_reward` did) and `advantages` [N] or [N, C] for the whole
        global batch. May drop samples (whole groups, keeping their order); the producer then
        refills up to `plan.max_refill_rounds` times."""
        raise NotImplementedError(f"{type(self).__name__} must implement on_advantage(batch)")

    # -- training (jitted by the Trainer: pure, arrays in, arrays out) -----------------------
    def training_step(self, params: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Loss and scalar metrics for one train micro batch.

        The Trainer sums the gradients AND the metrics of a mini batch's micro batches, so
        normalise by the mini-batch totals it adds as columns: `mini_batch_num_tokens` (sum of
        `completion_mask` over the mini batch) and `mini_batch_num_samples`, both [M] broadcast.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement training_step(params, batch)")

    # -- evaluation -------------------------------------------------------------------------
    def validation_step(self, params: Any, batch: Batch) -> dict[str, float]:
        """Task metrics (accuracy, pass@k) for one batch of validation prompt rows.

        A module whose validation samples several completions per prompt may take a keyword
        `num_samples: int | None = None` (k of pass@k); `Evaluation(num_samples=k)` then passes
        it (None: the module's own setting), and refuses a module without it."""
        return {}

    # -- logging from host hooks --------------------------------------------------------------
    def log(self, name: str, value: float) -> None:
        """Records a scalar from a host hook (on_rollout/compute_logps/on_advantage); it joins
        the step's metrics. Values logged twice in one step are averaged (an exactly rounded
        sum, so the mean does not depend on the order the stages logged them in)."""
        sink = getattr(_SINK, "metrics", None)
        if sink is not None:
            sink.setdefault(name, []).append(float(value))


_SINK = threading.local()


@contextlib.contextmanager
def collect_log_values():
    """Collects `RLModule.log` calls made on this thread; yields a dict name -> list of values
    (the producer merges the lists of one step's stage calls before averaging)."""
    previous = getattr(_SINK, "metrics", None)
    _SINK.metrics = values = {}
    try:
        yield values
    finally:
        _SINK.metrics = previous


def add_log_values(values: dict[str, list[float]]) -> None:
    """Adds values collected elsewhere (another process's `collect_log_values`) to this thread's
    collection, as if `RLModule.log` had been called here; nothing when none is open."""
    sink = getattr(_SINK, "metrics", None)
    if sink is not None:
        for name, logged in values.items():
            sink.setdefault(name, []).extend(logged)


def mean_logs(values: dict[str, list[float]]) -> dict[str, float]:
    """name -> mean of its values (an exactly rounded sum: independent of the values' order)."""
    return {k: math.fsum(v) / len(v) for k, v in values.items() if v}


@contextlib.contextmanager
def collect_logs():
    """Collects `RLModule.log` calls made on this thread; yields a dict name -> mean value."""
    out: dict[str, float] = {}
    with collect_log_values() as values:
        try:
            yield out
        finally:
            out.update(mean_logs(values))
