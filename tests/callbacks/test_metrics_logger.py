"""MetricsLogger driven by a real Trainer.fit on the toy bigram module."""

import dataclasses
from pathlib import Path

import json
import jax
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.callbacks.metrics import MetricsLogger
from rlbolt.loggers import read_jsonl
from rlbolt.plan import BatchPlan
from rlbolt.run_info import RunInfo
from rlbolt.state import StepInfo
from rlbolt.trainer import Trainer


class Record(Callback):
    def __init__(self):
        self.infos, self.val = [], []

    def on_step_end(self, trainer, info):
        self.infos.append(info)

    def on_validation_end(self, trainer, step, metrics):
        self.val.append((step, dict(metrics)))


def _fit(tmp_path, logger, max_steps=4, **trainer_kw):
    rec = Record()
    trainer = Trainer(BatchPlan(prompts_per_step=4, num_generations=4), max_steps=max_steps,
                      callbacks=[logger, rec], run_dir=tmp_path, **trainer_kw)
    trainer.fit(ToyModule(), prompt_rows(16), val_data=prompt_rows(4, seed=1))
    return rec


def test_fit_writes_every_step_and_validation_to_jsonl_and_tensorboard(tmp_path, capsys):
    rec = _fit(tmp_path, MetricsLogger(["console", "jsonl", "tensorboard"]), val_every_n_steps=2)

    lines = read_jsonl(tmp_path / "metrics.jsonl", merge_steps=False)
    train = [r for r in lines if "loss" in r]
    val = [r for r in lines if "val/accuracy" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for record, info in zip(train, rec.infos):
        assert record == {"step": info.step, **info.metrics}
    assert [(r["step"], r["val/accuracy"]) for r in val] == [(s, m["val/accuracy"]) for s, m in rec.val]
    assert [s for s, _ in rec.val] == [2, 4]

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [1, 2, 3, 4]
    np.testing.assert_array_equal([e.value for e in acc.Scalars("reward/mean")],
                                  np.float32([i.metrics["reward/mean"] for i in rec.infos]))

    hparams = json.loads((tmp_path / "hparams.json").read_text())
    assert hparams["plan"]["prompts_per_step"] == 4 and hparams["trainer"]["max_steps"] == 4
    assert hparams["module"] == "ToyModule"
    console = capsys.readouterr().out.splitlines()
    assert console[0].startswith("hparams: ")
    assert [line.split(" | ")[0] for line in console[1:]] == [
        "step 1", "step 2", "step 2", "step 3", "step 4", "step 4"]


class FakeWriter:
    def __init__(self):
        self.calls = []

    def write_scalars(self, step, scalars):
        self.calls.append(("scalars", step, dict(scalars)))

    def write_hparams(self, hparams):
        self.calls.append(("hparams",))

    def write_texts(self, step, texts):
        self.calls.append(("texts", step))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))


def _trainer(is_main=True, max_steps=10, run_dir=Path("/nonexistent")):
    return RunInfo(run_dir=run_dir, is_main_process=is_main, max_steps=max_steps)


def _info(step, **metrics):
    return StepInfo(step=step, state=None, metrics=metrics, epoch=0.0)


def test_other_processes_never_touch_the_writer():
    writer = FakeWriter()
    logger = MetricsLogger(writer)
    trainer = _trainer(is_main=False)
    logger.on_fit_start(trainer, None)
    logger.on_step_end(trainer, _info(1, loss=1.0))
    logger.on_validation_end(trainer, 1, {"val/accuracy": 0.5})
    logger.on_fit_end(trainer, None)
    assert writer.calls == []


def test_exception_closes_the_writer_and_names_are_normalised():
    writer = FakeWriter()
    logger = MetricsLogger([writer], hparams={"lr": 0.1})
    trainer = _trainer()
    logger.on_fit_start(trainer, None)
    logger.on_step_end(trainer, _info(1, **{"Reward/Mean": 0.5, "time:step": 2.0}))
    logger.on_validation_end(trainer, 1, {"accuracy": 0.25})
    logger.on_exception(trainer, RuntimeError("boom"))
    assert writer.calls == [("hparams",), ("scalars", 1, {"reward/mean": 0.5, "time/step": 2.0}),
                            ("scalars", 1, {"val/accuracy": 0.25}), ("close",)]


def test_bad_writer_arguments_are_named():
    with pytest.raises(ValueError, match="'tensorbord' is unknown"):
        MetricsLogger(["jsonl", "tensorbord"])
    with pytest.raises(TypeError, match=r"writer=\['jsonl'\]"):
        MetricsLogger("jsonl")
    with pytest.raises(TypeError, match="neither a writer name"):
        MetricsLogger([42])


def _drive(logger, run, steps):
    logger.on_fit_start(run, None)
    for step in steps:
        info = _info(step, loss=float(step))
        logger.on_step_end(run, dataclasses.replace(info, is_last=run.is_last_step(step, 0)))
    logger.on_fit_end(run, None)


def test_every_n_steps_still_logs_the_last_step(tmp_path):
    _drive(MetricsLogger(["jsonl"], every_n_steps=2), _trainer(max_steps=5, run_dir=tmp_path), range(1, 6))
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl", merge_steps=False)] == [2, 4, 5]


def test_an_epoch_bounded_fit_logs_its_last_step(tmp_path):
    """max_epochs=1 over 12 prompts at 4 a step is 3 steps (no max_steps): with every_n_steps=2 the
    logger writes step 2 and, as the run's last, step 3 (the old rule, `step == max_steps`, never fired)."""
    trainer = Trainer(BatchPlan(prompts_per_step=4, num_generations=2), max_epochs=1, shuffle=False,
                      callbacks=[MetricsLogger(["jsonl"], every_n_steps=2)], run_dir=tmp_path)
    state = trainer.fit(ToyModule(), prompt_rows(12))
    assert state.step == 3
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl", merge_steps=False)] == [2, 3]


def test_every_secs_uses_the_injected_clock(tmp_path):
    now = [0.0]
    logger = MetricsLogger(["jsonl"], every_n_steps=None, every_secs=10.0, clock=lambda: now[0])
    trainer = _trainer(max_steps=None, run_dir=tmp_path)
    logger.on_fit_start(trainer, None)
    for step in range(1, 7):
        now[0] += 4.0  # logs when >= 10 s passed since the last log: t=12 (step 3), t=24 (step 6)
        logger.on_step_end(trainer, _info(step, loss=1.0))
    logger.on_fit_end(trainer, None)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl", merge_steps=False)] == [3, 6]


def test_resumed_logging_appends_to_the_same_file(tmp_path):
    _drive(MetricsLogger(["jsonl"]), _trainer(max_steps=4, run_dir=tmp_path), [1, 2, 3])  # killed after 3
    logger = MetricsLogger(["jsonl"])
    logger.load_state_dict(logger.state_dict())
    assert logger.state_dict() == {}
    _drive(logger, _trainer(max_steps=4, run_dir=tmp_path), [3, 4])  # resumed from a step-2 checkpoint
    lines = read_jsonl(tmp_path / "metrics.jsonl", merge_steps=False)
    assert [r["step"] for r in lines] == [1, 2, 3, 3, 4]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_val_at_start_validates_the_starting_weights_at_step_0(tmp_path):
    class Start(Record):
        def on_fit_start(self, trainer, state):
            self.start_params = jax.device_get(state.params)  # the first update donates the device arrays
            return state

    rec = Start()
    trainer = Trainer(BatchPlan(prompts_per_step=4, num_generations=4), max_steps=2, val_every_n_steps=2,
                      val_at_start=True, callbacks=[MetricsLogger(["jsonl"]), rec], run_dir=tmp_path)
    val_rows = prompt_rows(4, seed=1)
    state = trainer.fit(ToyModule(), prompt_rows(16), val_data=val_rows)
    assert [s for s, _ in rec.val] == [0, 2]
    lines = read_jsonl(tmp_path / "metrics.jsonl", merge_steps=False)
    assert [r["step"] for r in lines if "val/accuracy" in r] == [0, 2]
    # step 0 is the starting weights, step 2 the trained ones: each equals validating those params again
    trainer.callbacks = type(trainer.callbacks)([])  # the logger is closed after fit
    assert trainer.validate(rec.start_params, val_rows, 0) == rec.val[0][1]
    assert trainer.validate(state.params, val_rows, 2) == rec.val[1][1]
