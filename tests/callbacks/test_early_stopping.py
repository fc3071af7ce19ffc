"""EarlyStopping: the stopping rule on hand-made sequences, exact resume through state_dict, and
real fits that stop at the step a reference implementation of the rule predicts."""

import json
import math

import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.callbacks import EarlyStopping, Evaluation
from rlbolt.plan import BatchPlan
from rlbolt.run_info import RunInfo
from rlbolt.trainer import Trainer


def _feed(stopper, values, first_step=1):
    run = RunInfo(run_dir=".")
    for step, value in enumerate(values, start=first_step):
        if stopper.check(run, step, value):
            assert run.control.stop_requested  # it asked the run to stop
            return step
    assert not run.control.stop_requested
    return None


@pytest.mark.parametrize("mode, values, patience, min_delta, stop", [
    # max, delta 0.1: 0.5 best; 0.55 (< 0.6) wait 1; 0.7 best; 0.75 wait 1; 0.79 wait 2 -> stop at 5
    ("max", [0.5, 0.55, 0.7, 0.75, 0.79, 1.0], 2, 0.1, 5),
    # min, delta 0: 3 best; 2 best; 2 (not < 2) wait 1; 1 best; 1.5 wait 1; nan wait 2 -> stop at 6
    ("min", [3.0, 2.0, 2.0, 1.0, 1.5, math.nan, 0.0], 2, 0.0, 6),
    ("max", [1.0, 2.0, 3.0, 4.0], 1, 0.0, None),  # always improving: never stops
    ("max", [math.nan, math.nan, 1.0], 2, 0.0, 2),  # non-finite never improves, even first
])
def test_rule_on_hand_sequences(mode, values, patience, min_delta, stop):
    assert _feed(EarlyStopping("m", mode=mode, patience=patience, min_delta=min_delta), values) == stop


def test_state_dict_resume_is_exact():
    # delta 0.1: best 0.5 (1), 0.7 (3), 0.85 (5); then 0.9, 0.92, 0.93 are three checks without improvement
    values = [0.5, 0.55, 0.7, 0.75, 0.85, 0.9, 0.92, 0.93, 0.99]
    whole = _feed(EarlyStopping("m", patience=3, min_delta=0.1), values)
    first = EarlyStopping("m", patience=3, min_delta=0.1)
    assert _feed(first, values[:4]) is None
    saved = json.loads(json.dumps(first.state_dict()))  # checkpoints store it as JSON
    second = EarlyStopping("m", patience=3, min_delta=0.1)
    second.load_state_dict(saved)
    assert (second.best, second.best_step, second.wait) == (0.7, 3, 1)
    assert _feed(second, values[4:], first_step=5) == whole == 8


class Record(Callback):
    def __init__(self):
        self.metrics, self.val = [], []

    def on_step_end(self, trainer, info):
        self.metrics.append(info.metrics)

    def on_validation_end(self, trainer, step, metrics):
        self.val.append(metrics)


def _reference_stop(values, mode, patience, min_delta):
    """Independent restatement of the rule: 1-based index of the check that stops, or None."""
    best, wait = None, 0
    for i, v in enumerate(values, start=1):
        better = best is None or (v > best + min_delta if mode == "max" else v < best - min_delta)
        best, wait = (v, 0) if better else (best, wait + 1)
        if wait >= patience:
            return i
    return None


def _fit(callbacks, max_steps=8, **kwargs):
    trainer = Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=max_steps, callbacks=callbacks, **kwargs)
    return trainer.fit(ToyModule(), prompt_rows(16))


def test_fit_stops_on_step_metric():
    record = Record()
    stopper = EarlyStopping("reward/mean", mode="max", patience=2, min_delta=0.05)
    state = _fit([record, stopper])
    rewards = [m["reward/mean"] for m in record.metrics]
    expected = _reference_stop(rewards, "max", 2, 0.05)
    assert expected is not None and expected < 8  # the toy's rewards plateau within 8 steps
    assert state.step == stopper.stopped_step == expected == len(rewards)


def test_fit_stops_on_validation_metric():
    record = Record()
    stopper = EarlyStopping("val/accuracy", mode="min", patience=2)
    state = _fit([record, Evaluation(prompt_rows(4, seed=3), every_n_steps=1, at_end=False), stopper])
    accuracies = [m["val/accuracy"] for m in record.val]
    expected = _reference_stop(accuracies, "min", 2, 0.0)
    assert expected is not None and state.step == stopper.stopped_step == expected


def test_missing_metric_and_bad_arguments():
    with pytest.raises(KeyError, match="monitor='reward/mena'.*reward/mean"):
        _fit([EarlyStopping("reward/mena")], max_steps=1)
    with pytest.raises(ValueError, match="mode='up'"):
        EarlyStopping(mode="up")
    with pytest.raises(ValueError, match="patience=0"):
        EarlyStopping(patience=0)
    with pytest.raises(ValueError, match="min_delta=-1"):
        EarlyStopping(min_delta=-1)
