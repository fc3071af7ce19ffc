"""Gemma 2, Gemma 3 and Qwen3-MoE on an 8-device tp x fsdp mesh equal one device (fresh process)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cpu_devices import child_env

SCRIPT = Path(__file__).with_name("family_mesh_check.py")


@pytest.mark.slow
def test_new_families_on_a_mesh_equal_one_device():
    env = child_env()  # the script asks for its 8 devices itself
    done = subprocess.run([sys.executable, str(SCRIPT), json.dumps({"fsdp": 4, "tp": 2})], capture_output=True,
                          text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(results) == {"gemma2", "gemma3", "qwen3_moe"}
    for name, r in results.items():
        assert r["greedy_equal"] and r["distinct"] >= 8, (name, r)
        assert r["logp_diff"] <= 1e-4, (name, r)
