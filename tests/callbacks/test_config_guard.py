"""The config-change matrix: every field of every config a run can record is changed in turn;
the ones that change the math are refused at resume with a one-line diff, accepted with the
override and recorded, and the free ones pass silently.

The free fields below are the issue's contract (how long to run, validation, logging,
checkpoint cadence, progress bar), written out here independently of the code's list.
"""

from __future__ import annotations

import dataclasses
import json
import types

import jax.numpy as jnp
import optax
import pytest

from rlbolt.config import SECTIONS, config_to_dict, load_config
from rlbolt.demo import DemoConfig
from rlbolt.callback import CallbackList
from rlbolt.checkpointing import config_guard
from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.checkpointing.config_guard import ConfigChanged
from rlbolt.plan import BatchPlan
from rlbolt.state import StepInfo, TrainState
from fake_fit import FakeFit
from rlbolt.module import ModuleCard, RLModule

FREE = {
    "trainer.max_steps", "trainer.max_epochs", "trainer.val_every_n_steps", "trainer.val_batch_size",
    "trainer.run_dir", "trainer.prefetch_timeout_s", "data.val", "data.builtin_val_rows",
    "rollout.val_temperature", "rollout.val_num_samples", "demo.max_steps", "demo.checkpoint_every",
    "trainer.val_at_start", "model.logits_chunk_tokens", "model.remat", "model.scan_layers", "model.attention",
    "plan.packing", "plan.packed_row_tokens", "plan.packed_rows",  # packed or padded rows: same math (tests/packing)
}
FREE_SECTIONS = ("callbacks.",)


def expected_free(key: str) -> bool:
    return key in FREE or key.startswith(FREE_SECTIONS)


def mutated(value):
    """A different value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 3 + 0.5
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, (list, tuple)):
        return [*value, "x"]
    if isinstance(value, dict):
        return {**value, "added": 1}
    return 7  # None


def every_field_of(record: dict):
    for section, values in record.items():
        for key, value in values.items():
            yield section, key, value


def cli_record() -> dict:
    return config_to_dict(load_config({"algorithm": {"lr": 1e-6}}))


def test_every_cli_config_field_is_classified(tmp_path):
    base = cli_record()
    assert set(base) == set(SECTIONS)
    seen = 0
    for section, key, value in every_field_of(base):
        changed = json.loads(json.dumps(base))
        changed[section][key] = mutated(value)
        found = config_guard.math_changes(base, changed)
        name = f"{section}.{key}"
        if expected_free(name):
            assert found == [], name
        else:
            assert found and all(k == name or k.startswith(name + ".") for k, _, _ in found), (name, found)
        seen += 1
    assert seen == sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())


def test_every_demo_field_is_classified():
    base = DemoConfig().resolved().to_dict()  # what a run records
    for _, key, value in every_field_of(base):
        changed = {"demo": {**base["demo"], key: mutated(value)}}
        assert bool(config_guard.math_changes(base, changed)) != expected_free(f"demo.{key}"), key


def test_diff_is_one_line_with_old_and_new_values():
    old, new = cli_record(), cli_record()
    new["algorithm"]["lr"] = 3e-6
    new["plan"]["prompts_per_step"] = 8
    new["trainer"]["max_steps"] = 99  # free: not in the diff
    with pytest.raises(ConfigChanged) as info:
        config_guard.check(old, new, step=12, allow=False, directory="ckpt")
    message = str(info.value)
    assert "\n" not in message
    assert "algorithm.lr: 1e-06 -> 3e-06, plan.prompts_per_step: 4 -> 8;" in message
    assert "checkpoint step 12" in message and "--allow-config-change" in message and "max_steps" not in message


# -- a Python-API run: the recorded config comes from the Trainer, the plan and the module -----------
class Module(RLModule):
    def __init__(self, lr):
        self.hparams = {"lr": lr, "reward": "digits"}

    def card(self):
        return ModuleCard(model=None, model_config=None, policy_params=lambda p: p, hf_model=lambda p: None,
                          hparams=self.hparams)


def make_state(step: int) -> TrainState:
    params = {"w": jnp.full((2, 2), float(step))}
    return TrainState(step=step, params=params, opt_state=optax.sgd(0.1).init(params), rng=jnp.zeros(2, jnp.uint32),
                      policy_version=step, data_position=step)


def api_trainer(run_dir, callbacks, *, lr=0.1, seed=0, max_steps=10, prompts=4, shuffle=True):
    module = Module(lr)
    return FakeFit(run_dir, callbacks, module=module, card=module.card(),
                   plan=BatchPlan(prompts_per_step=prompts, num_generations=2),
                   settings=dict(seed=seed, data_seed=seed, shuffle=shuffle, max_staleness=None, max_steps=max_steps,
                                 max_epochs=None, val_every_n_steps=None, val_batch_size=4))


def save_step_3(run_dir):
    ckpt = ModelCheckpoint(every_n_steps=1, async_save=False)
    trainer = api_trainer(run_dir, [ckpt])
    trainer.restore_with(ckpt, make_state(0))
    trainer.callbacks.on_step_end(trainer.run, StepInfo(3, make_state(3), {}, 0.0))
    ckpt.finish()


@pytest.mark.parametrize("change, diff", [
    ({"lr": 0.2}, "module.hparams.lr: 0.1 -> 0.2"),
    ({"seed": 1}, "trainer.data_seed: 0 -> 1, trainer.seed: 0 -> 1"),
    ({"prompts": 8}, "plan.mini_batch_size: 8 -> 16, plan.prompts_per_step: 4 -> 8"),  # derived sizes too
    ({"shuffle": False}, "trainer.shuffle: True -> False"),
])
def test_api_run_math_change_refused_then_allowed_and_recorded(tmp_path, change, diff):
    save_step_3(tmp_path)
    with pytest.raises(ConfigChanged, match=diff.replace(".", r"\.")):
        api_trainer(tmp_path, [], **change).restore_with(ModelCheckpoint(), make_state(0))
    assert not (tmp_path / config_guard.CHANGES_FILE).exists()

    ckpt = ModelCheckpoint(allow_config_change=True)
    restored = api_trainer(tmp_path, [ckpt], **change).restore_with(ckpt, make_state(0))
    assert restored.step == 3
    lines = (tmp_path / config_guard.CHANGES_FILE).read_text().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["step"] == 3
    for item in diff.split(", "):
        key, values = item.split(": ")
        assert [repr(v) for v in entry["changes"][key]] == values.split(" -> ")


def test_api_run_free_change_passes_silently(tmp_path):
    save_step_3(tmp_path)
    restored = api_trainer(tmp_path, [], max_steps=50).restore_with(ModelCheckpoint(), make_state(0))
    assert restored.step == 3 and not (tmp_path / config_guard.CHANGES_FILE).exists()
