"""Evaluation: when it validates (steps, injected clock, last step, a run stopped by a later
callback), what it logs (sample-weighted val/* means checked against NumPy on the params of that
step), and that MetricsLogger and ModelCheckpoint(best_metric) receive them."""

import json

import numpy as np
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.callbacks import EarlyStopping, Evaluation, MetricsLogger, ModelCheckpoint
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

EVAL_ROWS = prompt_rows(5, seed=7)  # 5 rows in val batches of 2: chunks 2, 2, 1 (weighting matters)


class ScoreModule(ToyModule):
    """validation_step returns a closed-form function of the params: mean table[last prompt token, target]."""

    def validation_step(self, params, batch, *, num_samples=None):
        last = np.array([p[-1] for p in batch["prompt"]])
        k = num_samples
        return {"score": float(np.asarray(params["table"])[last, self.target].mean()), "k": float(k or 0)}


def expected_score(table):
    return float(np.mean([np.asarray(table)[row["prompt"][-1], 3] for row in EVAL_ROWS]))


class Record(Callback):
    def __init__(self, clock_by_step=None, clock=None):
        self.tables, self.val, self.clock_by_step, self.clock = {}, [], clock_by_step, clock

    def on_step_end(self, trainer, info):
        self.tables[info.step] = np.asarray(info.state.params["table"])
        if self.clock_by_step:
            self.clock[0] = self.clock_by_step[info.step]

    def on_validation_end(self, trainer, step, metrics):
        self.val.append((step, dict(metrics)))


def _fit(tmp_path, callbacks, max_steps=4, **kwargs):
    trainer = Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=max_steps, val_batch_size=2,
                      run_dir=tmp_path, callbacks=callbacks, **kwargs)
    return trainer.fit(ScoreModule(), prompt_rows(8))


def test_every_n_steps_and_end_with_logged_values(tmp_path):
    record = Record()
    evaluation = Evaluation(EVAL_ROWS, every_n_steps=2, num_samples=3)
    _fit(tmp_path, [record, evaluation, MetricsLogger(writer=["jsonl"])])
    assert [s for s, _ in evaluation.history] == [2, 4]  # step 4 is periodic and last: validated once
    assert record.val == evaluation.history
    for step, metrics in evaluation.history:
        # float64 means of scores on both sides: rel=1e-6 is ~1e10 float64 ulps (abs=1e-9 for a 0 score)
        assert metrics["val/score"] == pytest.approx(expected_score(record.tables[step]), rel=1e-6, abs=1e-9)
        assert metrics["val/k"] == 3.0  # num_samples reached the module as trainer.val_num_samples
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {line["step"]: line["val/score"] for line in lines if "val/score" in line}
    assert logged == pytest.approx({s: m["val/score"] for s, m in evaluation.history})


def test_every_secs_with_injected_clock(tmp_path):
    now = [0.0]
    record = Record(clock_by_step={1: 5.0, 2: 12.0, 3: 14.0, 4: 30.0}, clock=now)
    evaluation = Evaluation(EVAL_ROWS, every_secs=10, at_end=False, clock=lambda: now[0])
    _fit(tmp_path, [record, evaluation])
    assert [s for s, _ in evaluation.history] == [2, 4]  # 12 - 0 >= 10, then 30 - 12 >= 10 (14 - 12 < 10)


def test_at_end_with_max_epochs(tmp_path):
    evaluation = Evaluation(EVAL_ROWS)
    state = _fit(tmp_path, [evaluation], max_steps=None, max_epochs=1)  # 8 prompts / 2 per step
    assert state.step == 4 and [s for s, _ in evaluation.history] == [4]


def test_final_evaluation_when_a_later_callback_stops(tmp_path):
    record = Record()
    evaluation = Evaluation(EVAL_ROWS, every_n_steps=5)
    stopper = EarlyStopping(monitor="toy/logged", mode="min", patience=1, min_delta=10.0)  # stops at step 2
    state = _fit(tmp_path, [record, evaluation, stopper], max_steps=6)
    assert state.step == 2 and [s for s, _ in evaluation.history] == [2]
    # as above: float64 means of the same scores
    assert evaluation.history[0][1]["val/score"] == pytest.approx(expected_score(record.tables[2]), rel=1e-6, abs=1e-9)


def test_best_checkpoint_follows_evaluation(tmp_path):
    evaluation = Evaluation(EVAL_ROWS, every_n_steps=1, at_end=False)
    ckpt = ModelCheckpoint(tmp_path / "ckpt", keep=1, best_metric="val/score", async_save=False)
    _fit(tmp_path, [ckpt, evaluation], max_steps=3)
    scores = {s: m["val/score"] for s, m in evaluation.history}
    best = json.loads((tmp_path / "ckpt" / "best.json").read_text())
    assert best["step"] == max(scores, key=scores.get) and best["value"] == pytest.approx(max(scores.values()))
    assert (tmp_path / "ckpt" / str(best["step"])).is_dir()


def test_bad_arguments_and_order(tmp_path):
    with pytest.raises(ValueError, match="non-empty"):
        Evaluation([])
    with pytest.raises(ValueError, match="num_samples=0"):
        Evaluation(EVAL_ROWS, num_samples=0)
    evaluation, checkpoint = Evaluation(EVAL_ROWS), ModelCheckpoint(tmp_path / "c", best_metric="val/score")
    _fit(tmp_path, [evaluation, checkpoint], max_steps=1)  # listed first, still runs after the checkpoint
    assert (tmp_path / "c" / "1").is_dir() and evaluation.history[-1][0] == 1
