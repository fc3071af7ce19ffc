"""Placement: roles on their own sub-meshes, and the weight sync between them.

The 8-device checks run `placement_checks.py` in a fresh process. The transfer is checked
against shard sizes worked out from the PartitionSpecs (each target device must hold exactly
its shards, never a whole parameter), and the compiled reshard's per-device footprint against
the whole model's bytes. The disaggregated fit is checked against the colocated one on a mesh
of the same shape: the same float sums, so metrics and parameters must be bitwise equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlbolt.distributed import MeshError, MeshSpec
from rlbolt.distributed.placement import Placement, RoleMesh
from cpu_devices import child_env

SCRIPT = Path(__file__).with_name("placement_checks.py")


def run_checks(what: str) -> dict:
    env = child_env()  # the script asks for its 8 devices itself
    done = subprocess.run([sys.executable, str(SCRIPT), what], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def default_checks() -> dict:
    """The default tier's two checks in one fresh process (one JAX start and import instead of two)."""
    return run_checks("transfer,reference")


def test_placement_reads_colocated_and_role_maps():
    assert Placement.of("colocated").colocated and Placement.of(None).colocated
    p = Placement.of({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 8], "mesh": {"tp": 2, "fsdp": -1}}})
    assert not p.colocated
    assert p.roles["rollout"] == RoleMesh(4, 8, MeshSpec(tp=2))
    assert p.roles["reference"] is p.roles["train"] and not p.reference_apart  # the default: with training
    apart = Placement.of({"train": {"devices": [0, 2]}, "rollout": {"devices": [2, 4]},
                          "reference": {"devices": [4, 6], "mesh": {"tp": 2}}})
    assert apart.reference_apart and apart.roles["reference"] == RoleMesh(4, 6, MeshSpec(tp=2))
    named = Placement.of({"train": {"devices": [0, 2]}, "rollout": {"devices": [2, 4]}, "reference": "train"})
    assert named.roles["reference"] is named.roles["train"]


@pytest.mark.parametrize("value, words", [
    ("split", "placement='split': use 'colocated'"),
    ({"train": {"devices": [0, 4]}}, "names no devices for ['rollout']"),
    ({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 8]}, "critic": {"devices": [0, 1]}},
     "unknown role(s) ['critic']"),
    ({"train": {"devices": [0, 4]}, "rollout": {"devices": [3, 8]}}, "train [0, 4) and rollout [3, 8) overlap"),
    ({"train": {"devices": [4, 0]}, "rollout": {"devices": [4, 8]}}, "placement.train.devices=[4, 0] must be"),
    ({"train": {"devices": [0, 4], "gpus": 2}, "rollout": {"devices": [4, 8]}}, "unknown key(s) ['gpus']"),
    ({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 8]}, "reference": "rollout"},
     "placement.reference='rollout': use reference: train"),
    ({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 6]}, "reference": {"devices": [3, 7]}},
     "train [0, 4) and reference [3, 7) overlap; use reference: train"),
    ({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 6]}, "reference": {"devices": [5, 8]}},
     "rollout [4, 6) and reference [5, 8) overlap"),
    ({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 6]}, "reference": {"devices": [0, 4]}},
     "train [0, 4) and reference [0, 4) overlap"),  # the same range as train: say reference: train
    ({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 6]}, "reference": {"devices": [6, 8], "gpu": 1}},
     "placement.reference has unknown key(s) ['gpu']"),
    ({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 6]}, "reference": [6, 8]},
     "placement.reference=[6, 8]: give {devices: [start, stop]}"),
    ({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 8], "mesh": {"pp": 2}}}, "unknown axes ['pp']"),
])
def test_bad_placements_are_refused_with_one_line(value, words):
    with pytest.raises(MeshError) as error:
        Placement.of(value)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_a_placement_past_the_visible_devices_or_beside_a_mesh_is_refused():
    import jax

    n = len(jax.devices())
    far = Placement.of({"train": {"devices": [0, 1]}, "rollout": {"devices": [n, n + 1]}})
    with pytest.raises(MeshError, match=rf"devices=\[{n}, {n + 1}\] but {n} devices are visible"):
        far.plans()
    with pytest.raises(MeshError, match="leave mesh at its default"):
        far.plans({"tp": 2})


def test_weight_sync_moves_each_shard_and_never_a_whole_parameter(default_checks):
    r = default_checks["transfer"]
    total = r["total_bytes"]
    for case in r["cases"]:
        assert case["equal"] and case["on_target"], case["target"]
        assert case["live_bytes"] == case["expected_bytes"], case  # exactly its shards on every target device
        assert max(case["live_bytes"].values()) < total
        # The compiled reshard on the training devices: arguments + outputs + temporaries per device
        # stay below the whole model (an all-gather of the parameters would exceed it).
        assert case["staging_peak_bytes"] < total, case
    # fsdp=2 x tp=2 on 4 devices: a quarter of every sharded parameter each (the norms' scales are
    # replicated over tp, so a little more than total / 4).
    quarter = r["cases"][0]["live_bytes"]["4"]
    assert total / 4 <= quarter < total / 3


@pytest.mark.slow
def test_disaggregated_fit_equals_colocated_and_async_rollout_overlaps_the_update():
    r = run_checks("fit")
    col, split, run_async = r["colocated"], r["split"], r["async"]
    assert split["rollout_devices"] == [4, 5, 6, 7] and col["rollout_devices"] == [0, 1, 2, 3]
    assert split["steps"] == col["steps"] and split["completions"] == col["completions"]  # bitwise
    assert r["max_param_diff"] == 0.0

    def spans(events, stage):  # step -> (first start, last end) over the stage's micro batches
        out = {}
        for e in (e for e in events if e["stage"] == stage):
            start, end = out.get(e["step"], (e["start"], e["end"]))
            out[e["step"]] = (min(start, e["start"]), max(end, e["end"]))
        return out

    # Sync: the rollout of step k+1 waits for the weights after step k's update.
    roll, upd = spans(split["events"], "rollout"), spans(split["events"], "update")
    assert all(roll[k + 1][0] >= upd[k][1] for k in upd if k + 1 in roll)
    # Async (max_staleness=1): it starts before that update ends, on its own devices, and at
    # least once the two run at the same time; no trained sample is staler than the bound.
    roll, upd = spans(run_async["events"], "rollout"), spans(run_async["events"], "update")
    pairs = [k for k in upd if k + 1 in roll]
    assert len(pairs) == 3
    assert all(roll[k + 1][0] < upd[k][1] for k in pairs)
    assert any(roll[k + 1][0] < upd[k][1] and roll[k + 1][1] > upd[k][0] for k in pairs)
    assert [s["staleness/max"] for s in run_async["steps"]] == [0.0, 1.0, 1.0, 1.0]
    assert "overlap" in r["placement_error"]


def test_the_reference_on_its_own_devices_holds_its_copy_only_there(default_checks):
    r = default_checks["reference"]
    shared, apart = r["train"], r["apart"]
    assert shared["ref_devices"] == [0, 1] and apart["ref_devices"] == [4, 5]
    # Live bytes per device after set-up: the reference devices hold exactly the copy's shards
    # (half of the model each on fsdp=2), the training devices hold the same bytes as when the
    # reference shares training's arrays (no second copy there), rollout and idle devices nothing.
    half = apart["ref_total_bytes"] // 2
    assert apart["ref_shard_bytes"] == {"4": half, "5": half}
    assert {d: apart["live_bytes"][d] for d in "4567"} == {"4": half, "5": half, "6": 0, "7": 0}
    assert {d: apart["live_bytes"][d] for d in "0123"} == {d: shared["live_bytes"][d] for d in "0123"}
    assert "reference" in shared["memory_items"] and "reference" not in apart["memory_items"]
    # The forward on the reference mesh gives the training mesh's logps bitwise (same mesh shape),
    # and within float32 rounding on a mesh of another shape (fsdp=4, placed by device_put).
    assert apart["ref_logps"] == shared["ref_logps"]
    assert r["wide"]["ref_devices"] == [4, 5, 6, 7]
    # another mesh shape, both sides in one process on one CPU: only how XLA splits the fsdp products
    # (4 ways instead of 2) differs, a few ulps of |logps|; not derived (the subprocess returns no model to
    # bound), kept from the measured gap: see the tolerance list of issue 33
    np.testing.assert_allclose(r["wide"]["ref_logps"], shared["ref_logps"], rtol=1e-6, atol=1e-6)
    assert len(r["errors"]) == 1 and "plan.logps_micro_batch_size=6 cannot be split over the reference mesh's 4" \
        in r["errors"][0] and "\n" not in r["errors"][0]


@pytest.mark.slow
def test_a_fit_with_the_reference_on_its_own_devices_equals_colocated():
    r = run_checks("reference_fit")
    col, apart = r["colocated"], r["apart"]
    assert col["ref_devices"] == [0, 1] and apart["ref_devices"] == [4, 5]
    assert apart["steps"] == col["steps"] and apart["completions"] == col["completions"]  # bitwise
    assert r["max_param_diff"] == 0.0
    assert col["steps"][-1]["kl"] > 1e-4  # the reference logps did enter the loss


def _devices_of(*processes: int) -> list:
    """Stand-ins for jax.devices() across processes: only `process_index` is read before a mesh is built."""
    from types import SimpleNamespace

    return [SimpleNamespace(id=i, process_index=p) for i, p in enumerate(processes)]


def test_process_groups_across_processes_and_what_stays_refused_names_them():
    devices = _devices_of(0, 0, 1, 1, 2, 2, 3, 3)
    p = Placement.of({"train": {"devices": [4, 8]}, "rollout": {"devices": [0, 4], "mesh": {"tp": 2}}})
    assert p.process_groups(devices) == {"train": (2, 3), "rollout": (0, 1), "reference": (2, 3), "teacher": (2, 3)}
    # train must hold process 0 (it writes the run directory): refused, naming the groups and the fix
    with pytest.raises(MeshError, match=r"across processes \(train on \[2, 3\], rollout on \[0, 1\], reference on "
                                        r"\[2, 3\], teacher on \[2, 3\]\): train must hold process 0's devices"):
        p.plans(devices=devices)
    # the reference on processes of its own is a third group, not run yet
    apart = Placement.of({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 6]},
                          "reference": {"devices": [6, 8]}})
    with pytest.raises(MeshError, match=r"reference on processes of its own is not run yet; use reference: train"):
        apart.check_across_processes(devices)
    # train on processes 0, 1 and rollout on 2, 3: what the Trainer runs (process_groups.py)
    Placement.of({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 8]}}).check_across_processes(devices)


@pytest.mark.parametrize("spans, message", [
    ({"train": [3, 8], "rollout": [0, 3]}, r"placement.train.devices=\[3, 8\] takes part of process 1's devices \[2, 3\]"),
    ({"train": [4, 8], "rollout": [0, 3]}, r"placement.rollout.devices=\[0, 3\] takes part of process 1's devices \[2, 3\]"),
    ({"train": [4, 9], "rollout": [0, 4]}, r"placement.train.devices=\[4, 9\] but 8 devices are visible"),
])
def test_a_range_that_splits_a_process_is_refused_in_one_line(spans, message):
    p = Placement.of({role: {"devices": span} for role, span in spans.items()})
    with pytest.raises(MeshError, match=message):
        p.process_groups(_devices_of(0, 0, 1, 1, 2, 2, 3, 3))
