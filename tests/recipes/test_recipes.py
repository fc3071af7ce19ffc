"""Each recipe end to end on the tiny random model: 2 steps, metrics finite, parameters changed."""

import importlib.util
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from rlbolt.callback import Callback

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
NAMES = ["grpo", "dapo", "drgrpo", "rloo", "reinforcepp", "gspo", "ppo"]
# Small enough for the busy CI CPU; every override goes through the same path a user's does.
FAST = ["trainer.max_steps=2", "trainer.val_every_n_steps=2", "plan.prompts_per_step=2", "plan.num_generations=4",
        "plan.mini_batch_size=null", "rollout.max_new_tokens=8", "rollout.val_num_samples=2",
        "data.max_prompt_tokens=32", "data.builtin_train_rows=8", "data.builtin_val_rows=2",
        "model.tiny={hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, head_dim: 16, intermediate_size: 64}",
        "algorithm.lr=0.01", "reward.weights={answer: 1.0, digits: 1.0}", "callbacks.metrics=[jsonl]"]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Record(Callback):
    def __init__(self):
        self.initial, self.metrics, self.val = None, [], {}

    def on_fit_start(self, trainer, state):
        self.initial = jax.tree.map(np.asarray, state.params)

    def on_step_end(self, trainer, info):
        self.metrics.append(info.metrics)

    def on_validation_end(self, trainer, step, metrics):
        self.val = metrics


def _run(name, tmp_path, extra=()):
    record = _Record()
    state, trainer = _load(name).main([*FAST, f"trainer.run_dir={tmp_path}", *extra], callbacks=[record])
    return state, trainer, record


# GRPO runs by default; the others repeat the same path with their own pieces (covered by
# tests/modules) and take ~1 min each on a busy CPU, so they run with `-m slow`.
SMOKE = [pytest.param(n, marks=() if n == "grpo" else pytest.mark.slow) for n in NAMES]


@pytest.mark.parametrize("name", NAMES)
def test_recipe_config_builds(name, tmp_path):
    """Every recipe's own YAML loads, resolves to its algorithm and builds module + trainer."""
    from rlbolt.app.build import build_run, parse_args

    recipe = _load(name)
    cfg = parse_args([f"trainer.run_dir={tmp_path}"], recipe.DEFAULT_CONFIG, algorithm=name)
    module, trainer, train_rows, val_rows = build_run(cfg)
    assert module.algorithm_name == name and type(module).__name__ in recipe.__dict__
    assert len(train_rows) == cfg.data.builtin_train_rows and len(val_rows) == cfg.data.builtin_val_rows
    assert trainer.max_steps == cfg.trainer.max_steps and trainer.plan.global_batch_size == 16
    assert len(recipe.__doc__) > 100 and "departs from the paper" in recipe.__doc__
    assert len((RECIPES / f"{name}_gsm8k.py").read_text().splitlines()) < 120


@pytest.mark.parametrize("name", SMOKE)
def test_recipe_smoke(name, tmp_path):
    state, trainer, record = _run(name, tmp_path)
    assert state.step == 2 and len(record.metrics) == 2
    for metrics in record.metrics:
        for key in ("loss", "grad_norm", "entropy", "reward/mean", "reward/digits/mean"):
            assert math.isfinite(metrics[key]), (key, metrics[key])
        assert metrics["grad_norm"] > 0
    changed = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, record.initial)
    assert max(jax.tree.leaves(changed)) > 0
    assert set(record.val) >= {"val/accuracy", "val/pass@2"} and 0 <= record.val["val/pass@2"] <= 1
    assert record.val["val/accuracy"] <= 1
    # The run folder holds the resolved config and the metrics the jsonl writer wrote.
    assert (tmp_path / "config.yaml").is_file()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert lines


def test_recipe_rejects_other_algorithm(tmp_path):
    from rlbolt.config import ConfigError

    with pytest.raises(ConfigError, match="recipes/dapo_gsm8k.py"):
        _load("grpo").main([*FAST, f"trainer.run_dir={tmp_path}", "algorithm.name=dapo"])
