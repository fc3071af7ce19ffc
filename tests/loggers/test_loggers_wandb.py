"""WandbWriter in offline mode: the run folder appears under run_dir/wandb with the metrics."""

import pytest

from rlbolt.loggers import JsonlWriter, MultiWriter, WandbWriter, read_jsonl

from loggers.wandb_records import config, history, wait_for_exit


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def _run_file(run_dir):
    runs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one offline run under {run_dir / 'wandb'}, found {runs}"
    wait_for_exit(runs[0])
    return runs[0]


def test_offline_run_holds_the_logged_metrics_and_config(tmp_path, offline):
    writer = MultiWriter([
        JsonlWriter(tmp_path / "metrics.jsonl"),
        WandbWriter(project="rlbolt-test", run_dir=tmp_path, config={"lr": 0.01, "algo": "grpo"}),
    ])
    writer.write_hparams({"num_generations": 4})
    for step in range(1, 4):
        writer.write_scalars(step, {"loss": 1.0 / step, "reward/mean": 0.25 * step})
    writer.write_texts(3, {"sample": "2 + 2 = 4"})
    writer.close()

    rows = history(_run_file(tmp_path))
    assert [row["_step"] for row in rows] == [1, 2, 3]
    expected = read_jsonl(tmp_path / "metrics.jsonl")
    for row, record in zip(rows, expected):
        # the same float64 value through wandb's JSON: rel=1e-12 allows only a decimal round trip
        assert row["loss"] == pytest.approx(record["loss"], rel=1e-12)
        assert row["reward/mean"] == pytest.approx(record["reward/mean"], rel=1e-12)
    assert rows[-1]["sample"] == "2 + 2 = 4"
    cfg = config(_run_file(tmp_path))
    assert (cfg["lr"], cfg["algo"], cfg["num_generations"]) == (0.01, "grpo", 4)


def test_bad_mode_is_rejected_before_init(tmp_path):
    with pytest.raises(ValueError, match="mode='offlin'"):
        WandbWriter(run_dir=tmp_path, mode="offlin")
    assert not (tmp_path / "wandb").exists()
