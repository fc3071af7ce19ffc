"""The config's rules across fields: what `resolve` refuses after every field's own type and
range were checked when it was read (`config_fields`). Each rule is one `ConfigError` line that
names the fields and the fix. Imports no JAX unless a rule needs it (placement, LoRA)."""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any

from rlbolt.config.fields import ConfigError
from rlbolt.config.registries import reward_term_names
from rlbolt.config.sections import METRIC_WRITERS

if TYPE_CHECKING:
    from rlbolt.config.sections import RunConfig



_REFERENCE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def check_rules(cfg: RunConfig) -> None:
    """Rules across fields (each field's own type and range were checked when it was read)."""
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer
    if not 0 <= a.overlong_cache_length <= r.max_new_tokens:
        raise ConfigError(
            f"algorithm.overlong_cache_length={a.overlong_cache_length} must lie in [0, rollout.max_new_tokens="
            f"{r.max_new_tokens}]"
        )
    sizes = dataclasses.asdict(cfg.mesh)  # every axis the section has
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size} must be a positive integer or -1 (the devices the other axes leave)")
    if sum(size == -1 for size in sizes.values()) > 1:
        raise ConfigError(f"mesh has -1 on more than one axis ({dataclasses.asdict(cfg.mesh)}); at most one takes the rest")
    bad = [m for m in cfg.callbacks.metrics if m not in METRIC_WRITERS]
    if bad:
        raise ConfigError(f"callbacks.metrics has unknown writer(s) {bad}; choose from {list(METRIC_WRITERS)}")
    if cfg.objects.reward is None:
        terms = reward_term_names()
        unknown_terms = [t for t in cfg.reward.weights if t not in terms]
        if unknown_terms:
            raise ConfigError(f"reward.weights has unknown term(s) {unknown_terms}; known terms: {list(terms)}")
        if r.env is not None and "env" not in cfg.reward.weights:
            raise ConfigError(f"rollout.env={r.env!r} but reward.weights={dict(cfg.reward.weights)} has no env term, so "
                              "the environment's rewards would not count; add reward.weights.env (e.g. env: 1.0), or "
                              "env: 0 to score the transcripts with the other terms alone")
        if not any(w != 0 for w in cfg.reward.weights.values()):
            raise ConfigError(f"reward.weights={dict(cfg.reward.weights)} gives no term a non-zero weight; "
                              "e.g. reward.weights={answer: 1.0}")
    has_val = cfg.data.val is not None or cfg.data.builtin_val_rows > 0
    metric = cfg.callbacks.early_stopping_metric
    if metric and metric.startswith("val/") and not (has_val and t.val_every_n_steps):
        raise ConfigError(f"callbacks.early_stopping_metric={metric} is checked at each validation, but the run "
                          "validates " + ("only after the last step; set trainer.val_every_n_steps" if has_val else
                                          "never; set data.val (or data.builtin_val_rows) and trainer.val_every_n_steps"))
    if a.dynamic_sampling and cfg.plan.max_refill_rounds == 0:
        raise ConfigError("algorithm.dynamic_sampling drops groups whose rewards are all equal, but "
                          "plan.max_refill_rounds=0 cannot refill the batch; set plan.max_refill_rounds >= 1 (e.g. 4)")
    if t.val_every_n_steps is not None and not has_val:
        raise ConfigError(f"trainer.val_every_n_steps={t.val_every_n_steps} but the run has no validation rows; "
                          "set data.val (or data.builtin_val_rows > 0), or trainer.val_every_n_steps=null")
    if t.val_at_start and not has_val:
        raise ConfigError("trainer.val_at_start=true but the run has no validation rows; set data.val "
                          "(or data.builtin_val_rows > 0), or trainer.val_at_start=false")
    if r.env is not None and not _REFERENCE.fullmatch(r.env):
        raise ConfigError(f"rollout.env={r.env!r} must look like 'package.module:Factory' (a callable row -> Environment)")
    if r.engine not in ("native", "vllm") and not _REFERENCE.fullmatch(r.engine):
        raise ConfigError(f"rollout.engine={r.engine!r}: use native, vllm, or a factory 'package.module:make_engine'")
    _check_routing(cfg)
    _check_mode(cfg)
    _check_packing(cfg)
    if t.placement != "colocated":
        _check_placement(t.placement)


def _check_packing(cfg: RunConfig) -> None:
    p, budget = cfg.plan, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    for name in ("packed_row_tokens", "packed_rows"):
        if getattr(p, name) is not None and p.packing != "on":
            raise ConfigError(f"plan.{name}={getattr(p, name)} is read only with plan.packing=on; set "
                              f"plan.packing=on, or plan.{name}=null")
    if p.packed_row_tokens is not None and cfg.rollout.env is None and p.packed_row_tokens < budget:
        raise ConfigError(f"plan.packed_row_tokens={p.packed_row_tokens} is below data.max_prompt_tokens + "
                          f"rollout.max_new_tokens = {budget}, so a sample may not fit a row; use at least {budget} "
                          "(or null: the padded width)")


def _check_placement(value: Any) -> None:
    from rlbolt.distributed.placement import Placement  # imports JAX: only for a placement on sub-meshes

    try:
        Placement.of(value)
    except ValueError as error:
        raise ConfigError(f"trainer.{error}") from None


def _check_routing(cfg: RunConfig) -> None:
    """Router replay needs the rollout's recorded routing, which only the native engine records
    for single completions. (A dense model is refused when the module sees the model.)"""
    r = cfg.rollout
    if cfg.algorithm.router_replay and not r.record_routing:
        raise ConfigError("algorithm.router_replay=true replays the experts the rollout chose, but the rollout does "
                          "not record them; set rollout.record_routing=true")
    if r.record_routing and r.engine != "native":
        raise ConfigError(f"rollout.record_routing=true is recorded by the native engine only (rollout.engine="
                          f"{r.engine}); set rollout.engine=native or rollout.record_routing=false")
    if r.record_routing and r.env is not None:
        raise ConfigError("rollout.record_routing=true is not recorded for multi-turn episodes (rollout.env); set "
                          "rollout.record_routing=false")


def _check_mode(cfg: RunConfig) -> None:
    """mode=async needs a max_staleness that lets the producer run at least one step ahead."""
    t = cfg.trainer
    if t.mode == "sync":
        if t.max_staleness is not None:
            raise ConfigError(f"trainer.max_staleness={t.max_staleness} is only used with trainer.mode=async; "
                              "set trainer.mode=async or trainer.max_staleness=null")
        return
    from rlbolt.plan import BatchPlan, PlanError

    try:
        updates = BatchPlan(**dataclasses.asdict(cfg.plan)).updates_per_step
    except PlanError:
        return  # the plan's own error is reported when the run is built
    if t.max_staleness is None or t.max_staleness < 2 * updates - 1:
        raise ConfigError(
            f"trainer.mode=async needs trainer.max_staleness >= {2 * updates - 1} (got {t.max_staleness}): with "
            f"{updates} update(s) per step that lets the producer run one step ahead; or use trainer.mode=sync")
