"""The agent traps a new user meets, through the config and the `rlbolt fit` entry point:

- with an environment the default `reward.weights` is the environment's reward (explicit weights
  that leave `env` out are refused in one line naming `reward.weights.env`);
- a `reset()` or factory that raises ends the run with exit 1 and one line on stderr;
- an environment that fails every episode stops the run after `rollout.env_max_failed_batches`
  batches, with one line quoting the first error, and each error is logged (train.log: slow test);
- a reference that does not import names its field once.
"""

from __future__ import annotations

import json
import logging
import textwrap

import pytest

from rlbolt.app.cli import main

from float_tolerance import EPS32
from rlbolt.config import ConfigError, load_config

ENVS = textwrap.dedent('''
    from rlbolt.agents import StepResult

    class Base:
        def __init__(self, row):
            self.row = row

        def reset(self):
            return None  # the row's own prompt

    class BrokenReset(Base):
        def reset(self):
            raise KeyError("question")

        def step(self, text):
            return StepResult(done=True)

    class BrokenStep(Base):
        def step(self, text):
            raise ValueError("the scorer broke")

    class Scored(Base):
        def step(self, text):
            return StepResult(reward=0.25 + 0.5 * (len(text) % 2), done=True)

    def broken_factory(row):
        raise RuntimeError("no such task")
''')
CONFIG = {"plan": {"prompts_per_step": 2, "num_generations": 2}, "rollout": {"max_new_tokens": 4, "max_turns": 2},
          "trainer": {"max_steps": 2}, "callbacks": {"progress": False, "checkpoint": False, "metrics": ["jsonl"]},
          "data": {"max_prompt_tokens": 32}}


@pytest.fixture
def envs(tmp_path, monkeypatch):
    (tmp_path / "trap_envs.py").write_text(ENVS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("RLBOLT_DEBUG", raising=False)
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(CONFIG))  # JSON is YAML
    return config


def _fit(config, tmp_path, *overrides):
    return main(["fit", str(config), f"--trainer.run_dir={tmp_path / 'run'}", *overrides])


def test_an_environment_reward_counts_by_default():
    cfg = load_config({"rollout": {"env": "trap_envs:Scored"}})
    assert cfg.reward.weights == {"env": 1.0}
    assert load_config({}).reward.weights == {"answer": 1.0, "format": 0.0}  # no environment: as before
    kept = load_config({"rollout": {"env": "trap_envs:Scored"}, "reward": {"weights": {"env": 0.0, "format": 1.0}}})
    assert kept.reward.weights == {"env": 0.0, "format": 1.0}  # env: 0 leaves it out knowingly
    with pytest.raises(ConfigError) as error:
        load_config({"rollout": {"env": "trap_envs:Scored"}, "reward": {"weights": {"answer": 1.0}}})
    assert "reward.weights.env" in str(error.value) and "\n" not in str(error.value)


def test_an_environment_from_python_gets_its_reward_too():
    from rlbolt.modules import GRPO

    assert GRPO({}, env=lambda row: None).config.reward.weights == {"env": 1.0}
    assert GRPO({}).config.reward.weights == {"answer": 1.0, "format": 0.0}
    explicit = GRPO({"reward": {"weights": {"format": 1.0, "env": 0.5}}}, env=lambda row: None)
    assert explicit.config.reward.weights == {"format": 1.0, "env": 0.5}


def test_a_reference_that_does_not_import_names_its_field_once(envs, tmp_path, capsys):
    assert _fit(envs, tmp_path, "--rollout.env=x:y") == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["rlbolt fit: error: rollout.env='x:y' does not import (ModuleNotFoundError: No module named 'x'); "
                   "check the name and that its package is installed or on PYTHONPATH"]
    assert not (tmp_path / "run").exists()


def test_a_reference_whose_module_raises_on_import_is_one_line(tmp_path, monkeypatch):
    from rlbolt.config.references import import_reference

    (tmp_path / "raises_on_import.py").write_text("x = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as error:
        import_reference("raises_on_import:x", "objects.reward")
    assert str(error.value) == ("objects.reward='raises_on_import:x': importing raises_on_import raised "
                                "ZeroDivisionError: division by zero; fix that module")


@pytest.mark.parametrize("env, quoted", [
    ("trap_envs:BrokenReset", "environment 0 (BrokenReset).reset() raised KeyError: 'question'"),
    ("trap_envs:broken_factory", "the environment factory raised RuntimeError: no such task for row 0 of the batch"),
])
def test_an_environment_that_cannot_start_ends_the_run_in_one_line(envs, tmp_path, capsys, env, quoted):
    assert _fit(envs, tmp_path, f"--rollout.env={env}") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # no traceback
    assert err[0].startswith(f"rlbolt fit: error: rollout.env: {quoted}") and "RLBOLT_DEBUG=1" in err[0]


def test_the_monitor_logs_each_error_once_and_stops_after_consecutive_failed_batches(caplog):
    from rlbolt.agents import EnvErrorMonitor, EnvFailureError

    monitor = EnvErrorMonitor(2)
    with caplog.at_level(logging.DEBUG, logger="rlbolt.agents"):
        monitor.record(3, {0: "A.step raised X: 1", 1: "A.step raised X: 1", 2: "B hung"})  # 1 of 2
        monitor.record(3, {1: "A.step raised X: 1"})  # an episode ran: the count starts again
        monitor.record(2, {0: "A.step raised X: 1", 1: "A.step raised X: 1"})  # 1 of 2
        with pytest.raises(EnvFailureError, match=r"in 2 consecutive batches \(rollout.env_max_failed_batches=2\)"
                                                  r".*: B hung\. Fix"):
            monitor.record(2, {1: "C", 0: "B hung"})  # quotes the first episode's error
    warned = [r.getMessage().split("): ")[-1] for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["A.step raised X: 1", "B hung", "C"]  # each distinct text once, in order
    assert sum(r.levelname == "DEBUG" for r in caplog.records) == 5  # the repeats: A three times, then A and B
    assert [r.levelname for r in caplog.records][-1] == "ERROR"  # why the run stopped, for train.log
    never = EnvErrorMonitor(0)
    for _ in range(5):
        never.record(1, {0: "always"})  # 0: never stops
    with pytest.raises(ValueError, match="must be an int >= 0"):
        EnvErrorMonitor(-1)


@pytest.mark.slow
def test_an_environment_that_fails_every_episode_stops_the_run(envs, tmp_path, capsys):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("rlbolt.agents").addHandler(handler)
    try:
        code = _fit(envs, tmp_path, "--rollout.env=trap_envs:BrokenStep", "--rollout.env_max_failed_batches=1")
    finally:
        logging.getLogger("rlbolt.agents").removeHandler(handler)
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("rlbolt fit: error: every episode ended with an environment error in 1 consecutive batches "
                       "(rollout.env_max_failed_batches=1), so training would only see zero rewards: BrokenStep.step "
                       "raised ValueError: the scorer broke. Fix the environment (every error is in train.log), or set "
                       "rollout.env_max_failed_batches=0 to train on regardless")
    assert "BrokenStep.step raised ValueError: the scorer broke" in err[0]  # the warning, once (then debug)
    # Four episodes, one error text: one warning (repeats go to debug level, below train.log's INFO).
    assert [r.levelname for r in records if "the scorer broke" in r.getMessage()] == ["WARNING", "ERROR"]
    assert records[-1].levelname == "ERROR" and "consecutive batches" in records[-1].getMessage()


@pytest.mark.slow
def test_environment_errors_reach_train_log_and_the_env_reward_is_the_reward(envs, tmp_path, capsys):
    """Two consecutive failed batches: step 1 trains (on zeros), step 2's rollout stops the run;
    train.log keeps the error and why the run stopped. A working environment's reward is the reward."""
    assert _fit(envs, tmp_path, "--rollout.env=trap_envs:BrokenStep", "--rollout.env_max_failed_batches=2") == 1
    log = (tmp_path / "run" / "train.log").read_text()
    assert "BrokenStep.step raised ValueError: the scorer broke" in log
    assert "in 2 consecutive batches (rollout.env_max_failed_batches=2)" in log
    capsys.readouterr()
    good = tmp_path / "good"
    assert main(["fit", str(envs), f"--trainer.run_dir={good}", "--rollout.env=trap_envs:Scored",
                 "--trainer.max_steps=1"]) == 0
    record = next(json.loads(line) for line in (good / "metrics.jsonl").read_text().splitlines()
                  if "reward/mean" in line)
    # Two float32 means of the same per-episode rewards (multiples of 0.25), summed in different
    # orders over at most 64 episodes: n * EPS32 relative (tests/float_tolerance.sum_error_bound's rule).
    assert record["reward/mean"] == pytest.approx(record["agents/env_reward"], rel=64 * EPS32)
    assert record["reward/mean"] >= 0.25  # every episode earns 0.25 or 0.75


def test_episode_rows_need_no_gold_answer_unless_the_answer_term_scores_them(tmp_path):
    from rlbolt.app.build import load_data

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "What is the weather in Oslo?", "city": "Oslo"}\n')
    with_env = {"data": {"train": str(rows)}, "rollout": {"env": "trap_envs:Scored"}}
    assert load_data(load_config(with_env))[0] == [{"question": "What is the weather in Oslo?", "city": "Oslo"}]
    for config in ({"data": {"train": str(rows)}},
                   {**with_env, "reward": {"weights": {"env": 1.0, "answer": 0.5}}}):
        with pytest.raises(ConfigError, match=r"missing field\(s\) \['answer'\]"):
            load_data(load_config(config))


def test_a_reward_that_fails_every_sample_ends_the_run_in_one_line(envs, tmp_path, capsys, monkeypatch):
    """The same class of failure as a broken environment: user code that cannot run, exit 1."""
    from rlbolt.rewards import RewardFailureError
    from rlbolt.trainer import Trainer

    def broken(self, module, train_data, val_data=None):
        raise RewardFailureError("every sample's reward failed in 3 consecutive batches: KeyError: 'answer'")

    monkeypatch.setattr(Trainer, "fit", broken)
    assert _fit(envs, tmp_path) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "rlbolt fit: error: every sample's reward failed in 3 consecutive batches: KeyError: 'answer'"]
