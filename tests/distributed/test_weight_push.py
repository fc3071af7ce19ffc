"""The weight push between process groups (`rlbolt.distributed.weight_push`).

The slow test runs `push_checks.py` as 4 processes through `rlbolt launch` (2 training, 2
rollout, one CPU device each): every shard a rollout process receives must equal, bitwise, the
same slice of the training group's whole parameters of that version (a copy, no arithmetic), the
version must arrive with them, and the rollout group's own jitted sum of squares on its mesh must
match float64 NumPy within the summation-order bound (`sum_error_bound`). The same 4 processes
then run one program: each builds the training params (a no-op off the training group) and the
one-host `WeightSync` moves them across processes, again bitwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from float_tolerance import sum_error_bound

from rlbolt.distributed import MeshError, MeshSpec, ShardingPlan
from rlbolt.distributed.weight_push import ProcessWeightPush
from cpu_devices import child_env

SCRIPT = Path(__file__).with_name("push_checks.py")


def test_a_process_in_both_groups_is_refused_in_one_line():
    devices = jax.devices()  # one process: whatever the split, process 0 is on both sides
    train = ShardingPlan(MeshSpec().build(devices[:1]))
    rollout = ShardingPlan(MeshSpec().build(devices[-1:]))
    with pytest.raises(MeshError, match=r"process\(es\) \[0\] hold devices of both train and rollout"):
        ProcessWeightPush(train, rollout)


@pytest.mark.slow
def test_four_processes_push_three_versions_exactly_onto_another_layout(tmp_path):
    out = tmp_path / "out"
    env = child_env(drop=("JAX_",))
    done = subprocess.run([sys.executable, "-m", "rlbolt", "launch", "--local", "4", "--grace-s", "5", "--",
                           sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for process in (0, 1):
        report = json.loads((out / f"rollout_{process}.json").read_text())
        assert report["versions"] == [1, 2, 3]  # the version travels with its weights
        # tp=2 on the rollout side (fsdp=2 on the training side): the push changed every sharded leaf's layout
        assert report["specs"]["layers.0.mlp.gate_up_proj.kernel"] == "P(None, 'tp')"
        for version, got_sumsq in zip((1, 2, 3), report["sumsq"]):
            sent = dict(np.load(out / f"sent_v{version}.npz"))
            got = dict(np.load(out / f"got_{process}_v{version}.npz"))
            covered = {name: np.zeros(value.shape, bool) for name, value in sent.items()}
            for key, shard in got.items():
                name, _, index = key.partition("|")
                where = tuple(slice(*map(int, s.split(":"))) for s in index.split(",")) if index else ()
                np.testing.assert_array_equal(shard, sent[name][where])  # bitwise: a copy
                covered[name][where] = True
            # each rollout process holds the whole of the replicated leaves and its half of the tp-sharded ones
            assert sum(int(c.sum()) for c in covered.values()) < sum(v.size for v in sent.values())
            assert all(c.any() for c in covered.values())
            terms = np.concatenate([np.square(v.astype(np.float64)).ravel() for v in sent.values()])
            # float32 squares and a float32 sum on the rollout mesh against float64: the squares' rounding
            # (eps each) and the summation order (sum_error_bound)
            bound = float(sum_error_bound(terms)) + float(np.finfo(np.float32).eps * terms.sum())
            assert abs(got_sumsq - terms.sum()) <= bound
        # one program on every process: the one-host WeightSync moved the initial params across processes as well
        _assert_shards_equal(dict(np.load(out / "sent_sync.npz")), dict(np.load(out / f"got_{process}_sync.npz")))


def _assert_shards_equal(sent: dict, got: dict) -> None:
    assert got and {key.partition("|")[0] for key in got} == set(sent)
    for key, shard in got.items():
        name, _, index = key.partition("|")
        where = tuple(slice(*map(int, s.split(":"))) for s in index.split(",")) if index else ()
        np.testing.assert_array_equal(shard, sent[name][where])
