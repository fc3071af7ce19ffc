"""A placement across processes: each process in one group, the rendezvous points between groups.

    groups = ProcessGroups.of(placement, plans)      None: every role on every process (colocated)
    groups = join_placement(placement, plans, weights, ...)   a fit's placement wired (groups, or WeightSync)
    groups.role                                      "train" or "rollout": this process's group
    groups.join_fit(mode, plan, val, ws)             a fit's set-up: refusals, the group's agreements, attach
    groups.attach(weight_store)                      training group: each publish pushes (send_weights)
    groups.send_weights(params, version, steps)      training group: the weight push of one publish
    params, version, steps = groups.receive_weights(abstract)   rollout group: that push (None: the end)
    groups.rows.put(key, rows) / groups.rows.take(key)    the rollout rows (Arrow Flight: group_rows.py)
    groups.link.put(key, obj) / groups.link.take(key)    small host objects between the groups
    groups.send_start(step, position, rng) / groups.receive_start()   where the rollout group starts (a resume)

Each process runs only its group's stages and jitted programs, on its group's sub-mesh (MPMD):
the training group runs the Trainer's loop (logps, advantages, updates, callbacks), the
rollout group a loop of weight pushes and rollouts (`rlbolt.producer.remote_rollout`). Per step
there are two cross-group transfers, which both groups make in the same order: the weight push
(train -> rollout: `ProcessWeightPush`, a `jax.device_put` across processes, with the policy
version; announced under a key that names the steps its weights completed) and the rollout rows
(rollout -> train: each rollout data share's rows of each rollout micro batch, as Arrow columns
into a dock that the training process of that share serves over Arrow Flight: `FlightRows`).
In async mode the rollout group runs up to the lag ahead: it joins the push of the weights
after k steps only when a step it rolls out needs them, and until then the training
group's push of them waits for it (the push is one transfer with both sides). Collectives
inside a group name only its processes (`rlbolt.distributed.agree`'s `group`,
`DataShare.processes`).

The `GroupLink` is the key-value store of JAX's coordination service (the gRPC service that
`jax.distributed.initialize` starts on process 0): one pickled object per key, read once and
deleted. It carries the control messages (starts, push announcements, the Flight dock's address)
and each micro batch's few host objects; why the rows go through Arrow Flight and not the
key-value store or a `device_put` like the weights: docs/howto/multi-host.md.
"""

from __future__ import annotations

import itertools
import pickle
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from rlbolt.distributed.agree import set_default_group
from rlbolt.distributed.group_rows import FlightRows
from rlbolt.distributed.mesh import MeshError
from rlbolt.distributed.placement import WeightSync
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.distributed.shutdown import skip_shutdown_barrier
from rlbolt.distributed.weight_push import ProcessWeightPush

_LINKS = itertools.count()  # one key prefix per GroupLink: every process makes its links in the same order
_POLL_MS = 500
DEFAULT_LINK_TIMEOUT_S = 1800.0  # a wait between the groups when trainer.prefetch_timeout_s is None
class GroupLink:
    """Host objects from one process group to another, through the coordination service's key-value store.

    Args:
      timeout_s: how long `take` waits for a key (None: until `stop` says so).
    """

    def __init__(self, timeout_s: float | None = None):
        from jax._src import distributed

        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("GroupLink needs jax.distributed (rlbolt.distributed.initialize) to be initialised")
        self.prefix, self.timeout_s = f"rlbolt/groups/{next(_LINKS)}/", timeout_s

    def put(self, key: str, obj: Any) -> None:
        """Stores `obj` (picklable) under `key`, for one `take` on another process."""
        self.client.key_value_set_bytes(self.prefix + key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))

    def barrier(self, key: str, processes: tuple[int, ...]) -> None:
        """Returns when every process of `processes` has called it with `key` (only they take part;
        the runtime's error after `timeout_s`, or an hour when it is None)."""
        if len(processes) > 1:
            timeout_s = 3600.0 if self.timeout_s is None else self.timeout_s
            self.client.wait_at_barrier(self.prefix + key, int(timeout_s * 1000), list(processes))

    def take(self, key: str, stop: Callable[[], bool] = lambda: False, sender: int | None = None) -> Any:
        """Waits for `key`, returns its object and deletes it.

        Args:
          key: the key (without this link's prefix).
          stop: polled while waiting (True: give up).
          sender: the process that writes `key` (named in the error).

        Raises:
          TimeoutError: nothing arrived within `timeout_s` (one line naming the sender and
            `trainer.prefetch_timeout_s`; this process then exits with status 1 without JAX's
            shutdown barrier, which would wait for the silent process), or `stop()` became True.
        """
        began = time.monotonic()
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(self.prefix + key, _POLL_MS)
                break
            except Exception as exc:  # noqa: BLE001 - the runtime's error type: DEADLINE_EXCEEDED is a poll slice
                if "DEADLINE_EXCEEDED" not in str(exc) and "deadline" not in str(exc).lower():
                    raise
            waited = time.monotonic() - began
            if stop():
                raise TimeoutError(f"process {jax.process_index()}: stopped while waiting for {key!r}")
            if self.timeout_s is not None and waited > self.timeout_s:
                who = "the other process group" if sender is None else f"process {sender}"
                skip_shutdown_barrier()
                raise TimeoutError(f"process {jax.process_index()}: nothing from {who} under {key!r} for {waited:.0f} s "
                                   f"(trainer.prefetch_timeout_s={self.timeout_s:g}): it is stopped or stuck (see its "
                                   "stack, e.g. py-spy dump), or its step is slower: raise trainer.prefetch_timeout_s")
        self.client.key_value_delete(self.prefix + key)
        return pickle.loads(data)


class ProcessGroups:
    """This process's group in a placement across processes, and the transfers between the groups.

    Args:
      groups: role -> process indices (`Placement.process_groups`).
      plans: role -> ShardingPlan (`Placement.plans`).
      link: the host channel (default: a new `GroupLink` with `timeout_s`).
      timeout_s: how long a process waits for the other group (the rows, a push; None:
        `DEFAULT_LINK_TIMEOUT_S`): a silent process ends the run in one line instead of a hang.

    Raises:
      MeshError: this process is in neither group, or the groups' data shares differ (one line each).
    """

    def __init__(self, groups: Mapping[str, tuple[int, ...]], plans: Mapping[str, ShardingPlan],
                 link: GroupLink | None = None, timeout_s: float | None = None):
        self.train, self.rollout = tuple(groups["train"]), tuple(groups["rollout"])
        me = jax.process_index()
        if me not in self.train + self.rollout:
            raise MeshError(f"placement: process {me} has devices in neither train {list(self.train)} nor rollout "
                            f"{list(self.rollout)}; give every process's devices to one of them")
        self.role = "train" if me in self.train else "rollout"
        self.plans = plans
        check_shares(plans["train"], plans["rollout"])
        self.push = ProcessWeightPush(plans["train"], plans["rollout"])
        timeout_s = DEFAULT_LINK_TIMEOUT_S if timeout_s is None else timeout_s
        self.link = link if link is not None else GroupLink(timeout_s)
        rank = plans[self.role].share.rank  # the rows go between the two processes of one data share
        self.rows = FlightRows(self.link, self.role, peer=(self.rollout if self.role == "train" else self.train)[rank],
                               rank=rank, timeout_s=timeout_s)
        self._pushes = 0  # how many weight pushes this process took part in (the key of the next one)
        self._started: tuple | None = None  # what send_start sent (the training group)

    @property
    def mine(self) -> tuple[int, ...]:
        """The processes of this process's group (the ones it agrees with at step boundaries)."""
        return self.train if self.role == "train" else self.rollout

    @classmethod
    def of(cls, placement: Any, plans: Mapping[str, ShardingPlan],
           timeout_s: float | None = None) -> ProcessGroups | None:
        """The groups of `placement` when it spans processes (None: colocated, or one process);
        `timeout_s`: the wait for the other group (see the class)."""
        if placement.colocated or jax.process_count() == 1:
            return None
        return cls(placement.process_groups(jax.devices()), plans, timeout_s=timeout_s)

    @property
    def leader(self) -> bool:
        """The first process of this process's group (it writes the group's keys)."""
        return jax.process_index() == min(self.train if self.role == "train" else self.rollout)

    def join_fit(self, mode: str, plan: Any, val_data: Any, weights: Any) -> None:
        """A fit's set-up across groups: what is not run is refused (`check_fit_across`), every agreement
        of the fit (callbacks' too) stays in this process's group, and the training group's publishes
        push to the rollout group (`attach`).

        Args:
          mode: the Trainer's mode.
          plan: the BatchPlan.
          val_data: the fit's validation rows, or None.
          weights: the Trainer's `WeightStore`.
        """
        check_fit_across(mode, plan, val_data)
        set_default_group(self.mine)
        self.attach(weights)

    def attach(self, weights: Any) -> None:
        """Training group: every publish to `weights` (a `WeightStore`) pushes to the rollout group, and
        the producer feeds step s only once the weights after s steps are published: the training
        group's own collectives (logps, gathers, updates) then run one step at a time, in one order
        on each of its processes, while the rollout group runs ahead (async mode)."""
        if self.role == "train":
            weights.transfer, weights.feed_ahead = self.send_weights, 0

    def send_weights(self, params: Any, policy_version: int, steps_completed: int) -> None:
        """Training group: announces, then makes, the next weight push (each training process calls it);
        `steps_completed`: the steps the weights are after (the rollout group knows by it which to join)."""
        if self.leader:
            for process in self.rollout:  # a key each: a key is read once
                self.link.put(f"push/{self._pushes}/{process}", int(steps_completed))
        for process in self.rollout:  # every receiver is at the push (see receive_weights)
            self.link.take(f"ready/{self._pushes}/{process}/{jax.process_index()}", sender=process)
        self.push(params, policy_version)
        self._pushes += 1

    def send_start(self, step: int, data_position: int, base_rng: Any) -> None:
        """Training group: tells each rollout process where to start, before the first push: the first step
        to roll out, its prompt counter and the run's base key (`state.rng`; on a resume, the restored
        checkpoint's, so the sample keys are the ones the run had, whatever `trainer.seed` is now).

        Sent once per fit; a second call with the same start does nothing (the Trainer sends it before a
        restore's retained weights are pushed, and again when its producer starts).

        Args:
          step: the first step to roll out (steps completed).
          data_position: the prompt counter at that step.
          base_rng: the run's base key as raw uint32 (None: no step follows, see `end`).

        Raises:
          RuntimeError: a second call with another start (the rollout group already has the first).
        """
        start = (int(step), int(data_position), None if base_rng is None else np.asarray(base_rng))
        if self._started:
            sent = self._started
            if sent[:2] != start[:2] or not np.array_equal(sent[2], start[2]):
                raise RuntimeError(f"the rollout group was told to start at step {sent[0]} (prompt {sent[1]}), now "
                                   f"at step {start[0]} (prompt {start[1]}): a callback's on_fit_start must not move "
                                   "the step, data position or rng across process groups")
            return
        if self.leader:
            for process in self.rollout:
                self.link.put(f"start/{process}", start)
        self._started = start

    def receive_start(self) -> dict[str, Any]:
        """Rollout group: `{"start_step", "start_position", "base_rng"}` from the training group (`send_start`)."""
        step, position, base_rng = self.link.take(f"start/{jax.process_index()}", sender=min(self.train))
        return {"start_step": step, "start_position": position, "base_rng": base_rng}

    def end(self) -> None:
        """Training group: tells the rollout group that no push follows (its loop returns; ended before the
        start, e.g. a restore that failed, it is sent a start first, so that it reaches the end)."""
        if not self._started:
            self.send_start(0, 0, None)  # no step follows: the rollout group never draws a key
        if self.leader:
            for process in self.rollout:
                try:
                    self.link.put(f"push/{self._pushes}/{process}", "end")
                except Exception as exc:  # noqa: BLE001 - the runtime's error type
                    # a step that failed after announcing its push: the announcement stays, and the error
                    # on the way out is the step's, not this one
                    if "ALREADY_EXISTS" not in str(exc):
                        raise
        self.rows.close()

    def receive_weights(self, abstract: Any) -> tuple[Any, int, int] | None:
        """Rollout group: the next push's parameters on the rollout mesh, their policy version and the
        steps they are after (None when the training group has ended)."""
        steps = self.link.take(f"push/{self._pushes}/{jax.process_index()}", sender=min(self.train))
        if steps == "end":
            return None
        # Seen on CPU (JAX 0.10): a receiver that posts its side more than a minute before the senders' first
        # push gives up looking for their transfer server (it starts with that push), and set-up times differ
        # by minutes on a busy host. So the rollout group meets first, then tells the senders it is there.
        self.link.barrier(f"push/{self._pushes}", self.rollout)
        for process in self.train:
            self.link.put(f"ready/{self._pushes}/{jax.process_index()}/{process}", True)
        self._pushes += 1
        params, version = self.push(abstract)
        return params, version, steps


def join_placement(placement: Any, plans: Mapping[str, ShardingPlan], weights: Any, *, mode: str, plan: Any,
                   val_data: Any, timeout_s: float | None) -> ProcessGroups | None:
    """A fit's placement, wired to its `WeightStore`: across processes this process's groups, joined (the
    refusals, the group's agreements, each publish a push: `ProcessGroups.join_fit`); on sub-meshes of one
    process each publish reshards onto the rollout mesh (`WeightSync`); colocated, nothing.

    Args:
      placement: the Trainer's `Placement`.
      plans: role -> ShardingPlan (`Placement.plans`).
      weights: the Trainer's `WeightStore`.
      mode: the Trainer's mode.
      plan: the BatchPlan.
      val_data: the fit's validation rows, or None.
      timeout_s: the wait for the other group (`trainer.prefetch_timeout_s`).

    Returns:
      The ProcessGroups across processes, else None.
    """
    groups = ProcessGroups.of(placement, plans, timeout_s=timeout_s)
    if groups is not None:
        groups.join_fit(mode, plan, val_data, weights)
    elif not placement.colocated:
        sync = WeightSync(plans["train"], plans["rollout"])
        weights.transfer = lambda params, *_: sync(params)
    return groups


def check_shares(train: ShardingPlan, rollout: ShardingPlan) -> None:
    """Both groups cut every batch into the same data shares, one per process.

    Raises:
      MeshError: naming both meshes' share counts and process counts, and the fix.
    """
    counts = {role: (plan.share.size, len({d.process_index for d in plan.mesh.devices.flat}))
              for role, plan in (("train", train), ("rollout", rollout))}
    if len(set(counts.values())) != 1 or any(shares != processes for shares, processes in counts.values()):
        raise MeshError("placement across processes: the rollout rows go from each rollout process to the training "
                        "process of the same data share, so both groups need one batch shard per process and the same "
                        f"count (train: {counts['train'][0]} shares on {counts['train'][1]} processes, rollout: "
                        f"{counts['rollout'][0]} on {counts['rollout'][1]}); put tp inside a process")


def check_fit_across(mode: str, plan: Any, val_data: Any) -> None:
    """What a fit across process groups does not run yet, refused before anything compiles.

    Args:
      mode: the Trainer's mode (both run; async: the rollout group runs ahead, `remote_rollout`).
      plan: the BatchPlan (refill rounds run: the rollout group makes them, `remote_rollout`).
      val_data: validation rows (validation is not run: it samples on the rollout group).

    Raises:
      ValueError: one line naming the setting and the fix.
    """
    unsupported = []
    if mode not in ("sync", "async"):
        unsupported.append(f"trainer.mode={mode!r} (use sync or async)")
    if val_data is not None and len(val_data) > 0:
        unsupported.append("validation data (validate after the run, or use placement: colocated)")
    if unsupported:
        raise ValueError("placement across processes runs without validation yet; "
                         "this fit has " + "; ".join(unsupported))
