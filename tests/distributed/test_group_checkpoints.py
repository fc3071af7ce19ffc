"""Checkpoints across process groups, without launching processes: which processes save, and where the
rollout group starts (`rlbolt.checkpointing.processes`, `ProcessGroups.send_start`): the restored step,
data position and rng, told before a resume's retained weights are pushed; and (slow, two plain
subprocesses) a checkpoint written on 2 devices read on a process with 1, as `rlbolt export` does.

The slow tests that launch 4 processes (a training process killed inside a save, then the exact
resume; process 0 killed) are in test_group_resume.py.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.checkpointing import io as checkpoint_io
from rlbolt.checkpointing.io import CheckpointIO
from rlbolt.checkpointing.processes import multiprocessing_options, save_processes
from rlbolt.distributed.agree import set_default_group
from rlbolt.callback import CallbackList
from rlbolt.data import gsm8k_style_rows
from rlbolt.data.source import PromptSource
from rlbolt.distributed.process_groups import ProcessGroups
from rlbolt.distributed.sharding import DataShare
from rlbolt.plan import BatchPlan
from rlbolt.producer import remote_rollout
from rlbolt.producer.remote_rollout import run_rollout_group
from rlbolt.producer.weights import WeightStore
from rlbolt.run_info import Restore
from rlbolt.state import TrainState
from rlbolt.trainer import Trainer
from cpu_devices import child_env


def test_the_training_group_saves_its_first_process_primary_and_no_other_process_takes_part():
    groups = {"train": (1, 0), "rollout": (2, 3)}
    assert save_processes(groups, 4) == (0, 1)
    assert save_processes(None, 3) == (0, 1, 2)  # colocated: every process saves
    options = multiprocessing_options(save_processes(groups, 4), 4)
    assert options.active_processes == {0, 1} and options.primary_host == 0
    # a training group that does not start at process 0: its first process writes and renames
    options = multiprocessing_options(save_processes({"train": [3, 2], "rollout": [0, 1]}, 4), 4)
    assert options.active_processes == {2, 3} and options.primary_host == 2
    assert options.barrier_sync_key_prefix == "rlbolt-processes-2-3"  # no barrier name shared with another group
    # every process, or no group: Orbax's defaults (all processes, process 0 primary)
    for processes in (None, (0, 1, 2, 3), [3, 1, 0, 2]):
        default = multiprocessing_options(processes, 4)
        assert default.active_processes is None and default.primary_host == 0
    # hostile: no training group, a process outside the run, an empty group
    with pytest.raises(ValueError, match="have no 'train' group"):
        save_processes({"rollout": (0, 1)}, 2)
    with pytest.raises(ValueError, match=r"training group \[0, 4\] names processes outside the run's 0..3"):
        save_processes({"train": (0, 4), "rollout": (1,)}, 4)
    with pytest.raises(ValueError, match=r"non-empty subset of 0..3"):
        multiprocessing_options((), 4)


def _state(value: float) -> dict:
    return {"params": {"w": jnp.full((2, 3), value, jnp.float32)}, "opt_state": {"mu": jnp.zeros((2, 3))},
            "rng": jnp.asarray([7, 1], jnp.uint32)}


def test_a_group_checkpoint_saves_restores_and_never_takes_a_half_written_step(tmp_path, monkeypatch):
    # A one-process stand-in for a group: CheckpointIO sees 2 processes and the group {0}, so it opens Orbax's
    # manager on the group path (active_processes={0}, the folder made by the group, process 0 primary); Orbax
    # itself sees the one real process and skips the barriers of a one-member group.
    monkeypatch.setattr(checkpoint_io, "jax", _TwoProcesses())
    folder = tmp_path / "run" / "checkpoints"
    set_default_group((0,))  # what a fit across groups sets on a training process
    try:
        io = CheckpointIO(folder, async_save=False)
        assert io.processes == (0,) and io.primary == 0
        assert io.manager._options.multiprocessing_options.active_processes == {0}
        io.save(1, _state(1.0), {"progress": {"step": 1}})
        io.save(2, _state(2.0), {"progress": {"step": 2}})
        io.close()
        assert (folder / "saved.json").is_file()  # written by the group's primary
        # a save killed after its shards were written: Orbax's temporary folder, never a step
        half = folder / "3.orbax-checkpoint-tmp-1234"
        (half / "state").mkdir(parents=True)
        (half / "state" / "garbage").write_bytes(b"\0" * 16)
        io = CheckpointIO(folder, async_save=False)
        assert io.steps() == [1, 2]
        step, arrays, meta, _ = io.restore_usable(io.steps(), _state(0.0), _state(0.0)["params"])
        assert step == 2 and meta["progress"] == {"step": 2}
        np.testing.assert_array_equal(np.asarray(arrays["params"]["w"]), np.full((2, 3), 2.0, np.float32))
        io.close()
        assert not half.exists()  # cleaned up by the primary when the resumed run opened the folder
    finally:
        set_default_group(None)
    # hostile: a process outside the saving group opens the folder
    with pytest.raises(RuntimeError, match=r"process 0 opened a checkpoint of processes \[1, 2\] without being one"):
        CheckpointIO(folder, processes=(1, 2))


class _TwoProcesses:
    def __getattr__(self, name):
        return (lambda: 2) if name == "process_count" else getattr(jax, name)


class _Link:
    def __init__(self):
        self.store, self.taken = {}, []

    def put(self, key, obj):
        assert key not in self.store, f"{key} written twice"
        self.store[key] = obj

    def take(self, key, stop=lambda: False, sender=None):
        self.taken.append((key, sender))
        return self.store.pop(key)


class _Rows:
    """The rows' transport (Arrow Flight in a run): kept in a dict."""

    def __init__(self):
        self.store = {}

    def put(self, key, obj):
        self.store[key] = obj

    def close(self):
        pass


def _groups(link: _Link) -> ProcessGroups:
    groups = object.__new__(ProcessGroups)  # no runtime: the link is a dict, the push is not used
    groups.train, groups.rollout, groups.role, groups.link = (0, 1), (2, 3), "train", link
    groups.rows = _Rows()
    groups._pushes, groups._started = 0, None
    return groups


def test_the_rollout_group_starts_at_the_training_groups_restored_step(monkeypatch):
    link = _Link()
    train = _groups(link)
    rng = np.asarray([7, 9], np.uint32)  # the restored state.rng
    train.send_start(5, 40, rng)  # a resume from the checkpoint of step 5, 40 prompts consumed
    assert sorted(link.store) == ["start/2", "start/3"]  # one key per rollout process, read once
    train.send_start(5, 40, rng.copy())  # sent again when the producer starts: nothing more is written
    assert sorted(link.store) == ["start/2", "start/3"]
    with pytest.raises(RuntimeError, match=r"^the rollout group was told to start at step 5 \(prompt 40\), now at "
                                           r"step 6 \(prompt 40\): a callback's on_fit_start must not move"):
        train.send_start(6, 40, rng)  # hostile: the rollout group already has the first start
    rollout = _groups(link)
    rollout.role = "rollout"
    monkeypatch.setattr(jax, "process_index", lambda: 3)
    start = rollout.receive_start()
    assert (start["start_step"], start["start_position"]) == (5, 40) and start["base_rng"].tolist() == [7, 9]
    assert link.taken == [("start/3", 0)] and "start/3" not in link.store
    # a training group that ends before its start (a restore that failed) still sends one, then the end:
    # the rollout loop takes the start, then finds the end instead of waiting for its deadline
    link = _Link()
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    _groups(link).end()
    assert link.store == {"start/2": (0, 0, None), "start/3": (0, 0, None), "push/0/2": "end", "push/0/3": "end"}


def test_a_resume_tells_the_rollout_group_where_it_starts_before_pushing_the_retained_weights():
    # Across groups a publish is a push the rollout group must join, and it joins only after its start:
    # so the start (step, data position, the restored rng) goes first, then the retained weights, oldest first.
    events = []
    trainer = object.__new__(Trainer)
    trainer.groups = type("Groups", (), {"send_start": lambda self, step, position, rng: events.append(
        ("start", step, position, np.asarray(rng).tolist()))})()
    trainer.callbacks = CallbackList([])
    trainer.weights = WeightStore(lag_steps=2, transfer=lambda params, version, steps: events.append(
        ("push", params, version, steps)))
    state = TrainState(step=5, params="p5", opt_state=None, policy_version=5, data_position=40,
                       rng=np.asarray([7, 9], np.uint32))
    assert trainer._apply_restore(Restore(state, weights={4: ("p4", 4), 3: ("p3", 3)})) is state
    assert events == [("start", 5, 40, [7, 9]), ("push", "p3", 3, 3), ("push", "p4", 4, 4)]


def test_the_rollout_group_draws_its_sample_keys_from_the_restored_rng_not_the_seed(monkeypatch, tmp_path):
    # A resume with another trainer.seed (allowed): the one-process producer keeps drawing from the restored
    # state.rng, so must the rollout group. The checkpoint's rng is the one of a run seeded 3; this run's seed is 0.
    restored = np.asarray(jax.random.fold_in(jax.random.PRNGKey(3), 1))
    link = _Link()
    _groups(link).send_start(2, 4, restored)  # restored at step 2, 4 prompts consumed
    rollout = _groups(link)
    rollout.role = "rollout"
    monkeypatch.setattr(jax, "process_index", lambda: 2)
    monkeypatch.setenv("RLBOLT_STEP_FILE", str(tmp_path / "step"))  # as `rlbolt launch` sets it (step_beacon)
    pushes = [("w1", 1, 1), None]  # lag 1: step 2 rolls out with the weights after 1 step, then the end
    rollout.receive_weights = lambda abstract: pushes.pop(0)
    keys = []
    module = type("Module", (), {"on_rollout": lambda self, params, batch: keys.append(batch["sample_keys"]) or batch})()
    monkeypatch.setattr(remote_rollout, "check_stage", lambda batch, stage: batch)
    plan = BatchPlan(prompts_per_step=2, num_generations=2, train_micro_batch_size=4)
    source = PromptSource(gsm8k_style_rows(8), shuffle=False)
    produced = run_rollout_group(module, plan, source, rollout, None, DataShare(), **rollout.receive_start(),
                                 max_steps=3, max_prompts=None, lag=1)
    assert produced == 1
    assert (tmp_path / "step").read_text() == "rolled out step 3"  # 0-based step 2: the launcher's count is 1-based
    # by hand: sample i of step 2 (round 0) has the key fold_in(fold_in(fold_in(rng, 2), 0), i)
    fold = jax.random.fold_in
    expected = np.stack([np.asarray(fold(fold(fold(restored, 2), 0), i)) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(keys[0]), expected)
    from_seed = np.asarray(fold(fold(fold(fold(jax.random.PRNGKey(0), 1), 2), 0), 0))
    assert not np.array_equal(np.asarray(keys[0])[0], from_seed)  # not this run's seed


_WRITE = """
import sys, jax, numpy as np
jax.config.update("jax_num_cpu_devices", 2)
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rlbolt.checkpointing.io import CheckpointIO
rows = NamedSharding(Mesh(np.array(jax.devices()), ("fsdp",)), P("fsdp"))
w = jax.device_put(np.arange(12, dtype=np.float32).reshape(4, 3) / 7, rows)  # half the rows on each device
io = CheckpointIO(sys.argv[1], async_save=False)
io.save(3, {"params": {"w": w}, "opt_state": {"mu": jax.device_put(np.ones((4, 3), np.float32), rows)},
            "rng": np.asarray([7, 1], np.uint32)}, {"progress": {"step": 3}})
io.close()
"""
_READ = """
import sys, jax, numpy as np
from rlbolt.checkpointing.io import CheckpointIO
io = CheckpointIO(sys.argv[1], read_only=True)
step, params, meta, _ = io.restore_usable(io.steps())
io.close()
np.save(sys.argv[2], np.asarray(params["w"]))
print(step, jax.device_count(), params["w"].sharding)
"""


@pytest.mark.slow
def test_a_checkpoint_sharded_over_devices_the_reader_lacks_is_read_on_one_device(tmp_path):
    # What `rlbolt export` does with a checkpoint of a training group of 2 processes, on a process that lacks the
    # writers' devices: two CPU devices write it, one reads it (Orbax alone, without a target, refuses: "Topology
    # mismatch"). The end-to-end check (4 processes, export, the weights bitwise) is in test_group_resume.py.
    env = child_env(drop=("JAX_PLATFORMS",))
    folder, out = tmp_path / "checkpoints", tmp_path / "w.npy"
    done = subprocess.run([sys.executable, "-c", _WRITE, str(folder)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run([sys.executable, "-c", _READ, str(folder), str(out)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[:2] == ["3", "1"]  # step 3, read by a process with one device
    np.testing.assert_array_equal(np.load(out), np.arange(12, dtype=np.float32).reshape(4, 3) / 7)  # bitwise
