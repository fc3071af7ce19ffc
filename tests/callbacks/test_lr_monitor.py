"""LearningRateMonitor: `lr` equals the hand-computed schedule value of each step's last update,
from inject_hyperparams (also wrapped by NaNGuard) or from the module card's lr_schedule, and reaches
MetricsLogger when listed before it."""

import json

import optax
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.module import ModuleCard
from rlbolt.callbacks import LearningRateMonitor, MetricsLogger, NaNGuard
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

SCHEDULE = optax.linear_schedule(0.1, 0.0, 10)
# Two updates per step (4 samples, mini batches of 2): after step s the last update is number
# 2s - 1 (0-based), so lr = 0.1 * (1 - (2s - 1) / 10).
EXPECTED = [0.09, 0.07, 0.05]


class Record(Callback):
    def __init__(self):
        self.lrs = []

    def on_step_end(self, trainer, info):
        self.lrs.append(info.metrics.get("lr"))


class ScheduledToy(ToyModule):
    def __init__(self, schedule, optimizer):
        super().__init__(optimizer=optimizer)
        self.schedule = schedule

    def card(self):
        return ModuleCard(model=None, model_config=None, policy_params=lambda p: p, hf_model=lambda p: None,
                          lr_schedule=self.schedule)


def _fit(module, callbacks, tmp_path=None, steps=3):
    trainer = Trainer(BatchPlan(prompts_per_step=2, num_generations=2, mini_batch_size=2), max_steps=steps,
                      callbacks=callbacks, run_dir=tmp_path)
    return trainer.fit(module, prompt_rows(8))


def test_inject_hyperparams_schedule_reaches_the_logger(tmp_path):
    record = Record()
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
    _fit(ToyModule(optimizer=optimizer), [LearningRateMonitor(), record, MetricsLogger(writer=["jsonl"])], tmp_path)
    # the schedule in float32 (optax) against float64 by hand: 1e-6 relative is 8 float32 ulps of one multiply-add
    assert record.lrs == pytest.approx(EXPECTED, rel=1e-6)
    logged = [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx(EXPECTED, rel=1e-6)


def test_inject_hyperparams_inside_nan_guard_skip():
    record = Record()
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE)
    _fit(ToyModule(optimizer=optimizer), [NaNGuard(action="skip"), LearningRateMonitor(), record])
    assert record.lrs == pytest.approx(EXPECTED, rel=1e-6)


def test_module_schedule_with_optax_schedule_count():
    record = Record()
    monitor = LearningRateMonitor()
    module = ScheduledToy(SCHEDULE, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(SCHEDULE)))
    _fit(module, [monitor, record])
    assert monitor.source == "card.lr_schedule"
    assert record.lrs == pytest.approx(EXPECTED, rel=1e-6)


def test_module_schedule_counts_policy_versions_without_a_schedule_state():
    record = Record()
    module = ScheduledToy(lambda count: 0.1 / (1 + count), optax.adam(0.1))
    _fit(module, [LearningRateMonitor(), record], steps=2)
    assert record.lrs == pytest.approx([0.1 / 2, 0.1 / 4])  # counts 1 and 3: the last update of steps 1 and 2


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="inject_hyperparams"):
        _fit(ToyModule(), [LearningRateMonitor()], steps=1)


def test_listed_after_the_logger_still_reaches_it(tmp_path):
    from rlbolt.loggers import read_jsonl

    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    _fit(ToyModule(optimizer=optimizer), [MetricsLogger(writer=["jsonl"]), LearningRateMonitor()], tmp_path, steps=1)
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["lr"] == pytest.approx(0.1)
