"""Training and rollout on separate process groups (`rlbolt.distributed.process_groups`, sync mode).

The slow test runs `xproc_checks.py` as 4 processes through `rlbolt launch --devices-per-process 1`
(train on processes 0, 1, rollout on 2, 3) and once as one process on 4 CPU devices with the same
placement, and compares. The cheap tests check each fault's fix without launching processes:
group-local collectives, the rollout rows checked on arrival, the refusals in one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rlbolt.batch import Batch
from rlbolt.distributed.agree import any_process, gather_shares, group_size, max_over_processes
from rlbolt.distributed.agree import _gather, set_default_group
from rlbolt.distributed.process_groups import check_fit_across
from rlbolt.module import collect_log_values, mean_logs
from rlbolt.plan import BatchPlan
from rlbolt.producer.remote_rollout import RemoteRollout, refill_decision
from cpu_devices import child_env

SCRIPT = Path(__file__).with_name("xproc_checks.py")


def test_a_group_of_one_agrees_without_a_collective_and_a_stranger_is_refused():
    # process counts come from the group, not jax.process_count(): a group of one returns its input
    assert group_size([0]) == 1 and group_size(None) == 1
    assert max_over_processes([3, 7], group=[0]) == [3, 7]
    assert any_process(True, group=(0,)) is True and any_process(False, group=(0,)) is False
    assert gather_shares({"x": 1}, 0, 1, group=[0]) == [{"x": 1}]
    # a collective of a group this process is not in would wait forever: refused in one line
    with pytest.raises(RuntimeError, match=r"process 0 called a collective of the process group \[1, 2\]"):
        _gather(np.zeros(1), group=[1, 2])
    # a fit across groups sets its group as the default: a callback's any_process(flag) (no group) agrees there
    set_default_group([2, 1])
    try:
        assert group_size(None) == 2
        with pytest.raises(RuntimeError, match=r"process group \[1, 2\]"):
            any_process(True)
    finally:
        set_default_group(None)
    assert group_size(None) == 1


class _Link:
    def __init__(self, payloads):
        self.payloads, self.keys = dict(payloads), []

    def take(self, key, stop=lambda: False, sender=None):
        self.keys.append(key)
        return self.payloads.pop(key)

    def put(self, key, obj):
        assert key not in self.payloads, key  # a key is read once: never written twice
        self.payloads[key] = obj


class _Groups:
    train, rollout = (0, 1), (2, 3)

    def __init__(self, link, leader=True):
        self.link = self.rows = link  # the rows' transport takes as the link does (FlightRows, GroupLink)
        self.leader = leader


class _Share:
    rank, size = 1, 2


def _rows(keys, version=0):
    return {"sample_keys": np.asarray(keys, np.uint32), "completion_ids": np.arange(len(keys) * 2).reshape(-1, 2),
            "policy_version": np.full(len(keys), version, np.int32)}


def test_remote_rollout_takes_each_micro_batch_in_order_and_checks_it_is_the_one_asked_for():
    asked = Batch({"sample_keys": np.asarray([[1, 2], [3, 4]], np.uint32), "policy_version": np.zeros(2, np.int32)})
    link = _Link({"rows/5/0/1": (_rows([[1, 2], [3, 4]]), {"rollout/len": [2.0, 4.0]}),
                  "rows/5/1/1": (_rows([[9, 9], [3, 4]]), {})})
    remote = RemoteRollout(_Groups(link), _Share())
    with collect_log_values() as logged:
        got = remote(5, asked)
    assert np.array_equal(got["completion_ids"], [[0, 1], [2, 3]])
    assert mean_logs(logged) == {"rollout/len": 3.0}  # the rollout group's RLModule.log values join the step's
    # the second micro batch of step 5 carries other samples (hostile: another seed or plan on the other side)
    with pytest.raises(RuntimeError, match=r"step 5: micro batch 1 of the rollout group \(2 rows\) is not the one"):
        remote(5, asked)
    assert link.keys == ["rows/5/0/1", "rows/5/1/1"]  # the share's rank, micro batches counted per step


def test_refill_decisions_go_from_the_training_groups_first_process_to_each_rollout_process():
    link = _Link({})
    RemoteRollout(_Groups(link, leader=False), _Share()).decided(4, 0, 8)  # another training process: sends nothing
    assert link.payloads == {}
    remote = RemoteRollout(_Groups(link), _Share())
    remote.decided(4, 0, 8)
    remote.decided(4, 1, 0)  # the step is full after its first refill
    assert link.payloads == {"refill/4/0/2": 8, "refill/4/0/3": 8, "refill/4/1/2": 0, "refill/4/1/3": 0}
    # What rollout process 2 reads (jax.process_index() is 0 here: its own keys are put under 0)
    link.payloads.update({"refill/4/0/0": 8, "refill/4/1/0": 0})
    refills = BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8, max_refill_rounds=2)
    assert refill_decision(_Groups(link), refills, 4, 0) == 8 and refill_decision(_Groups(link), refills, 4, 1) == 0
    assert link.keys == ["refill/4/0/0", "refill/4/1/0"]
    none = BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8, max_refill_rounds=0)
    assert refill_decision(_Groups(link), none, 4, 0) == 0 and len(link.keys) == 2  # no refills: nothing read


def test_what_is_not_run_across_processes_is_refused_in_one_line():
    plan = BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8, max_refill_rounds=1)
    with pytest.raises(ValueError) as error:
        check_fit_across("async", plan, [{"prompt": "x"}])
    message = str(error.value)
    assert "\n" not in message and "validation data" in message
    assert "max_refill_rounds" not in message  # refills run across groups (the slow DAPO test)
    assert "trainer.mode" not in message  # async runs across groups (test_async_groups.py)
    with pytest.raises(ValueError, match=r"trainer.mode='offline' \(use sync or async\)"):
        check_fit_across("offline", BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8), None)
    plan = BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8)
    for mode in ("sync", "async"):  # what runs passes; checkpoints in both (the training group saves alone, and
        check_fit_across(mode, plan, None)  # an async resume pushes the retained weights first: test_group_resume.py)


def _four_and_one(tmp_path, *flags):
    """xproc_checks.py as 4 processes (2 groups) and as one process with the same placement: their folders."""
    env = child_env(drop=("JAX_", "SLURM_"))
    four, one = tmp_path / "four", tmp_path / "one"
    done = subprocess.run([sys.executable, "-m", "rlbolt", "launch", "--local", "4", "--devices-per-process", "1",
                           "--grace-s", "5", "--", sys.executable, str(SCRIPT), str(four), *flags],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run([sys.executable, str(SCRIPT), str(one), "--devices", "4", *flags], capture_output=True,
                          text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return four, one


@pytest.mark.slow
def test_four_processes_in_two_groups_train_as_the_one_process_placement(tmp_path):
    four, one = _four_and_one(tmp_path)
    roles = [json.loads((four / f"role_{p}.json").read_text()) for p in range(4)]
    assert [r["role"] for r in roles] == ["train", "train", "rollout", "rollout"]
    assert [r["trained_steps"] for r in roles] == [3, 3, 0, 0] and roles[0]["process_count"] == 4
    steps4, steps1 = json.loads((four / "steps.json").read_text()), json.loads((one / "steps.json").read_text())
    assert len(steps4) == len(steps1) == 3
    # The rollout runs the same programs on the same layout (fsdp=2 on 2 devices) with the same keys and weights:
    # every sampled token and every reward is the one-process run's, bitwise.
    assert [s["completions"] for s in steps4] == [s["completions"] for s in steps1]
    assert [s["metrics"]["reward/mean"] for s in steps4] == [s["metrics"]["reward/mean"] for s in steps1]
    # The training group's collectives are gloo's across 2 processes instead of XLA's in-process ones: the same
    # kernels, only the order of the 2 partial sums of each reduction differs (a few float32 ulps of the
    # gradient). Adam (lr 1e-3, 3 steps) moves each parameter by ~lr per step, and divides the rounding of the
    # gradient by its own magnitude, so parameters agree to the rounding of 3 updates of size ~1e-3: the same
    # 1e-6 as test_multi_process.py's two-process check (measured here: 4.4e-7).
    p4, p1 = dict(np.load(four / "params.npz")), dict(np.load(one / "params.npz"))
    assert sorted(p4) == sorted(p1)
    for name in p1:
        np.testing.assert_allclose(p4[name], p1[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_refill_rounds_across_groups_equal_the_one_process_placement(tmp_path):
    # DAPO's dynamic sampling with a reward that drops every other pair of prompts' groups, so each step needs
    # refill rounds, which the rollout group makes when the training group's advantage stage asks for them
    # (pairs: a round of two data shares draws an even number of prompts, xproc_checks.py's `parity`).
    four, one = _four_and_one(tmp_path, "--dapo")
    steps4, steps1 = json.loads((four / "steps.json").read_text()), json.loads((one / "steps.json").read_text())
    assert len(steps4) == len(steps1) == 3
    for s4, s1 in zip(steps4, steps1):
        assert s4["metrics"]["refill/dropped_samples"] > 0  # refills ran in every step
        # the same prompts (the refills' positions), keys, tokens, rewards and drops as one process: bitwise
        assert s4["completions"] == s1["completions"]
        for name in ("refill/dropped_samples", "reward/mean", "dynamic_sampling/dropped_groups"):
            assert s4["metrics"][name] == s1["metrics"][name], name
    # Equal tokens in steps 2 and 3 mean both groups advanced the prompt counter by the refills. Parameters:
    # the order of gloo's 2 partial sums against XLA's in-process ones (a few float32 ulps of each gradient);
    # Adam divides that rounding by the gradient's own magnitude, so an element whose gradient is near zero
    # moves by up to ~lr per step more. Measured: 1 element of 4,096 of one kernel off by 3.5e-6, every other
    # within 1e-6. So: every element within 1e-5 (3 steps x lr 1e-3 bounds a sign flip far above that, but
    # one was never seen), and all but 0.1% within the sync test's 1e-6.
    p4, p1 = dict(np.load(four / "params.npz")), dict(np.load(one / "params.npz"))
    assert sorted(p4) == sorted(p1)
    for name in p1:
        diff = np.abs(p4[name].astype(np.float64) - p1[name])
        assert diff.max() <= 1e-5 and np.mean(diff > 1e-6) <= 1e-3, (name, diff.max(), np.mean(diff > 1e-6))
