"""The rollout made by another process group (a placement across processes, sync or async mode).

    rollout group (each process):  run_rollout_group(...)           pushes in, rollout rows out
    training group (the Producer): Producer(..., rollout=RemoteRollout(groups, share))

The rollout group runs, per step, what the Producer's feeder and rollout stage run for that step
on one host: it takes the weight push (`ProcessGroups.receive_weights`), makes its data share's
prompt rows of the step (`prompt_batch`, the same rows and sample keys as the training process
of that share makes), and runs `on_rollout` on them in the same micro batches the training
group's rollout stage takes from its dock (`rollout_micro_batch_size // shares`), on the rollout
mesh, where the rollout group's processes run the same jitted programs together. Each micro
batch's rows, with what `RLModule.log` collected, go under `rows/<step>/<micro batch>/<share>`
into the dock of the training process of the same share (Arrow Flight: `groups.rows`,
`rlbolt.distributed.group_rows`); the training group's rollout stage takes them in the same
order (`RemoteRollout`) and checks
that they are the rows it asked for (their sample keys and policy version).

With refill rounds (`plan.max_refill_rounds`, DAPO's dynamic sampling) the training group's advantage
stage decides after each round how many samples the step still misses; its first process sends
that to each rollout process (`RemoteRollout.decided`, under `refill/<step>/<round>/<process>`),
which rolls out the refill round's prompts (the next ones in the data, with the round's sample
keys, as the one-process feeder draws them) into the same step's micro batches, or goes on to the
next step on 0. The prompt counter thus advances by the refills on both sides.

Which weights roll out step s: those after `max(0, s - lag)` steps (`weights_for_step`: lag 0
in sync mode, `Trainer.lag_steps` in async mode), the rule of the producer in one process. The
training group pushes after every step (the weights after k steps, k = 0, 1, ...); before each
step the rollout group joins pushes while the weights it holds are older than the step needs
(`takes_push`), so it rolls out up to `lag` steps ahead of training and never with weights more
than `lag` steps old. The weights a step used are thus fixed by the step, not by timing: the
run's rows, metrics and parameters are those of the run in one process. After its last step it
joins the remaining pushes until the training group ends. Why not "every push that is ready":
the weights of a step would then depend on which process was faster, so a run could neither
be compared with the one-process run nor resumed exactly (the checkpoint keeps the weights
the next steps need, by this rule); and little would be gained, since the training group
waits at each push for the rollout group anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from rlbolt.batch import Batch, check_stage
from rlbolt.data.source import PromptSource
from rlbolt.distributed.process_groups import ProcessGroups
from rlbolt.distributed.sharding import DataShare
from rlbolt.module import RLModule, add_log_values, collect_log_values
from rlbolt.plan import BatchPlan
from rlbolt.producer.prompt_rows import prompt_batch
from rlbolt.producer.weights import weights_for_step
from rlbolt.utils.step_beacon import record_step


def takes_push(step: int, lag: int, held: int | None) -> bool:
    """Whether the rollout group joins the next weight push before it rolls out `step`.

    Args:
      step: the next step to roll out (0-based).
      lag: how many steps rollout may run ahead of training (0: sync mode).
      held: the steps completed of the weights it holds (None: none yet).

    Returns:
      True while `held` is older than the weights `step` needs (`weights_for_step(step, lag)`).
    """
    return held is None or held < weights_for_step(step, lag)


class RemoteRollout:
    """The training group's rollout stage: `(step, batch) -> the rollout group's rows for it`.

    Args:
      groups: the process groups (their `rows`).
      share: this training process's data share (the rollout process of the same share sent its rows).
      stop: polled while waiting (True: give up with TimeoutError).
    """

    def __init__(self, groups: ProcessGroups, share: DataShare, stop: Callable[[], bool] = lambda: False):
        self.groups, self.share, self.stop = groups, share, stop
        self._taken: dict[int, int] = {}  # step -> micro batches received (one rollout thread: no lock)

    def __call__(self, step: int, batch: Batch) -> Batch:
        micro = self._taken.get(step, 0)
        self._taken[step] = micro + 1
        columns, logged = self.groups.rows.take(f"rows/{step}/{micro}/{self.share.rank}", self.stop,
                                                sender=self.groups.rollout[self.share.rank])
        rows = Batch(columns)
        if rows.num_samples != batch.num_samples or not np.array_equal(rows["sample_keys"], batch["sample_keys"]):
            raise RuntimeError(f"step {step}: micro batch {micro} of the rollout group ({rows.num_samples} rows) is not "
                               f"the one the training group asked for ({batch.num_samples} rows); both groups must run "
                               "the same plan, data and seed")
        made, asked = np.asarray(rows["policy_version"]), np.asarray(batch["policy_version"])
        if not np.array_equal(made, asked):
            raise RuntimeError(f"step {step}: the rollout group made micro batch {micro} with policy version "
                               f"{made.max()}, the training group asked for {asked.max()}; both groups must run the "
                               "same trainer.mode and max_staleness")
        add_log_values(logged)
        return rows

    def decided(self, step: int, round_index: int, missing: int) -> None:
        """With refill rounds: tells each rollout process what the training group's advantage stage decided
        after round `round_index` of `step` (the samples still missing; 0: the step is full), so it makes
        the refill round's rows or goes on to the next step (`refill_rounds`). The group's first process
        sends; every training process reaches the same decision (the advantage stage sees the whole round).

        Args:
          step: the step (0-based).
          round_index: the round just decided (0: the step's first prompts).
          missing: samples still missing.
        """
        if self.groups.leader:
            for process in self.groups.rollout:
                self.groups.link.put(f"refill/{step}/{round_index}/{process}", int(missing))


def remote_stages(groups: ProcessGroups | None, share: DataShare) -> dict[str, Any]:
    """The Producer's `rollout` and `decided` arguments on a training process of `groups` (the rollout
    group makes the rollouts and the refill rounds); none without groups (the producer's own stages).

    Args:
      groups: the process groups, or None.
      share: this training process's data share.
    """
    if groups is None:
        return {}
    remote = RemoteRollout(groups, share)
    return {"rollout": remote, "decided": remote.decided}


def run_rollout_group(module: RLModule, plan: BatchPlan, source: PromptSource, groups: ProcessGroups,
                      abstract_params: Any, share: DataShare, *, base_rng: Any, start_step: int, start_position: int,
                      max_steps: int | None, max_prompts: int | None, lag: int = 0,
                      stop: threading.Event | None = None) -> int:
    """The rollout group's loop: the pushes it needs, then each step's rollout (module doc).

    Args:
      module: the set-up module (its `on_rollout` runs on the rollout mesh).
      plan: the batch sizes (the training group's).
      source: the prompts (the training group's, in the same order).
      groups: the process groups (this process in the rollout group).
      abstract_params: the parameter tree's shapes (what the push fills in).
      share: this process's data share on the rollout mesh.
      base_rng: the training group's `state.rng` (`ProcessGroups.receive_start`: on a resume, the
        restored one), from which every sample key derives, as in the one-process producer.
      start_step: the first step to roll out.
      start_position: the prompt counter at that step.
      max_steps: steps to produce (None: until the prompts run out).
      max_prompts: prompt counter limit, or None.
      lag: how many steps it may roll out ahead of training (`Trainer.lag_steps`; 0: sync mode).
      stop: set: return after the current push or step.

    Returns:
      How many steps this process rolled out.
    """
    step, position, size = start_step, start_position, plan.rollout_micro_batch_size // share.size
    produced, held, params = 0, None, None
    while stop is None or not stop.is_set():
        done = (max_steps is not None and step >= max_steps) or (
            max_prompts is not None and position + plan.prompts_per_step > max_prompts)
        if done or takes_push(step, lag, held):  # done: join the training group's remaining pushes
            pushed = groups.receive_weights(abstract_params)
            if pushed is None:
                break
            params, version, held = pushed
            continue
        if held != weights_for_step(step, lag):
            raise RuntimeError(f"step {step}: the rollout group holds the weights after {held} steps, the step needs "
                               f"those after {weights_for_step(step, lag)} (lag {lag}); both groups must run the "
                               "same trainer.mode and max_staleness")
        micro, prompts, round_index = 0, plan.prompts_per_step, 0
        while True:  # the step's first prompts, then each refill round the training group asks for
            prompts = -(-prompts // share.size) * share.size  # equal shares, as the producer's feeder
            batch = prompt_batch(source, share, base_rng, plan.num_generations, step, round_index, position, prompts,
                                 version)
            position += prompts
            for lo in range(0, batch.num_samples, size):  # micro batches counted over the step's rounds
                with collect_log_values() as logged:
                    rows = check_stage(module.on_rollout(params, batch.slice(lo, lo + size)), "rollout")
                groups.rows.put(f"rows/{step}/{micro}/{share.rank}", (dict(rows), logged))
                micro += 1
            missing = refill_decision(groups, plan, step, round_index)
            if not missing:
                break
            round_index, prompts = round_index + 1, -(-missing // plan.num_generations)
        record_step(f"rolled out step {step + 1}")  # 1-based, as the training group counts (`rlbolt launch`)
        step, produced = step + 1, produced + 1
    return produced


def refill_decision(groups: ProcessGroups, plan: BatchPlan, step: int, round_index: int) -> int:
    """Rollout group: the samples `step` still misses after round `round_index` (`RemoteRollout.decided`);
    0 without refill rounds (the step is its first round).

    Args:
      groups: the process groups (this process in the rollout group).
      plan: the batch sizes (`max_refill_rounds`).
      step: the step (0-based).
      round_index: the round just rolled out.
    """
    if not plan.max_refill_rounds:
        return 0
    return int(groups.link.take(f"refill/{step}/{round_index}/{jax.process_index()}", sender=min(groups.train)))
