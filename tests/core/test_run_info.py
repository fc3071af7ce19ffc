"""Callbacks get a frozen RunInfo, not the Trainer: the one last-step rule (`StepInfo.is_last`),
`Control.request_stop()`, old-signature callbacks kept for one release with a DeprecationWarning,
a module without a language model (card None) skipped cleanly, and fit's validation as an
`Evaluation` callback."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import optax
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.callbacks import EarlyStopping, Evaluation, LearningRateMonitor, MetricsLogger, ModelCheckpoint, Throughput
from rlbolt.checkpointing.io import CheckpointIO
from rlbolt.plan import BatchPlan
from rlbolt.run_info import RunInfo
from rlbolt.trainer import Trainer

PLAN = BatchPlan(prompts_per_step=4, num_generations=2)


class Seen(Callback):
    """Records what its hooks receive."""

    def __init__(self, stop_at: int | None = None):
        self.runs, self.last, self.stop_at = [], [], stop_at

    def on_fit_start(self, run, state):
        self.runs.append(run)

    def on_step_end(self, run, info):
        self.runs.append(run)
        self.last.append(info.is_last)
        if info.step == self.stop_at:
            run.control.request_stop()


@pytest.mark.parametrize("limits, expected", [
    ({"max_steps": 2}, [False, True]),
    # 14 prompts, 4 a step, 1 epoch: steps end at positions 4, 8, 12; 12 + 4 > 14, so step 3 is the last
    ({"max_epochs": 1}, [False, False, True]),
])
def test_is_last_is_the_run_plans_end_and_hooks_get_one_frozen_run_info(limits, expected):
    seen = Seen()
    state = Trainer(PLAN, callbacks=[seen], shuffle=False, **limits).fit(ToyModule(), prompt_rows(14))
    assert seen.last == expected and state.step == len(expected)
    run = seen.runs[0]
    assert isinstance(run, RunInfo) and all(r is run for r in seen.runs)
    assert run.total_steps == len(expected) and run.card is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.max_steps = 99


def test_request_stop_ends_the_fit_after_that_step():
    seen = Seen(stop_at=2)
    trainer = Trainer(PLAN, max_steps=5, callbacks=[seen])
    state = trainer.fit(ToyModule(), prompt_rows(24))
    assert state.step == 2 and seen.last == [False, False] and trainer.should_stop


def test_old_signature_gets_the_trainer_with_a_deprecation_warning():
    class Old(Callback):
        def __init__(self):
            self.got = []

        def on_step_end(self, trainer, info):
            self.got.append(trainer)
            if info.step == 1:
                trainer.should_stop = True  # the old way to stop still works for one release

    old = Old()
    with pytest.warns(DeprecationWarning, match=r"Old.on_step_end takes `trainer`.*RunInfo"):
        trainer = Trainer(PLAN, max_steps=3, callbacks=[old])
    state = trainer.fit(ToyModule(), prompt_rows(12))
    assert state.step == 1 and old.got == [trainer]


def test_a_module_without_a_language_model_is_skipped_cleanly(tmp_path):
    """ToyModule's card() is None: the checkpoint records no model, hparams no module_hparams,
    Throughput no attention term, and LearningRateMonitor reads an injected learning rate."""
    throughput = Throughput()
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    Trainer(PLAN, max_steps=1, run_dir=tmp_path, callbacks=[
        MetricsLogger(["jsonl"]), throughput, LearningRateMonitor(), ModelCheckpoint(async_save=False),
    ]).fit(ToyModule(optimizer=optimizer), prompt_rows(8))
    io = CheckpointIO(tmp_path / "checkpoints", read_only=True)
    meta = io.read_meta(1)
    io.close()
    hparams = json.loads((tmp_path / "hparams.json").read_text())
    assert hparams["module"] == "ToyModule" and "module_hparams" not in hparams
    assert throughput._shape == (0, 0)
    # the injected learning rate is a float32 array: 0.1 read back exactly as float32 rounds it
    assert [json.loads(line)["lr"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == \
        [float(np.float32(0.1))]
    assert meta["model"] is None and meta["config"]["module"]["hparams"] is None


def test_fit_val_data_installs_the_one_validator():
    trainer = Trainer(PLAN, max_steps=2, val_every_n_steps=1)
    trainer.fit(ToyModule(), prompt_rows(8), val_data=prompt_rows(2, seed=1))
    installed = [cb for cb in trainer.callbacks if isinstance(cb, Evaluation)]
    assert [(cb.state_key, [s for s, _ in cb.history]) for cb in installed] == [("Evaluation/fit", [1, 2])]
    # A second fit replaces it rather than adding another.
    trainer.fit(ToyModule(), prompt_rows(8), val_data=prompt_rows(2, seed=1))
    assert len([cb for cb in trainer.callbacks if isinstance(cb, Evaluation)]) == 1
    # EarlyStopping on a val/ metric needs a periodic Evaluation: fit's own (end only) is not one.
    with pytest.raises(ValueError, match="never validates mid-run"):
        Trainer(PLAN, max_steps=2, callbacks=[EarlyStopping("val/accuracy")]).fit(
            ToyModule(), prompt_rows(8), val_data=prompt_rows(2, seed=1))
