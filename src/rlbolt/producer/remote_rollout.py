"""The rollout made by another process group (a placement across processes, sync mode).

    rollout group (each process):  run_rollout_group(...)           pushes in, rollout rows out
    training group (the Producer): Producer(..., rollout=RemoteRollout(groups, share))

The rollout group runs, per step, what the Producer's feeder and rollout stage run for that step
on one host: it takes the weight push (`ProcessGroups.receive_weights`), makes its data share's
prompt rows of the step (`prompt_batch`, the same rows and sample keys as the training process
of that share makes), and runs `on_rollout` on them in the same micro batches the training
group's rollout stage takes from its dock (`rollout_micro_batch_size // shares`), on the rollout
mesh, where the rollout group's processes run the same jitted programs together. Each micro
batch's rows, with what `RLModule.log` collected, go under `rows/<step>/<micro batch>/<share>`;
the training group's rollout stage takes them in the same order (`RemoteRollout`) and checks
that they are the rows it asked for (their sample keys).
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


class RemoteRollout:
    """The training group's rollout stage: `(step, batch) -> the rollout group's rows for it`.

    Args:
      groups: the process groups (their `link`).
      share: this training process's data share (the rollout process of the same share sent its rows).
      stop: polled while waiting (True: give up with TimeoutError).
    """

    def __init__(self, groups: ProcessGroups, share: DataShare, stop: Callable[[], bool] = lambda: False):
        self.groups, self.share, self.stop = groups, share, stop
        self._taken: dict[int, int] = {}  # step -> micro batches received (one rollout thread: no lock)

    def __call__(self, step: int, batch: Batch) -> Batch:
        micro = self._taken.get(step, 0)
        self._taken[step] = micro + 1
        columns, logged = self.groups.link.take(f"rows/{step}/{micro}/{self.share.rank}", self.stop,
                                                sender=self.groups.rollout[self.share.rank])
        rows = Batch(columns)
        if rows.num_samples != batch.num_samples or not np.array_equal(rows["sample_keys"], batch["sample_keys"]):
            raise RuntimeError(f"step {step}: micro batch {micro} of the rollout group ({rows.num_samples} rows) is not "
                               f"the one the training group asked for ({batch.num_samples} rows); both groups must run "
                               "the same plan, data and seed")
        add_log_values(logged)
        return rows


def run_rollout_group(module: RLModule, plan: BatchPlan, source: PromptSource, groups: ProcessGroups,
                      abstract_params: Any, seed: int, share: DataShare, *, start_step: int, start_position: int,
                      max_steps: int | None, max_prompts: int | None, stop: threading.Event | None = None) -> int:
    """The rollout group's loop (sync mode): for every weight push, the step it rolls out.

    Args:
      module: the set-up module (its `on_rollout` runs on the rollout mesh).
      plan: the batch sizes (the training group's).
      source: the prompts (the training group's, in the same order).
      groups: the process groups (this process in the rollout group).
      abstract_params: the parameter tree's shapes (what the push fills in).
      seed: the run's seed (the sample keys derive from the training group's `state.rng`, made from it).
      share: this process's data share on the rollout mesh.
      start_step: the first step to roll out.
      start_position: the prompt counter at that step.
      max_steps: steps to produce (None: until the prompts run out).
      max_prompts: prompt counter limit, or None.
      stop: set: return after the current push.

    Returns:
      How many steps this process rolled out.
    """
    base_rng = np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), 1))  # the training group's state.rng
    step, position, size = start_step, start_position, plan.rollout_micro_batch_size // share.size
    produced = 0
    while stop is None or not stop.is_set():
        pushed = groups.receive_weights(abstract_params)  # the weights after `step` steps (sync: on-policy)
        if pushed is None:
            break
        params, version = pushed
        if (max_steps is not None and step >= max_steps) or (
                max_prompts is not None and position + plan.prompts_per_step > max_prompts):
            continue  # the training group's last publish: nothing left to roll out; wait for its end
        prompts = -(-plan.prompts_per_step // share.size) * share.size
        batch = prompt_batch(source, share, base_rng, plan.num_generations, step, 0, position, prompts, version)
        for micro, lo in enumerate(range(0, batch.num_samples, size)):
            with collect_log_values() as logged:
                rows = check_stage(module.on_rollout(params, batch.slice(lo, lo + size)), "rollout")
            groups.link.put(f"rows/{step}/{micro}/{share.rank}", (dict(rows), logged))
        step, position, produced = step + 1, position + prompts, produced + 1
    return produced
