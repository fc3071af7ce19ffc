"""Async mode across process groups (`trainer.mode: async` with train and rollout on processes of their own).

The cheap tests check the rules without launching processes: which weight push the rollout group
joins before each step (against hand tables), its loop on a scripted sequence of pushes, the
training group's producer waiting for its own update, the version check on the rows. The slow
test runs `xproc_checks.py --mode async` as 4 processes (train 0, 1; rollout 2, 3) and as one
process on 4 devices with the same placement and lag, and compares them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from rlbolt.batch import Batch
from rlbolt.plan import BatchPlan
from rlbolt.producer import remote_rollout
from rlbolt.producer.remote_rollout import RemoteRollout, run_rollout_group, takes_push
from rlbolt.producer.stage_threads import ProducerStopped
from rlbolt.producer.weights import WeightStore
from cpu_devices import child_env

SCRIPT = Path(__file__).with_name("xproc_checks.py")

# (step, lag, weights held: steps completed, None = none yet) -> joins the next push first. By hand: step s
# rolls out with the weights after max(0, s - lag) steps; it joins pushes while it holds older ones.
TAKES_PUSH = [
    (0, 0, None, True), (0, 0, 0, False), (1, 0, 0, True), (1, 0, 1, False), (5, 0, 4, True),   # sync: every step
    (0, 1, None, True), (0, 1, 0, False), (1, 1, 0, False), (2, 1, 0, True), (2, 1, 1, False),  # lag 1
    (3, 1, 1, True), (3, 1, 2, False),
    (0, 2, None, True), (1, 2, 0, False), (2, 2, 0, False), (3, 2, 0, True), (3, 2, 1, False),  # lag 2
    (7, 3, 3, True), (7, 3, 4, False),
    (4, 1, 5, False),  # hostile: newer than the step needs (never joins more; the loop refuses it)
]


@pytest.mark.parametrize("step, lag, held, expected", TAKES_PUSH)
def test_the_rollout_group_joins_a_push_while_its_weights_are_older_than_the_step_needs(step, lag, held, expected):
    assert takes_push(step, lag, held) is expected


class _Link:
    def __init__(self):
        self.puts: list[str] = []

    def put(self, key, obj):
        self.puts.append(key)


class _Groups:
    """Scripted pushes: the weights after each of `keys` steps (a string names them), then the end."""

    def __init__(self, keys, events):
        self.keys, self.events, self.rows = list(keys), events, _Link()

    def receive_weights(self, abstract):
        if not self.keys:
            self.events.append("end")
            return None
        key = self.keys.pop(0)
        self.events.append(f"push {key}")
        return f"w{key}", 10 * key, key  # params, policy version, steps completed


class _Module:
    def __init__(self, events):
        self.events = events

    def on_rollout(self, params, batch):
        self.events.append(f"roll {int(batch['step'][0])} {params} v{int(batch['policy_version'][0])}")
        return batch


class _Share:
    rank, size = 0, 1


def _run(monkeypatch, keys, lag, max_steps, start_step=0):
    def fake_prompt_batch(source, share, rng, g, step, round_index, position, prompts, version):
        return Batch({"step": np.full(prompts * g, step), "policy_version": np.full(prompts * g, version, np.int32)})

    monkeypatch.setattr(remote_rollout, "prompt_batch", fake_prompt_batch)
    monkeypatch.setattr(remote_rollout, "check_stage", lambda batch, stage: batch)
    events: list[str] = []
    groups = _Groups(keys, events)
    plan = BatchPlan(prompts_per_step=2, num_generations=2, train_micro_batch_size=4)
    produced = run_rollout_group(_Module(events), plan, None, groups, None, _Share(), base_rng=None,
                                 start_step=start_step, start_position=0, max_steps=max_steps, max_prompts=None,
                                 lag=lag)
    return events, produced, groups


# The training group pushes the weights after every step (0 .. max_steps), then ends. By hand, from the rule:
SCHEDULES = {
    "sync": (0, 3, [0, 1, 2, 3], 0,
             ["push 0", "roll 0 w0 v0", "push 1", "roll 1 w1 v10", "push 2", "roll 2 w2 v20", "push 3", "end"]),
    "lag 1": (1, 3, [0, 1, 2, 3], 0,  # step s+1 rolls out while training trains step s
              ["push 0", "roll 0 w0 v0", "roll 1 w0 v0", "push 1", "roll 2 w1 v10", "push 2", "push 3", "end"]),
    "lag 2": (2, 4, [0, 1, 2, 3, 4], 0,
              ["push 0", "roll 0 w0 v0", "roll 1 w0 v0", "roll 2 w0 v0", "push 1", "roll 3 w1 v10", "push 2",
               "push 3", "push 4", "end"]),
    # a start at step 2 whose first pushes repeat a key (a restore publishing retained weights, then the current)
    "restart, repeated key": (1, 5, [1, 2, 2, 3, 4, 5], 2,
                              ["push 1", "roll 2 w1 v10", "push 2", "roll 3 w2 v20", "push 2", "push 3",
                               "roll 4 w3 v30", "push 4", "push 5", "end"]),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_the_rollout_loop_uses_the_weights_of_step_minus_lag_and_joins_every_push(monkeypatch, name):
    lag, max_steps, keys, start, expected = SCHEDULES[name]
    events, produced, groups = _run(monkeypatch, keys, lag, max_steps, start)
    assert events == expected
    assert produced == max_steps - start
    # each step's one micro batch (4 samples) goes to the training group under its step
    assert groups.rows.puts == [f"rows/{s}/0/0" for s in range(start, max_steps)]


def test_a_push_newer_than_the_step_needs_is_refused_in_one_line(monkeypatch):
    # hostile: the training group skipped a version (another max_staleness there): step 2 needs the weights after 1
    with pytest.raises(RuntimeError, match=r"^step 2: the rollout group holds the weights after 2 steps, the step "
                                           r"needs those after 1 \(lag 1\); both groups must run the same "
                                           r"trainer.mode and max_staleness$"):
        _run(monkeypatch, [0, 2, 3], lag=1, max_steps=3)


def test_the_training_groups_producer_feeds_a_step_only_after_the_previous_update():
    # lag 1: step s is produced with the weights after s - 1 steps; with feed_ahead 0 (ProcessGroups.attach) it
    # is also fed only once the weights after s steps exist, so the training group's collectives take turns
    store, stop = WeightStore(lag_steps=1), threading.Event()
    pushed = []
    store.transfer, store.feed_ahead = lambda params, version, steps: pushed.append((version, steps)), 0
    store.publish(0, "p0", 0)
    assert store.get(0, stop) == ("p0", 0)
    stop.set()
    with pytest.raises(ProducerStopped):  # would block: the update of step 0 has not published yet
        store.get(1, stop)
    store.publish(1, "p1", 1)
    assert store.get(1, stop) == ("p0", 0)  # still the behaviour weights of step 1: those after 0 steps
    assert store.get(1, stop, rollout=True) == (None, 0)  # the rollout's copy: what the push returned (none)
    assert pushed == [(0, 0), (1, 1)]  # each publish pushed, with its version and steps
    free = WeightStore(lag_steps=1)  # one process: the producer runs ahead as far as the weights allow
    free.publish(0, "p0", 0)
    assert free.get(1, threading.Event()) == ("p0", 0)


class _RowLink:
    def __init__(self, rows):
        self.rows = rows

    def take(self, key, stop=lambda: False, sender=None):
        return self.rows, {}


def test_rows_made_with_other_weights_than_the_training_group_asked_for_are_refused():
    keys = np.asarray([[1, 2], [3, 4]], np.uint32)
    asked = Batch({"sample_keys": keys, "policy_version": np.zeros(2, np.int32)})
    groups = type("G", (), {"rollout": (2,), "rows": _RowLink({"sample_keys": keys,
                                                               "policy_version": np.ones(2, np.int32)})})()
    share = type("S", (), {"rank": 0, "size": 1})()
    with pytest.raises(RuntimeError, match=r"^step 3: the rollout group made micro batch 0 with policy version 1, the "
                                           r"training group asked for 0; both groups must run the same trainer.mode"):
        RemoteRollout(groups, share)(3, asked)


def _env() -> dict[str, str]:
    return child_env(drop=("JAX_", "SLURM_"))


# Metrics made on the host from the rollout and the schedule: equal bitwise (the same programs on the same layout
# with the same keys and the same weights roll out the same tokens, as in the sync test).
EXACT = ("reward/", "response_length/", "staleness/", "advantage/")
METRIC_RTOL, METRIC_ATOL = 0.0, 2 * 1.5 * float(np.spacing(np.float32(4.6)))  # 1.4e-6: see the test


@pytest.mark.slow
def test_four_processes_in_async_mode_stay_within_the_lag_and_train_as_the_one_process_async_run(tmp_path):
    four, one = tmp_path / "four", tmp_path / "one"
    done = subprocess.run([sys.executable, "-m", "rlbolt", "launch", "--local", "4", "--devices-per-process", "1",
                           "--grace-s", "5", "--", sys.executable, str(SCRIPT), str(four), "--mode", "async"],
                          capture_output=True, text=True, env=_env(), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    done = subprocess.run([sys.executable, str(SCRIPT), str(one), "--devices", "4", "--mode", "async"],
                          capture_output=True, text=True, env=_env(), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check_async_runs(four, one)


def check_async_runs(four: Path, one: Path) -> None:
    """The 4-process async run's outputs (`four`) against the one-process async run's (`one`)."""
    roles = [json.loads((four / f"role_{p}.json").read_text()) for p in range(4)]
    assert [r["role"] for r in roles] == ["train", "train", "rollout", "rollout"]
    # max_staleness 1, one update per step: lag 1. By hand: step 0 trains the initial weights' samples at version 0
    # (staleness 0); steps 1 and 2 train samples of the weights after 0 and 1 steps at versions 1 and 2 (staleness 1).
    logged = [json.loads(line) for line in (four / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["staleness/max"] for m in logged] == [0.0, 1.0, 1.0]
    assert [m["staleness/mean"] for m in logged] == [0.0, 1.0, 1.0]
    assert max(m["staleness/max"] for m in logged) <= 1  # never above max_staleness
    steps4, steps1 = json.loads((four / "steps.json").read_text()), json.loads((one / "steps.json").read_text())
    assert len(steps4) == len(steps1) == 3
    assert [s["completions"] for s in steps4] == [s["completions"] for s in steps1]
    for s4, s1 in zip(steps4, steps1):
        assert sorted(s4["metrics"]) == sorted(s1["metrics"])
        assert "rollout_corr/is_weight_mean" in s4["metrics"]  # rollout correction (tis) ran on the rows
        exact = {k: v for k, v in s4["metrics"].items() if k.startswith(EXACT)}
        assert exact == {k: v for k, v in s1["metrics"].items() if k.startswith(EXACT)}
        # The rest comes from the training group's forwards and update, whose reductions are gloo's across 2
        # processes instead of XLA's in one (the parameters differ by the rounding of 3 Adam updates, below):
        # each is a token mean of logp differences (kl, rollout_corr/kl_*) or of A x ratio terms (loss, with |A|
        # <= 1.5, ratio ~ 1), and the two forwards round a log-prob near log(V) ~ 4.6 (the tiny vocabulary's; the
        # logged entropy is 4.59) differently by about an ulp there: METRIC_ATOL is that ulp on each side of a
        # difference, times max|A|. Measured: at most 4.7e-8 (rollout_corr/kl_k1), the ulps cancelling in the mean.
        for name, value in s1["metrics"].items():
            np.testing.assert_allclose(s4["metrics"][name], value, rtol=METRIC_RTOL, atol=METRIC_ATOL, err_msg=name)
    # As in the sync test (test_process_groups.py): Adam (lr 1e-3, 3 steps) moves each parameter by ~lr per step and
    # divides the gradient's rounding by its own magnitude, so the parameters agree to the rounding of 3 updates of
    # size ~1e-3: 1e-6.
    p4, p1 = dict(np.load(four / "params.npz")), dict(np.load(one / "params.npz"))
    assert sorted(p4) == sorted(p1)
    for name in p1:
        np.testing.assert_allclose(p4[name], p1[name], rtol=0, atol=1e-6, err_msg=name)
