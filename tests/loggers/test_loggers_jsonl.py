"""JsonlWriter / read_jsonl: the on-disk format, non-finite values, resume, kill safety."""

import json
import math
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rlbolt.loggers import JsonlWriter, read_jsonl


def _raw_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lines_parse_with_integer_step_and_float_values(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    writer.write_scalars(1, {"loss": 0.25, "reward/mean": np.float32(0.5), "n": np.int64(7)})
    writer.write_scalars(np.int64(2), {"loss": 0.125, "reward/mean": 1.0, "n": 3})
    writer.close()

    lines = _raw_lines(path)
    assert lines == [
        {"step": 1, "loss": 0.25, "reward/mean": 0.5, "n": 7.0},
        {"step": 2, "loss": 0.125, "reward/mean": 1.0, "n": 3.0},
    ]
    assert all(type(line["step"]) is int for line in lines)
    assert all(type(line["n"]) is float for line in lines)


def test_jax_scalars_are_written_as_host_floats(tmp_path):
    import jax.numpy as jnp

    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    writer.write_scalars(3, {"kl": jnp.asarray(0.75, jnp.float32), "lr": jnp.ones((1,)) * 2})
    writer.close()
    assert _raw_lines(tmp_path / "metrics.jsonl") == [{"step": 3, "kl": 0.75, "lr": 2.0}]


def test_non_finite_values_are_strings_on_disk_and_floats_when_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    writer.write_scalars(0, {"a": float("nan"), "b": np.float32("inf"), "c": -math.inf, "d": 1.5})
    writer.close()

    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    assert _raw_lines(path) == [{"step": 0, "a": "nan", "b": "inf", "c": "-inf", "d": 1.5}]
    (record,) = read_jsonl(path)
    assert math.isnan(record["a"]) and record["b"] == math.inf and record["c"] == -math.inf
    assert record["d"] == 1.5


def test_reopening_appends_and_read_jsonl_merges_repeated_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlWriter(path)
    for step in (1, 2, 3):
        first.write_scalars(step, {"loss": float(step)})
    first.close()
    # A run resumed from a step-2 checkpoint logs step 3 again, plus validation on its own line.
    second = JsonlWriter(path)
    second.write_scalars(3, {"loss": 30.0})
    second.write_scalars(3, {"val/accuracy": 0.5})
    second.write_scalars(4, {"loss": 40.0})
    second.close()

    assert [line["step"] for line in _raw_lines(path)] == [1, 2, 3, 3, 3, 4]
    assert read_jsonl(path) == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": 30.0, "val/accuracy": 0.5},
        {"step": 4, "loss": 40.0},
    ]
    assert len(read_jsonl(path, merge_steps=False)) == 6


def test_torn_last_line_is_cut_on_reopen(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    assert read_jsonl(path) == [{"step": 1, "loss": 1.0}]  # the reader skips it too
    writer = JsonlWriter(path)
    writer.write_scalars(2, {"loss": 2.0})
    writer.close()
    assert _raw_lines(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]


def test_sigkill_loses_no_completed_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    script = textwrap.dedent(f"""
        import sys, time
        from rlbolt.loggers import JsonlWriter
        writer = JsonlWriter({str(path)!r})
        for step in range(5):
            writer.write_scalars(step, {{"loss": step / 4}})
        print("written", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "written"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert read_jsonl(path) == [{"step": s, "loss": s / 4} for s in range(5)]


def test_hparams_and_texts_go_to_side_files(tmp_path):
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    writer.write_hparams({"optim": {"lr": 1e-6}, "model": "qwen", "shape": np.float32(2.0)})
    writer.write_texts(5, {"sample": "The answer is 4"})
    writer.close()
    assert json.loads((tmp_path / "hparams.json").read_text()) == {
        "optim": {"lr": 1e-6}, "model": "qwen", "shape": 2.0}
    assert _raw_lines(tmp_path / "texts.jsonl") == [{"step": 5, "sample": "The answer is 4"}]
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_bad_input_errors_name_the_problem(tmp_path):
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    with pytest.raises(ValueError, match=r"'adv'.*shape \(3,\)"):
        writer.write_scalars(0, {"adv": np.zeros(3)})
    with pytest.raises(TypeError, match="'note'.*write_texts"):
        writer.write_scalars(0, {"note": "hello"})
    with pytest.raises(ValueError, match="'step' is reserved"):
        writer.write_scalars(0, {"step": 1.0})
    writer.close()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_scalars(1, {"loss": 1.0})
    with pytest.raises(IsADirectoryError, match="metrics.jsonl"):
        JsonlWriter(tmp_path)
