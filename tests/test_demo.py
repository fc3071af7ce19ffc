"""`rlbolt demo` end to end in a subprocess (the README's first command), reduced to a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from rlbolt.demo import DemoConfig, demo_rows, position_rewards
from rlbolt.loggers import read_jsonl

STEPS = 60  # the full demo passes 0.9 near step 200; by step 60 the reward has clearly left chance


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("demo") / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-m", "rlbolt.app.cli", "demo", "--run-dir", str(run_dir), "--max-steps",
                           str(STEPS)], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_demo_reward_rises(demo_run):
    run_dir, _ = demo_run
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    rewards = np.asarray([r["reward/mean"] for r in records])
    assert rewards[:5].mean() < 0.15  # a random policy gets ~1 digit in 10 right
    assert rewards[-5:].mean() > rewards[:5].mean() + 0.05


def test_demo_run_directory_layout(demo_run):
    run_dir, proc = demo_run
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config == DemoConfig(max_steps=STEPS).resolved().to_dict()  # the task's learning rate filled in
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == [str(STEPS)]
    png = (run_dir / "plots" / "reward.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    log = (run_dir / "train.log").read_text()
    assert f"step {STEPS} reward/mean=" in log and "summary:" in log
    assert "reward:" in proc.stdout and "at the start ->" in proc.stdout and f"{STEPS} steps in" in proc.stdout


def test_demo_rows_are_seeded_and_copy_the_digits():
    rows = demo_rows(DemoConfig(num_prompts=50, seed=3))
    assert rows == demo_rows(DemoConfig(num_prompts=50, seed=3))
    assert rows != demo_rows(DemoConfig(num_prompts=50, seed=4))
    for row in rows:
        assert row["prompt"] == row["target"] + "=" and len(row["target"]) == 4 and row["target"].isdigit()
    reverse = demo_rows(DemoConfig(num_prompts=5, seed=3, task="reverse"))
    assert [r["target"] for r in reverse] == [r["target"][::-1] for r in rows[:5]]
    increment = demo_rows(DemoConfig(num_prompts=1, seed=3, task="increment"))[0]
    assert increment["target"] == "".join(str((int(c) + 1) % 10) for c in rows[0]["target"])


def test_position_rewards_give_partial_credit():
    got = position_rewards(["1234", "1299", "", "12345"], ["1234", "1234", "1234", "1234"], 4)
    np.testing.assert_array_equal(got, [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])


def test_demo_config_rejects_bad_values():
    from rlbolt.demo import DemoConfigError

    with pytest.raises(DemoConfigError, match="demo.task='sort'"):
        DemoConfig(task="sort")
    with pytest.raises(DemoConfigError, match="num_generations"):
        DemoConfig(num_generations=1)
    with pytest.raises(DemoConfigError, match="learning_rate"):
        DemoConfig(learning_rate="fast")
    for config in (DemoConfig(seed=5), DemoConfig(seed=5).resolved()):
        assert DemoConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def _rewards(run_dir: Path) -> np.ndarray:
    return np.asarray([r["reward/mean"] for r in read_jsonl(run_dir / "metrics.jsonl")])


@pytest.mark.slow  # ~9 s; LoRA training itself stays in the default tier (tests/modules/test_lora_policy.py)
def test_demo_lora_trains_adapters_on_the_frozen_policy_of_another_run(demo_run, tmp_path):
    """The cheap twin of test_docs_commands.py::test_the_lora_page_commands: 8 LoRA steps on top of the
    60-step demo run."""
    import io

    import jax
    from flax import nnx

    from rlbolt.app.cli_export import latest_params
    from rlbolt.app.cli_run import run_demo

    base_dir, _ = demo_run
    run_demo(DemoConfig(max_steps=8, lora_rank=4, base_run=str(base_dir)), tmp_path / "lora", progress=False,
             out=io.StringIO())
    base_module, _, _ = latest_params(base_dir)
    module, step, _ = latest_params(tmp_path / "lora")
    assert step == 8 and module.lora is not None and module.lora.identity["path"] == str(base_dir.resolve())
    flat = lambda tree: {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}
    base, trained_on = flat(nnx.state(base_module.model, nnx.Param)), flat(module.lora.base)
    assert base.keys() == trained_on.keys() and all(base[k].tobytes() == trained_on[k].tobytes() for k in base)
    adapters = flat(nnx.state(module.model, nnx.LoRAParam))
    # r * (in + out) over q, k, v, o, gate, up, down (H=64, q=64, kv=32, I=128), two layers
    assert sum(v.size for v in adapters.values()) == 2 * 4 * ((64 + 64) + 2 * (64 + 32) + (64 + 64) + 2 * (64 + 128) + (128 + 64))
    assert all(np.abs(v).max() > 0 for k, v in adapters.items() if "lora_b" in k)  # B left zero: they trained
    assert len(_rewards(tmp_path / "lora")) == 8
    # The merged export carries the demo's tokenizer, as a full-parameter demo run's does.
    from rlbolt.app.cli_export import export_run

    export_run(tmp_path / "lora", tmp_path / "merged")
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    full = export_run(base_dir, tmp_path / "full")[0]
    assert (full / "tokenizer.json").read_bytes() == (tmp_path / "merged" / "tokenizer.json").read_bytes()

# The full LoRA demo (copy, then increment on its frozen policy) runs as docs/howto/lora.md types it:
# tests/test_docs_commands.py::test_the_lora_page_commands (slow tier).
