"""Python objects passed to build_run are recorded in config.yaml and survive `rlbolt resume`
(or resume refuses in one line), instead of resume silently training with the config's own reward."""

from __future__ import annotations

import functools
import textwrap

import pytest
import yaml

from rlbolt.config import references as objects
from rlbolt.app.build import build_run
from rlbolt.app.cli import main
from rlbolt.config import ConfigError, load_config
from rlbolt.loggers import read_jsonl
from rlbolt.rewards.format import digit_fraction_reward
from rlbolt.rewards import WeightedReward

CONSTANT = 0.375  # exact in float32; no built-in reward term gives it on every sample


def test_reference_of_finds_module_level_objects_only():
    assert objects.reference_of(digit_fraction_reward) == "rlbolt.rewards.format:digit_fraction_reward"
    assert objects.reference_of(WeightedReward) == "rlbolt.rewards.combine:WeightedReward"
    assert objects.import_reference("rlbolt.rewards.format:digit_fraction_reward", "objects.reward") is digit_fraction_reward

    def nested(completion, sample):
        return 1.0

    main_level = lambda completion, sample: 1.0  # noqa: E731
    main_level.__module__ = "__main__"
    for obj in (lambda c, s: 1.0, nested, main_level, functools.partial(digit_fraction_reward),
                WeightedReward([("d", digit_fraction_reward, 1.0)])):
        assert objects.reference_of(obj) is None
        note = objects.record(obj)
        assert note.startswith("<not importable: ") and note.endswith(">")
        with pytest.raises(ConfigError, match=r"objects.reward: this run was built with a Python object .*script"):
            objects.import_reference(note, "objects.reward")


def test_resolve_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=r"objects.reward='nope' must look like 'package.module:name'"):
        objects.import_reference("nope", "objects.reward")
    with pytest.raises(ConfigError, match=r"objects.model='rlbolt.models:NoSuchThing' does not import"):
        objects.import_reference("rlbolt.models:NoSuchThing", "objects.model")


def _config(run_dir, **extra):
    return load_config({
        "model": {"tiny": {"hidden_size": 32, "num_layers": 1}},
        "data": {"builtin_train_rows": 8, "max_prompt_tokens": 64},
        "plan": {"prompts_per_step": 2, "num_generations": 2},
        "rollout": {"max_new_tokens": 4, "val_num_samples": 1},
        "trainer": {"max_steps": 1, "run_dir": str(run_dir)},
        "callbacks": {"checkpoint_every_n_steps": 1, "metrics": ["jsonl"], "progress": False, "throughput": False},
        **extra})


@pytest.fixture
def reward_package(tmp_path, monkeypatch):
    """An importable package holding a module-level reward, like a user's `mypkg.rewards`."""
    package = tmp_path / "site" / "newcomer_rewards_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "rewards.py").write_text(textwrap.dedent(f"""
        from rlbolt.rewards import WeightedReward

        def score(completion, sample):
            return {CONSTANT}

        REWARD = WeightedReward([("constant", score, 1.0)])
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    import newcomer_rewards_pkg.rewards as module

    yield module
    import sys

    for name in ("newcomer_rewards_pkg.rewards", "newcomer_rewards_pkg"):
        sys.modules.pop(name, None)


def test_module_level_instances_are_found_by_the_name_that_holds_them(reward_package):
    assert objects.reference_of(reward_package.REWARD) == "newcomer_rewards_pkg.rewards:REWARD"
    assert objects.import_reference("newcomer_rewards_pkg.rewards:REWARD", "objects.reward") is reward_package.REWARD
    assert objects.reference_of(WeightedReward([("constant", reward_package.score, 1.0)])) is None  # a copy


def test_an_importable_reward_object_survives_rlbolt_resume(tmp_path, reward_package):
    run_dir = tmp_path / "run"
    module, trainer, train, val = build_run(_config(run_dir), reward=reward_package.score)
    trainer.fit(module, train, val)
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert written["objects"]["reward"] == "newcomer_rewards_pkg.rewards:score"

    assert main(["resume", str(run_dir), "--max-steps", "2"]) == 0
    records = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert sorted(records) == [1, 2]
    # Both the first run and the resumed step scored with the object, not the config's reward.weights.
    assert records[1]["reward/mean"] == records[2]["reward/mean"] == CONSTANT


def test_a_reward_that_cannot_be_imported_makes_resume_refuse_in_one_line(tmp_path, capsys):
    run_dir = tmp_path / "run"
    build_run(_config(run_dir), reward=lambda completion, sample: 1.0)  # writes config.yaml; no training
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["objects"]["reward"].startswith("<not importable")
    (run_dir / "checkpoints" / "1").mkdir()  # as if it had trained: resume gets past "no checkpoint"
    assert main(["resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "objects.reward" in err[0] and "running the script that built it again" in err[0]
