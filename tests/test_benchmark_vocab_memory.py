"""benchmarks/vocab_memory.py in quick mode: it prints its tables and one JSON line with every field;
the numbers are not asserted (speed and memory are measured in benchmarks/), only what cannot
depend on the machine: chunking never needs more scratch than the unchunked pass."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vocab_memory.py"
ROW_FIELDS = {"vocab", "completion", "kind", "full_logits_mb", "temp_mb_off", "temp_mb_previous", "temp_mb_on",
              "rss_mb_off", "rss_mb_on"}


@pytest.mark.slow
def test_vocab_memory_quick_mode_prints_tables_and_one_json_line():
    env = {**os.environ, "XLA_FLAGS": os.environ.get("RLBOLT_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=1200,
                         check=True, env=env).stdout
    assert "| vocab | completion | pass |" in out and "| logits | seconds | vs off |" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["system"] == "rlbolt-vocab-memory" and result["machine"]
    rows = result["memory"]
    assert {(r["kind"], r["vocab"], r["completion"]) for r in rows} == {
        (kind, v, c) for kind in ("logps", "train") for v, c in ((512, 16), (1024, 16), (1024, 32))}
    for row in rows:
        assert set(row) == ROW_FIELDS
        assert 0 < row["temp_mb_on"] <= row["temp_mb_off"]
    assert sum(r["rss_mb_on"] is not None for r in rows) == 1  # quick mode: the first point's training step
    assert set(result["timing"]["seconds"]) == {"off", "previous", "256", "512", "1024"}
    assert all(s > 0 for s in result["timing"]["seconds"].values())
