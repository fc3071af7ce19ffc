"""Which processes take part in a checkpoint: every process, or one process group's.

    save_processes(groups, process_count)          the processes that save (the training group's)
    multiprocessing_options(processes, count)      Orbax's MultiprocessingOptions for them
    barrier(name, processes)                       a barrier of those processes only

A checkpoint is a collective: Orbax's `CheckpointManager` meets at barriers (the save's start,
every process's shards written, the commit) and one process, its primary host, writes the
metadata and renames the finished step into place. With training and rollout on process groups
of their own (`rlbolt.distributed.process_groups`), only the training group holds the state:
its processes save, over barriers that name only them (`active_processes`), with its first
process as the primary host; the rollout group saves nothing (what it needs to start again,
the step, the data position and the rng, it takes from the training group when the run starts,
and the weights from the pushes: in async mode the retained behaviour weights first). Without
groups every process saves, process 0 primary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import orbax.checkpoint as ocp

_BARRIER_TIMEOUT_S = 600


def save_processes(groups: Mapping[str, Sequence[int]] | None, process_count: int) -> tuple[int, ...]:
    """The processes that take part in a checkpoint.

    Args:
      groups: role -> process indices of a placement across processes (`Placement.process_groups`),
        or None (every role on every process).
      process_count: how many processes the run has.

    Returns:
      The training group's processes (sorted), or every process without groups.

    Raises:
      ValueError: groups without a "train" group, or naming a process outside the run (one line).
    """
    if groups is None:
        return tuple(range(process_count))
    if not groups.get("train"):
        raise ValueError(f"process groups {dict(groups)} have no 'train' group: it is the one that saves checkpoints")
    train = tuple(sorted(set(int(p) for p in groups["train"])))
    if train[0] < 0 or train[-1] >= process_count:
        raise ValueError(f"the training group {list(train)} names processes outside the run's 0..{process_count - 1}")
    return train


def multiprocessing_options(processes: Sequence[int] | None, process_count: int) -> ocp.options.MultiprocessingOptions:
    """Orbax's options for a `CheckpointManager` run by `processes` only.

    Args:
      processes: the processes that save (None, or every process: Orbax's defaults).
      process_count: how many processes the run has.

    Returns:
      The defaults (every process, process 0 primary), or `active_processes` = `processes`, their first
      as `primary_host`, and a barrier key prefix naming them (barriers of another group never collide).

    Raises:
      ValueError: an empty group, or one naming a process outside the run.
    """
    if processes is None:
        return ocp.options.MultiprocessingOptions()
    members = tuple(sorted(set(int(p) for p in processes)))
    if not members or members[0] < 0 or members[-1] >= process_count:
        raise ValueError(f"checkpoint processes {list(processes)}: give a non-empty subset of 0..{process_count - 1}")
    if members == tuple(range(process_count)):
        return ocp.options.MultiprocessingOptions()
    return ocp.options.MultiprocessingOptions(primary_host=members[0], active_processes=set(members),
                                              barrier_sync_key_prefix="rlbolt-processes-" + "-".join(map(str, members)))


def barrier(name: str, processes: Sequence[int] | None) -> None:
    """Returns when every process of `processes` (None: every process) has called it with `name`."""
    if jax.process_count() == 1 or (processes is not None and len(set(processes)) <= 1):
        return
    if processes is None or len(set(processes)) == jax.process_count():
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
        return
    from jax._src import distributed

    distributed.global_state.client.wait_at_barrier(name, _BARRIER_TIMEOUT_S * 1000, sorted(set(processes)))
