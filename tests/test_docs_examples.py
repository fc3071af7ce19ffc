"""The docs a newcomer reads match the code: every `rlbolt.x.y` they name exists, every file
path and link points at a file in the repository, and the how-to's modules run and learn."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "benchmarks").glob("*.md"))]
PROSE = DOCS


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def test_every_rlbolt_name_in_the_docs_exists():
    bad = []
    for path in PROSE:
        text = path.read_text(encoding="utf-8")
        dotted = set(re.findall(r"(?<![\w/.])rlbolt(?:\.[A-Za-z_]\w*)+", text))
        for module, names in re.findall(r"^\s*from (rlbolt[\w.]*) import ([\w, ]+)$", text, re.M):
            dotted |= {f"{module}.{name.strip()}" for name in names.split(",") if name.strip()}
        bad += [f"{path.relative_to(ROOT)}: {name}" for name in sorted(dotted) if not _resolves(name)]
    assert not bad, f"the docs name things that do not exist: {bad}"


def _path_exists(token: str) -> bool:
    candidates = [ROOT / token, ROOT / "src" / token, ROOT / "src" / "rlbolt" / token]  # or relative to the package
    if token.startswith("rlbolt/callbacks/"):
        candidates.append(ROOT / "callbacks" / token[len("rlbolt/callbacks/"):])
    return any(c.exists() for c in candidates)


def _reference_pages() -> set[Path]:
    """The API pages docs/gen_reference.py writes at build time (they exist only on the site)."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    return {(ROOT / "docs" / "reference" / gen.page_path(name, package)).resolve()
            for name, package in gen.public_modules().items()}


def test_every_file_the_docs_point_at_exists():
    bad = []
    generated = _reference_pages()
    for path in PROSE:
        text = path.read_text(encoding="utf-8")
        for token in re.findall(r"`([\w./-]+/[\w.-]+\.(?:py|md|yaml|toml|json))`", text):
            # runs/, D/: run folders; my_task/: the files the tutorial has the reader write
            if not token.startswith(("runs/", "D/", "my_task/")) and not _path_exists(token):
                bad.append(f"{path.relative_to(ROOT)}: `{token}`")
        for link in re.findall(r"\]\(([^)#\s]+)", text):
            target = (path.parent / link).resolve()
            if not link.startswith(("http://", "https://")) and not target.exists() and target not in generated:
                bad.append(f"{path.relative_to(ROOT)}: ({link})")
    assert not bad, f"the docs point at files that are not in the repository: {bad}"


def _blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "howto" / name).read_text(encoding="utf-8"), re.S)


def _run(code: str, steps: tuple[str, str]) -> dict:
    assert steps[0] in code, f"the example no longer says {steps[0]!r}; update this test"
    namespace: dict = {}
    exec(compile(code.replace(*steps), "write-an-rlmodule.md", "exec"), namespace)  # noqa: S102 - our own docs
    return namespace


def test_howto_bigram_module_learns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ns = _run(_blocks("write-an-rlmodule.md")[0], ("max_steps=30", "max_steps=15"))
    table = np.asarray(ns["trainer"].last_state.params["table"], np.float64)
    p_target = np.exp(table) / np.exp(table).sum(axis=-1, keepdims=True)
    assert ns["trainer"].last_state.step == 15
    assert p_target[:, ns["TARGET"]].mean() > 0.3  # from 1/8 at the start


def test_howto_transformer_module_learns(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _run(_blocks("write-an-rlmodule.md")[1], ("max_steps=40", "max_steps=20"))
    rewards = [json.loads(line)["reward/mean"] for line in open("runs/tiny-transformer/metrics.jsonl")]
    assert len(rewards) == 20
    # A random policy emits the rewarded token 1 time in 14; the shown module raises that.
    assert np.mean(rewards[:3]) < 0.2 and np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.15


def test_howto_override_example_is_a_ready_module():
    from rlbolt.modules import GRPO

    namespace: dict = {}
    exec(_blocks("write-an-rlmodule.md")[2], namespace)  # noqa: S102
    assert issubclass(namespace["LengthPenalisedGRPO"], GRPO)


def test_objective_howto_registers_one_the_config_and_the_module_use():
    """The how-to's objective, registered by its one file, is what `algorithm.policy_loss` names:
    its aggregation fills in, the module's loss is REINFORCE's -A * logp (float64 by hand), a
    token the rollout correction dropped is out, and once unregistered the config refuses it."""
    from float_tolerance import EPS32

    from rlbolt.algorithms import OBJECTIVES
    from rlbolt.config import ConfigError, load_config

    namespace: dict = {}
    try:
        for block in _blocks("write-an-objective.md")[:2]:
            exec(block, namespace)  # noqa: S102 - our own docs
        assert namespace["cfg"].algorithm.loss_aggregation == "seq-mean-token-sum"  # not GRPO's seq-mean-token-mean
        rng = np.random.default_rng(0)
        logps = rng.normal(-1.0, 0.5, (3, 4)).astype(np.float32)
        advantages = np.array([1.5, -0.75, 0.0], np.float32)
        keep = np.ones((3, 4), bool)
        keep[0, 2] = False  # dropped by the rollout correction
        keep[1, 3:] = False
        batch = {"old_logps": logps - 0.1, "advantages": advantages, "completion_mask": np.ones((3, 4), bool),
                 "keep_mask": keep}
        got, info = namespace["module"].policy_loss(logps, batch)
        want = np.where(keep, -advantages.astype(np.float64)[:, None] * logps.astype(np.float64), 0.0)
        # one float32 product per token: half an ulp of the result
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=EPS32, atol=0)
        assert np.asarray(got)[0, 2] == 0.0 and {"ratio", "clipped"} <= set(info)
    finally:
        OBJECTIVES.unregister("reinforce")
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss='reinforce' is not a registered policy objective"):
        load_config({"algorithm": {"policy_loss": "reinforce"}})


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path):
    """The README's Python block, verbatim, in a fresh process: three steps, checkpoints at 2 and
    the end, metrics for each step (slow: it builds and compiles a real tiny GRPO run)."""
    import subprocess
    import sys

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "trainer.fit(" in block
    code = block + "\nprint('STEP', state.step)\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "STEP 3" in done.stdout
    run = tmp_path / "runs" / "readme"
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == 3 and 2 in steps
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert sorted({m["step"] for m in lines if "loss" in m or "reward/mean" in m}) == [1, 2, 3]


def _agents_example() -> tuple[str, str]:
    """The agents how-to's complete example: (the script, the config)."""
    text = (ROOT / "docs" / "howto" / "agents.md").read_text(encoding="utf-8")
    section = text[text.index("## A complete example"):text.index("## Training on episodes from Python")]
    script = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    config = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    return script, config


def test_agents_howto_environment_runs_its_tool_and_scores_the_answer():
    """The script's environment on scripted turns (a call, then the answer after some reasoning),
    and its config as `rlbolt fit` reads it; the slow twin below trains both."""
    from rlbolt.config import load_config

    script, config = _agents_example()
    namespace: dict = {}
    exec(compile(script, "agents.md", "exec"), namespace)  # noqa: S102 - our own docs; __main__ part skipped
    env = namespace["make_env"]({"question": "What is the weather in Oslo?", "city": "Oslo"})
    assert env.reset() == [{"role": "user", "content": "What is the weather in Oslo?"}]
    call = env.step('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert not call.done and call.tool_calls == 1 and call.tool_errors == 0
    assert [m["content"] for m in call.messages] == ["rain"]
    assert env.step("<think>the tool said rain; <tool_call>{\"name\": \"x\"}</tool_call>?</think>\nrain").reward == 1.0
    assert namespace["make_env"](namespace["ROWS"][4]).step("rain").reward == 0.0  # Rome: sun
    cfg = load_config(yaml.safe_load(config))
    assert (cfg.rollout.env, cfg.rollout.max_turns, cfg.rollout.max_total_tokens) == ("weather_env:make_env", 3, 96)
    assert cfg.reward.weights == {"env": 1.0} and cfg.rollout.env_max_failed_batches == 3


@pytest.mark.slow
def test_agents_howto_script_and_config_train(tmp_path, monkeypatch):
    """The script as a program, then the config through `rlbolt fit`: two steps each, whose reward
    is the environment's."""
    import subprocess
    import sys

    from rlbolt.app.cli import main

    script, config = _agents_example()
    (tmp_path / "weather_env.py").write_text(script)
    done = subprocess.run([sys.executable, "weather_env.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(script, "agents.md", "exec"), namespace)  # noqa: S102
    (tmp_path / "cities.jsonl").write_text("".join(json.dumps(r) + "\n" for r in namespace["ROWS"]))
    (tmp_path / "weather.yaml").write_text(config)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["fit", "weather.yaml", "--trainer.run_dir=runs/weather-cli", "--callbacks.progress=false"]) == 0
    for run in ("runs/weather", "runs/weather-cli"):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "reward/mean" in r]
        assert [r["step"] for r in steps] == [1, 2]
        for r in steps:  # float32 mean over the same 8 episode rewards against float64: rel 1e-6
            assert r["reward/mean"] == pytest.approx(r["agents/env_reward"], rel=1e-6, abs=1e-7)
