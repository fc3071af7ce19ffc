"""BatchPlan: every batch size of a run, derived and checked once, before anything compiles.

The hierarchy (docs/concepts.md has the diagram):

    global batch   = prompts_per_step x num_generations samples       (one global step)
    mini batch     = mini_batch_size samples                          (one optimizer update)
    micro batch    = what one device call processes, per stage:
                     rollout_micro_batch_size, logps_micro_batch_size, train_micro_batch_size
                     (and reward_micro_batch_size: samples per reward call, on the host)
    service batch  = lcm(rollout, logps, train micro sizes): where the producer's stages, each
                     pulling at its own size from the ExperienceDock, line up again

Users set sizes in samples; gradient-accumulation steps (mini / train_micro) and updates per
step (num_iterations x global / mini) are derived, never set.
"""

from __future__ import annotations

import dataclasses
import math

STAGES_WITH_GROUPS = ("rollout", "logps", "train", "mini")


class PlanError(ValueError):
    """One or more batch sizes do not fit together. The message lists every problem."""


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The batch sizes of a run (all counts are samples unless the name says prompts).

    Args:
      prompts_per_step: prompts drawn from the data source per global step.
      num_generations: completions sampled per prompt (the group size G).
      mini_batch_size: samples per optimizer update; default: the whole global batch.
      train_micro_batch_size: samples per gradient call; default: the mini batch (no accumulation).
      logps_micro_batch_size: samples per logps forward; default: train_micro_batch_size.
      rollout_micro_batch_size: samples per sampler call; default: the whole global batch.
      reward_micro_batch_size: samples per `on_reward` call (modules that score samples one by
        one, before `on_advantage`); default: the whole global batch.
      num_iterations: passes of updates over each global batch (mu in the GRPO paper).
      whole_groups: stages whose micro batches must hold whole groups because a group statistic
        is computed there ("rollout", "logps", "train", or "mini" for the mini batch).
      max_refill_rounds: how often the producer may draw more prompts when `on_advantage` drops
        samples (DAPO dynamic sampling); 0 means a short batch is an error.
      packing: "on" packs several samples per row in the update and the log-prob forwards
        (`rlbolt.packing`); "off" pads each sample to its own row.
      packed_row_tokens: tokens per packed row; None: the padded width (prompt + completion).
      packed_rows: packed rows per train micro batch and batch shard; None: as each step needs.
    """

    prompts_per_step: int
    num_generations: int
    mini_batch_size: int | None = None
    train_micro_batch_size: int | None = None
    logps_micro_batch_size: int | None = None
    rollout_micro_batch_size: int | None = None
    reward_micro_batch_size: int | None = None
    num_iterations: int = 1
    whole_groups: tuple[str, ...] = ()
    max_refill_rounds: int = 0
    packing: str = "off"
    packed_row_tokens: int | None = None
    packed_rows: int | None = None

    def __post_init__(self):
        _check_ints(self)
        g = self.prompts_per_step * self.num_generations
        fill = lambda name, default: object.__setattr__(self, name, default if getattr(self, name) is None else getattr(self, name))
        fill("mini_batch_size", g)
        fill("train_micro_batch_size", self.mini_batch_size)
        fill("logps_micro_batch_size", self.train_micro_batch_size)
        fill("rollout_micro_batch_size", g)
        fill("reward_micro_batch_size", g)
        object.__setattr__(self, "whole_groups", tuple(self.whole_groups))
        problems = _problems(self)
        if problems:
            raise PlanError("invalid batch plan:\n  - " + "\n  - ".join(problems))

    @property
    def global_batch_size(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def updates_per_iteration(self) -> int:
        return self.global_batch_size // self.mini_batch_size

    @property
    def updates_per_step(self) -> int:
        return self.num_iterations * self.updates_per_iteration

    @property
    def grad_accum_steps(self) -> int:
        return self.mini_batch_size // self.train_micro_batch_size

    @property
    def service_batch_size(self) -> int:
        # Every micro size divides the global batch, so their lcm does too.
        return math.lcm(self.rollout_micro_batch_size, self.logps_micro_batch_size, self.train_micro_batch_size)

    def require_whole_groups(self, *stages: str) -> BatchPlan:
        """This plan with more whole-group stages (a module declares where it needs them)."""
        return dataclasses.replace(self, whole_groups=tuple(dict.fromkeys(self.whole_groups + stages)))

    def describe(self) -> str:
        return (
            f"global {self.global_batch_size} samples ({self.prompts_per_step} prompts x {self.num_generations}), "
            f"mini {self.mini_batch_size} -> {self.updates_per_step} updates/step, "
            f"micro rollout/logps/train {self.rollout_micro_batch_size}/{self.logps_micro_batch_size}/"
            f"{self.train_micro_batch_size} (grad accumulation {self.grad_accum_steps}), service {self.service_batch_size}, "
            f"reward calls of {self.reward_micro_batch_size}"
            + (f", packed rows of {self.packed_row_tokens or 'the padded width in'} tokens" if self.packing == "on" else "")
        )


def _check_ints(plan: BatchPlan) -> None:
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if f.name == "packing":
            if v not in ("off", "on"):
                raise PlanError(f"packing={v!r} must be 'off' or 'on'")
            continue
        if f.name in ("whole_groups",):
            bad = [s for s in v if s not in STAGES_WITH_GROUPS]
            if bad:
                raise PlanError(f"whole_groups={tuple(v)}: unknown stage(s) {bad}; allowed: {STAGES_WITH_GROUPS}")
            continue
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise PlanError(f"{f.name}={v!r} must be an integer")
        minimum = 0 if f.name == "max_refill_rounds" else 1
        if v < minimum:
            raise PlanError(f"{f.name}={v} must be >= {minimum}")


def _problems(p: BatchPlan) -> list[str]:
    g = p.global_batch_size
    gtext = f"prompts_per_step={p.prompts_per_step} x num_generations={p.num_generations} = {g} samples"
    out = []
    if g % p.mini_batch_size:
        out.append(f"{gtext} is not divisible by mini_batch_size={p.mini_batch_size}; use {_suggest(g, p.mini_batch_size)}")
    if p.mini_batch_size % p.train_micro_batch_size:
        out.append(
            f"mini_batch_size={p.mini_batch_size} is not divisible by train_micro_batch_size="
            f"{p.train_micro_batch_size}; use {_suggest(p.mini_batch_size, p.train_micro_batch_size)}"
        )
    for name in ("rollout_micro_batch_size", "logps_micro_batch_size", "reward_micro_batch_size"):
        v = getattr(p, name)
        if g % v:
            out.append(f"{gtext} is not divisible by {name}={v}; use {_suggest(g, v)}")
    sizes = {"rollout": p.rollout_micro_batch_size, "logps": p.logps_micro_batch_size,
             "train": p.train_micro_batch_size, "mini": p.mini_batch_size}
    for stage in p.whole_groups:
        name = "mini_batch_size" if stage == "mini" else f"{stage}_micro_batch_size"
        v = sizes[stage]
        if v % p.num_generations:
            choices = [m for m in _divisors(g) if m % p.num_generations == 0]
            out.append(
                f"{name}={v} splits groups of num_generations={p.num_generations}, but a group statistic is "
                f"computed in stage {stage!r}; use a multiple of {p.num_generations} that divides {g}: "
                f"{_join(_nearest(choices, v))}"
            )
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _nearest(choices: list[int], value: int, k: int = 3) -> list[int]:
    return sorted(sorted(choices, key=lambda d: (abs(d - value), d))[:k])


def _join(values: list[int]) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


def _suggest(total: int, value: int) -> str:
    return _join(_nearest(_divisors(total), value))
