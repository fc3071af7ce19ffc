"""`rlbolt fit CONFIG --section.key=value` on the GRPO recipe config (tiny model, two steps)."""

from __future__ import annotations

import json

import pytest
import yaml

from rlbolt.app.cli import main
from rlbolt.data import gsm8k_style_rows
from rlbolt.loggers import read_jsonl

RECIPE = "recipes/configs/grpo_gsm8k.yaml"


@pytest.fixture(scope="module")
def fit_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fit") / "run"
    data = run_dir.parent / "rows.jsonl"
    rows = [json.dumps(r) for r in gsm8k_style_rows(8)]
    data.write_text("\n".join(rows[:-1]) + "\n" + rows[-1][:20])  # a torn last line
    command = ["fit", RECIPE, "--trainer.max_steps=2", f"--trainer.run_dir={run_dir}", f"--data.train={data}",
               "--callbacks.checkpoint_every_n_steps=1", "--trainer.val_every_n_steps=null",
               "--data.builtin_val_rows=0", "--callbacks.progress=false", "--callbacks.metrics=[jsonl]"]
    assert main(command) == 2 and not run_dir.exists()  # refused, nothing left behind...
    data.write_text("\n".join(rows) + "\n")
    assert main(command) == 0  # ...so the fixed command runs
    return run_dir


def test_fit_writes_the_resolved_config_and_metrics(fit_run):
    config = yaml.safe_load((fit_run / "config.yaml").read_text())
    assert config["trainer"]["max_steps"] == 2 and config["trainer"]["run_dir"] == str(fit_run)
    # Fields the YAML left null are resolved from the algorithm's defaults before writing.
    assert config["algorithm"]["loss_aggregation"] == "seq-mean-token-mean"
    assert config["algorithm"]["clip_low"] == 0.2
    records = read_jsonl(fit_run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.1 for r in records)
    assert sorted(int(p.name) for p in (fit_run / "checkpoints").iterdir() if p.name.isdigit())[-1] == 2
    assert (fit_run / "plots" / "reward.png").is_file()
    log = (fit_run / "train.log").read_text()
    assert "step 2 reward/mean=" in log
    assert "trainable parameters:" in log and "| embed/embedding " in log and "Total: " in log


def test_fit_into_the_same_run_dir_again_is_refused(fit_run, capsys):
    before = (fit_run / "metrics.jsonl").read_bytes()
    assert main(["fit", RECIPE, f"--trainer.run_dir={fit_run}"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (fit_run / "metrics.jsonl").read_bytes() == before


@pytest.mark.slow
def test_resume_a_fit_run(fit_run):
    assert main(["resume", str(fit_run), "--max-steps", "3"]) == 0
    records = read_jsonl(fit_run / "metrics.jsonl", merge_steps=False)
    assert [r["step"] for r in records] == [1, 2, 3]
