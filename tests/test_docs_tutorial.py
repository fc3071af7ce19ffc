"""docs/tutorial.md works as written: its YAML config loads, every `rlbolt` command on the page
parses (overrides included) into a valid config, the batch sizes form a valid plan, the example
rows load with the configured field names, and the example reward scores them as its docstring
says. The slow test runs the page's CPU dry run end to end."""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "tutorial.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE.read_text(encoding="utf-8"), re.S)


def _config_file(tmp_path: Path) -> Path:
    (block,) = [b for b in _blocks("yaml") if b.startswith("# my_task.yaml")]
    path = tmp_path / "my_task.yaml"
    path.write_text(block, encoding="utf-8")
    return path


def _commands(program: str) -> list[list[str]]:
    out = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words and "=" in words[0] and not words[0].startswith("-"):
                words = words[1:]  # environment assignments (PYTHONPATH=.)
            if words and words[0] == program:
                out.append(words[1:])
    return out


def _rows() -> list[dict]:
    return [json.loads(line) for block in _blocks("json") for line in block.splitlines() if line.strip()]


def test_the_config_loads_and_its_plan_is_valid(tmp_path):
    from rlbolt.config import load_config
    from rlbolt.plan import BatchPlan

    cfg = load_config(_config_file(tmp_path))
    assert (cfg.data.prompt_field, cfg.data.answer_field) == ("problem", "solution")
    assert cfg.objects.reward == "my_task.rewards:score"
    assert cfg.algorithm.lr == 1e-6 and cfg.trainer.val_every_n_steps == 25
    plan = BatchPlan(**dataclasses.asdict(cfg.plan))
    assert plan.global_batch_size == 256
    assert cfg.plan.train_micro_batch_size % cfg.plan.num_generations == 0  # the prompt once per group
    assert cfg.plan.logps_micro_batch_size % cfg.plan.num_generations == 0


def test_every_fit_command_parses_into_a_valid_config(tmp_path):
    from rlbolt.app.cli import build_parser, split_overrides
    from rlbolt.config import load_config
    from rlbolt.plan import BatchPlan

    config = _config_file(tmp_path)
    commands = _commands("rlbolt")
    fits = [c for c in commands if c[0] == "fit"]
    assert len(fits) == 3, fits  # LoRA, the dry run, the run
    for words in fits:
        args, extra = build_parser().parse_known_args(words)
        assert args.config == "my_task.yaml"
        cfg = load_config(config, split_overrides(extra))
        BatchPlan(**dataclasses.asdict(cfg.plan))
        if cfg.model.lora is not None:
            assert cfg.model.lora["rank"] == 16 and 1e-5 <= cfg.algorithm.lr <= 1e-4
    for words in commands:
        if words[0] != "fit":
            build_parser().parse_args(words)  # resume / plot / export: exits (SystemExit) on a bad flag


def test_the_example_rows_load_with_the_configured_fields(tmp_path):
    from rlbolt.data import load_rows

    rows = _rows()
    assert len(rows) == 4
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    loaded = load_rows(path, required=("problem", "solution"))
    assert loaded == rows
    assert isinstance(loaded[-1]["problem"], list) and loaded[-1]["problem"][0]["role"] == "system"


def test_the_example_reward_scores_as_documented(tmp_path):
    (code,) = [b for b in _blocks("python") if "def score(" in b]
    namespace: dict = {}
    exec(compile(code, "tutorial.md", "exec"), namespace)  # noqa: S102 - our own docs
    score = namespace["score"]
    sample = {"problem": "How many pens are in 7 boxes of 12?", "solution": "84"}
    assert score("7 * 12 = 84.\nAnswer: 84", sample) == 1.0
    assert score("Answer: 1,084", {"solution": "1084"}) == 1.0
    assert score("Answer: 85", sample) == 0.1  # the format alone
    assert score("84", sample) == 0.0  # no 'Answer:' line
    assert score("Answer: 12\nAnswer: 84", sample) == 1.0  # the last one counts
    assert score("Answer: -3.5", {"solution": "-3.5"}) == 1.0
    # the hand check shown on the page, run as written next to the module
    (check,) = [c for c in _commands("python") if c[0] == "-c" and "my_task.rewards" in c[1]]
    (tmp_path / "my_task").mkdir()
    (tmp_path / "my_task" / "__init__.py").write_text("")
    (tmp_path / "my_task" / "rewards.py").write_text(code)
    done = subprocess.run([sys.executable, *check], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "1.0"


@pytest.mark.slow
def test_the_cpu_dry_run_trains_two_steps(tmp_path):
    """The page's dry-run command, verbatim, on the tiny model: the tutorial's files written into
    a fresh folder, two steps, validation, metrics and a checkpoint."""
    _config_file(tmp_path)
    (tmp_path / "my_task").mkdir()
    (tmp_path / "my_task" / "__init__.py").write_text("")
    (code,) = [b for b in _blocks("python") if "def score(" in b]
    (tmp_path / "my_task" / "rewards.py").write_text(code)
    (tmp_path / "data").mkdir()
    text_rows = [r for r in _rows() if isinstance(r["problem"], str)]
    for name in ("train.jsonl", "val200.jsonl"):
        (tmp_path / "data" / name).write_text("".join(json.dumps(r) + "\n" for r in text_rows * 4))
    (line,) = [b for b in _blocks("bash") if "runs/smoke" in b]
    words = shlex.split(line.strip())
    assert words[0] == "PYTHONPATH=." and words[1] == "rlbolt"
    command = [sys.executable, "-m", "rlbolt", *words[2:]]
    done = subprocess.run(command, cwd=tmp_path, env={**__import__("os").environ, "PYTHONPATH": "."},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(x) for x in (tmp_path / "runs" / "smoke" / "metrics.jsonl").read_text().splitlines()]
    assert {m["step"] for m in metrics if "reward/mean" in m} == {1, 2}
    assert any("val/accuracy" in m for m in metrics)
