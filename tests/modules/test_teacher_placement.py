"""The distillation teacher on devices of its own (`placement.teacher`), checked on 8 CPU devices in
a fresh process (`teacher_placement_checks.py`, with XLA_FLAGS forcing 8 host devices): its weights
live only there, the training devices hold nothing of it, and its logps (and a short fit's
metrics) equal those of the teacher on the training devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlbolt.distributed import MeshError, MeshSpec
from rlbolt.distributed.placement import Placement, RoleMesh

SCRIPT = Path(__file__).with_name("teacher_placement_checks.py")


def run_checks(what: str, folder: Path) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, str(SCRIPT), what, str(folder)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_placement_reads_a_teacher_role():
    roles = {"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 6]}}
    default = Placement.of(roles)
    assert default.roles["teacher"] is default.roles["train"]  # the default: the training devices
    apart = Placement.of({**roles, "teacher": {"devices": [6, 8], "mesh": {"tp": 2}}})
    assert apart.roles["teacher"] == RoleMesh(6, 8, MeshSpec(tp=2))
    both = Placement.of({**roles, "reference": {"devices": [6, 7]}, "teacher": {"devices": [7, 8]}})
    assert (both.roles["reference"].start, both.roles["teacher"].start) == (6, 7)


@pytest.mark.parametrize("teacher, message", [
    ({"devices": [3, 6]}, "train [0, 4) and teacher [3, 6) overlap; use teacher: train"),
    ({"devices": [5, 8]}, "rollout [4, 6) and teacher [5, 8) overlap; use teacher: train"),
    ("rollout", "placement.teacher='rollout': use teacher: train"),
    ({"devices": [6, 8], "gpu": 1}, "placement.teacher has unknown key(s) ['gpu']"),
])
def test_a_teacher_range_that_collides_is_refused_in_one_line(teacher, message):
    with pytest.raises(MeshError) as error:
        Placement.of({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 6]}, "teacher": teacher})
    assert message in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(MeshError, match="reference \\[6, 8\\) and teacher \\[7, 8\\) overlap"):
        Placement.of({"train": {"devices": [0, 4]}, "rollout": {"devices": [4, 6]}, "reference": {"devices": [6, 8]},
                      "teacher": {"devices": [7, 8]}})


# the reference's twin stays in the default tier:
# tests/distributed/test_placement.py::test_the_reference_on_its_own_devices_holds_its_copy_only_there
@pytest.mark.slow
def test_the_teacher_on_its_own_devices_holds_its_weights_only_there(tmp_path):
    r = run_checks("setup", tmp_path / "teacher")
    assert r["devices"] == 8
    shared, apart = r["shared"], r["apart"]
    assert shared["teacher_devices"] == [0, 1] and apart["teacher_devices"] == [4, 5]
    # fsdp=2: each teacher device holds half of the teacher; the training devices hold exactly that
    # half less than with the teacher beside them; rollout and idle devices hold nothing.
    half = apart["teacher_total_bytes"] // 2
    assert apart["teacher_shard_bytes"] == {"4": half, "5": half}
    assert {d: apart["live_bytes"][d] for d in "234567"} == {"2": 0, "3": 0, "4": half, "5": half, "6": 0, "7": 0}
    assert {d: shared["live_bytes"][d] - apart["live_bytes"][d] for d in "01"} == {"0": half, "1": half}
    assert "teacher" in shared["memory_items"] and "teacher" not in apart["memory_items"]
    # The same forward on a mesh of the same shape: the same logps.
    # the same program on a mesh of the same shape, on other devices of the same CPU: both sides run the same
    # kernels on one machine, so no CPU can separate them; 1e-6 (~8 ulps at |logps| ~ 4) is slack, not rounding
    np.testing.assert_allclose(apart["teacher_logps"], shared["teacher_logps"], rtol=0, atol=1e-6)
    assert len(r["errors"]) == 1 and "\n" not in r["errors"][0]
    assert "plan.logps_micro_batch_size=6 cannot be split over the teacher mesh's 4 batch shards" in r["errors"][0]


@pytest.mark.slow
def test_a_fit_with_the_teacher_apart_matches_the_colocated_fit(tmp_path):
    r = run_checks("fit", tmp_path / "teacher")
    assert len(r["shared"]) == len(r["apart"]) == 2
    for shared, apart in zip(r["shared"], r["apart"]):
        assert shared["distill/reverse_kl"] > 0  # the random teacher differs from the student
        for key, value in shared.items():  # the colocated forward shares each group's prompt: rounding only
            assert apart[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
