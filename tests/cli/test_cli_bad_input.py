"""`rlbolt fit` with bad input: exit 2, one line on stderr naming the field or file (and line)
and the fix, no run folder left behind; the same command, fixed, then gets as far as training.

Training itself is replaced by a recorder here (`_fit_and_report`), so each case costs only the
checks; `test_cli_fit.py` runs a fixed command for real after a refused one.
"""

from __future__ import annotations

import json

import pytest

from rlbolt.app import cli_run
from rlbolt.app.cli import main

RECIPE = "recipes/configs/grpo_gsm8k.yaml"
GOOD_ROWS = [{"question": f"Ann has {i} apples. How many?", "answer": f"#### {i}"} for i in range(1, 6)]


def _jsonl(rows) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _write(path, rows=GOOD_ROWS, **changes):
    """GOOD_ROWS as .jsonl, with row i replaced by raw bytes where `changes` say so (line{i}=b"...")."""
    lines = _jsonl(rows).splitlines(keepends=True)
    for key, raw in changes.items():
        lines[int(key[4:]) - 1] = raw
    path.write_bytes(b"".join(lines))
    return path


# name: (how to make it bad, args, what the one line must name, how to fix it)
# A file case writes `data.jsonl` (or the named file) in tmp_path; `fix` rewrites it or replaces args.
CASES = {
    "missing file": (None, ["--data.train={d}/nope.jsonl"], ["data.train", "nope.jsonl", "does not exist"],
                     {"args": ["--data.train={d}/data.jsonl"]}),
    "malformed line": (lambda d: _write(d / "data.jsonl", line2=b"{not json\n"), ["--data.train={d}/data.jsonl"],
                       ["data.jsonl line 2", "not valid JSON", "fix or remove"], {}),
    "wrong field": (lambda d: (d / "data.jsonl").write_bytes(_jsonl([{"q": r["question"], "answer": r["answer"]}
                                                                     for r in GOOD_ROWS])),
                    ["--data.train={d}/data.jsonl"], ["line 1", "'question'", "data.prompt_field"], {}),
    "top-level object": (lambda d: (d / "data.json").write_text(json.dumps(GOOD_ROWS[0])),
                         ["--data.train={d}/data.json"], ["data.json", "list of row objects", "wrap the rows"],
                         {"args": ["--data.train={d}/data.jsonl"]}),
    "torn last line": (lambda d: _write(d / "data.jsonl", line5=b'{"question": "Ann has'),
                       ["--data.train={d}/data.jsonl"], ["line 5", "torn", "fix or remove"], {}),
    "csv suffix": (lambda d: (d / "data.csv").write_text("question,answer\na,1\n"), ["--data.train={d}/data.csv"],
                   ["data.csv", "'.csv'", ".jsonl", "convert"], {"args": ["--data.train={d}/data.jsonl"]}),
    "not UTF-8": (lambda d: _write(d / "data.jsonl", line2=b'{"question": "caf\xe9", "answer": "1"}\n'),
                  ["--data.train={d}/data.jsonl"], ["data.jsonl line 2", "not UTF-8", "0xe9", "UTF-8"], {}),
    "null prompt": (lambda d: _write(d / "data.jsonl", line3=b'{"question": null, "answer": "1"}\n'),
                    ["--data.train={d}/data.jsonl"], ["line 3", "'question'", "null", "a prompt is a string"], {}),
    "list prompt": (lambda d: _write(d / "data.jsonl", line1=b'{"question": [1, 2, 3], "answer": "1"}\n'),
                    ["--data.train={d}/data.jsonl"], ["line 1", "[1, 2, 3]", "a prompt is a string"], {}),
    "non-ASCII prompt, built-in tokenizer": (
        lambda d: _write(d / "data.jsonl", line4='{"question": "Zoë has 2 €?", "answer": "1"}\n'.encode()),
        ["--data.train={d}/data.jsonl"], ["line 4", "'ë€'", "built-in character tokenizer", "model.tokenizer"], {}),
    "empty prompt": (lambda d: _write(d / "data.jsonl", line2=b'{"question": "", "answer": "1"}\n'),
                     ["--data.train={d}/data.jsonl"], ["line 2", "no tokens", "non-empty"], {}),
    "bad validation file": (lambda d: _write(d / "val.jsonl", line1=b"[]\n"),
                            ["--data.val={d}/val.jsonl", "--trainer.val_every_n_steps=1"],
                            ["data.val", "val.jsonl line 1", "JSON object"], {}),
    "too few rows for a step": (lambda d: (d / "data.jsonl").write_bytes(_jsonl(GOOD_ROWS[:3])),
                                ["--data.train={d}/data.jsonl"], ["3 prompt(s)", "plan.prompts_per_step=4"], {}),
    "max_steps=0": (None, ["--trainer.max_steps=0"], ["trainer.max_steps=0", ">= 1"],
                    {"args": ["--trainer.max_steps=1"]}),
    "async without max_staleness": (None, ["--trainer.mode=async"], ["trainer.mode=async", "trainer.max_staleness >= 1"],
                                    {"args": ["--trainer.mode=async", "--trainer.max_staleness=1"]}),
    "max_staleness in sync mode": (None, ["--trainer.max_staleness=3"], ["trainer.max_staleness=3", "trainer.mode=async"],
                                   {"args": []}),
    "val_every_n_steps without val rows": (None, ["--trainer.val_every_n_steps=2"],
                                           ["trainer.val_every_n_steps=2", "data.val"],
                                           {"args": ["--trainer.val_every_n_steps=2", "--data.builtin_val_rows=2"]}),
    "groups of one with GRPO": (None, ["--plan.num_generations=1"], ["num_generations=1", "GRPO", ">= 2"],
                                {"args": ["--plan.num_generations=2"]}),
    "plan that does not divide": (None, ["--plan.mini_batch_size=5"], ["mini_batch_size=5", "use"],
                                  {"args": ["--plan.mini_batch_size=8"]}),
    "missing model folder": (None, ["--model.path=/nope/qwen"], ["model.path=/nope/qwen", "does not exist", "null"],
                             {"args": []}),
    "missing tokenizer folder": (None, ["--model.tokenizer=/nope/tok"], ["model.tokenizer=/nope/tok", "does not exist"],
                                 {"args": []}),
    "unknown tiny-model key": (None, ["--model.tiny={hidden: 3}"], ["model.tiny", "'hidden'", "hidden_size"],
                               {"args": ["--model.tiny={hidden_size: 32}"]}),
    "reward that does not import": (None, ["--objects.reward=nope_pkg.rewards:score"],
                                    ["objects.reward", "nope_pkg", "PYTHONPATH"],
                                    {"args": ["--objects.reward=rlbolt.rewards.format:digit_fraction_reward"]}),
    "reward weights all zero": (None, ["--reward.weights={answer: 0.0}"], ["reward.weights", "non-zero"],
                                {"args": ["--reward.weights={answer: 0.0, digits: 1.0}"]}),
    "early stopping on validation that never runs": (
        None, ["--callbacks.early_stopping_metric=val/accuracy"], ["callbacks.early_stopping_metric", "data.val"],
        {"args": ["--callbacks.early_stopping_metric=reward/mean"]}),
    "reward a worker process cannot receive": (
        None, ["--objects.reward=newcomer_unpicklable:REWARD", "--reward.executor=process"],
        ["reward.executor=process", "pickled", "reward.executor=thread"],
        {"args": ["--objects.reward=newcomer_unpicklable:REWARD", "--reward.executor=thread"]}),
    "nan learning rate": (None, ["--algorithm.lr=.nan"], ["algorithm.lr=nan", "finite"], {"args": ["--algorithm.lr=1e-4"]}),
}


@pytest.fixture(autouse=True)
def unpicklable_reward_module(tmp_path, monkeypatch):
    """An importable module whose reward (a module-level lambda wrapper) cannot be pickled."""
    (tmp_path / "newcomer_unpicklable.py").write_text(
        "import threading\n\nclass Reward:\n    lock = None\n\n    def __call__(self, completion, sample):\n"
        "        return 1.0\n\nREWARD = Reward()\nREWARD.lock = threading.Lock()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    import sys

    sys.modules.pop("newcomer_unpicklable", None)


@pytest.fixture
def no_training(monkeypatch):
    """Replaces training (and only training) with a recorder of what it would have trained."""
    calls = []

    def record(trainer, module, train_rows, val_rows, run_dir, out, target=None):
        calls.append((trainer, module, train_rows, val_rows, run_dir))
        return cli_run.RunSummary(run_dir, 0, 0.0, None, None, None, None, ())

    monkeypatch.setattr(cli_run, "_fit_and_report", record)
    return calls


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_exit_two_and_leaves_no_folder(name, tmp_path, capsys, no_training):
    make, args, needles, fix = CASES[name]
    _write(tmp_path / "data.jsonl")  # a good file too, for the fixes that point at it
    if make is not None:
        make(tmp_path)
    run_dir = tmp_path / "run"
    base = ["fit", RECIPE, f"--trainer.run_dir={run_dir}", "--trainer.max_steps=1", "--data.builtin_val_rows=0",
            "--trainer.val_every_n_steps=null"]
    fmt = lambda items: [a.replace("{d}", str(tmp_path)) for a in items]

    code = main(base + fmt(args))
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not run_dir.exists(), sorted(p.name for p in run_dir.iterdir())
    assert no_training == []

    if make is not None and "args" not in fix:
        _write(tmp_path / ("val.jsonl" if "val.jsonl" in " ".join(args) else "data.jsonl"))
    assert main(base + fmt(fix.get("args", args))) == 0, capsys.readouterr().err
    assert len(no_training) == 1 and (run_dir / "config.yaml").is_file()


def test_a_fresh_run_that_fails_before_its_first_step_removes_its_folder(tmp_path, monkeypatch, capsys):
    from rlbolt.trainer import Trainer

    def boom(self, module, train_data, val_data=None):
        raise RuntimeError("the model could not be loaded")

    monkeypatch.setattr(Trainer, "fit", boom)
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="could not be loaded"):
        main(["fit", RECIPE, f"--trainer.run_dir={run_dir}", "--callbacks.progress=false"])
    assert not run_dir.exists()  # so the corrected command is not refused as "not empty"
    run_dir.mkdir()  # an empty folder the user made stays, empty
    with pytest.raises(RuntimeError):
        main(["fit", RECIPE, f"--trainer.run_dir={run_dir}", "--callbacks.progress=false"])
    assert run_dir.is_dir() and not any(run_dir.iterdir())


def test_plot_of_a_malformed_metrics_line_is_one_line(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2,\n{"step": 3}\n')
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl:2" in err[0] and "fix or remove" in err[0]


def test_a_run_that_logged_a_step_keeps_its_folder(tmp_path):
    from rlbolt.app import rundir

    run = rundir.prepare_run_dir(tmp_path / "run")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    assert not rundir.discard_unused_run_dir(run) and (run / "metrics.jsonl").is_file()
    (run / "metrics.jsonl").write_text("")
    (run / "checkpoints" / "1").mkdir()
    assert not rundir.discard_unused_run_dir(run)
    (run / "checkpoints" / "1").rmdir()
    (run / "train.log").write_text("fit starts at step 0\n")
    assert rundir.discard_unused_run_dir(run) and not run.exists()
