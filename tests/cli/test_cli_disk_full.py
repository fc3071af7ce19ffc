"""A full disk while a run writes metrics.jsonl (not a checkpoint), through `rlbolt demo` in-process:
exit 1 with one line naming the file, the free space and the finished checkpoints, a torn last
metrics line left on disk, and an exact resume once there is space again. (A full disk during a
checkpoint write: tests/callbacks/test_checkpoint_write_errors.py and, as real processes, the
slow tests/cli/test_cli_faults.py.)"""

from __future__ import annotations

import errno
import json

import pytest

from rlbolt.app.cli import main
from rlbolt.loggers import JsonlWriter, read_jsonl

STEPS, FULL_AT = 4, 3
TIMING = ("time/", "throughput/")


class FillsUp:
    """A metrics file that takes half of the line for step `FULL_AT`, then fails as a full disk does:
    that write and every later flush or close raise ENOSPC."""

    def __init__(self, f):
        self._f, self.full = f, False

    def write(self, text: str) -> int:
        if json.loads(text)["step"] == FULL_AT:
            self._f.write(text[: len(text) // 2])
            self._f.flush()
            self.full = True
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._f.write(text)

    def flush(self) -> None:
        self._f.flush()
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        self._f.close()
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._f, name)


def demo(run_dir, *extra: str) -> list[str]:
    return ["demo", "--run-dir", str(run_dir), "--max-steps", str(STEPS), "--no-progress", *extra]


def untimed(path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_jsonl(path)}


@pytest.fixture
def full_disk(monkeypatch):
    opened = JsonlWriter.__init__

    def init(self, path, **kwargs):
        opened(self, path, **kwargs)
        if self.path.name == "metrics.jsonl":
            self._file = FillsUp(self._file)

    monkeypatch.setattr(JsonlWriter, "__init__", init)
    return monkeypatch


def test_disk_full_while_logging_metrics_is_one_line_and_resumes_exactly(tmp_path, capsys, full_disk):
    run_dir = tmp_path / "run"
    assert main(demo(run_dir, "--checkpoint-every", "1")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    metrics = run_dir / "metrics.jsonl"
    assert err.startswith(f"rlbolt demo: error: could not write {metrics}: no space left on device (free "), err
    kept = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert kept and max(kept) < FULL_AT <= STEPS  # steps before the failure are checkpointed, intact
    assert f"finished checkpoints: {kept}, intact" in err and err.rstrip().endswith(f"rlbolt resume {run_dir}")
    assert not metrics.read_bytes().endswith(b"\n")  # the torn half line is on disk

    full_disk.undo()  # space again
    assert main(["resume", str(run_dir)]) == 0
    lines = metrics.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # the torn line was cut, not glued to the next one
    assert main(demo(tmp_path / "reference", "--checkpoint-every", "1")) == 0
    assert untimed(metrics) == untimed(tmp_path / "reference" / "metrics.jsonl")
    assert sorted(untimed(metrics)) == list(range(1, STEPS + 1))


def test_a_failed_append_names_its_file_and_close_does_not_raise_again(tmp_path):
    writer = JsonlWriter(tmp_path / "m.jsonl")
    writer.write_scalars(1, {"a": 1.0})
    writer._file = FillsUp(writer._file)
    with pytest.raises(OSError) as failed:
        writer.write_scalars(FULL_AT, {"a": 2.0})
    assert failed.value.errno == errno.ENOSPC and failed.value.filename == str(tmp_path / "m.jsonl")
    writer.flush()  # the buffered tail is dropped, not raised a second time
    writer.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "m.jsonl")] == [1]  # the torn line is not read as a step
