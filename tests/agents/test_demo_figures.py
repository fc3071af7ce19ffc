"""benchmarks/agents_demo_figures.py reads a demo run's metrics.jsonl into the RESULTS figures (hand-made rows)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "agents_demo_figures.py"


def _module():
    spec = importlib.util.spec_from_file_location("agents_demo_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(step, step_s, rollout_s, turns, tool_s, reward):
    return {"step": step, "time/step": step_s, "time/rollout": rollout_s, "throughput/samples_per_s": 128 / step_s,
            "agents/turns": turns, "agents/tool_calls": turns - 1, "agents/env_tokens": 3.0 * (turns - 1),
            "agents/model_tokens": 2.0 * turns, "agents/tool_time_s": tool_s, "reward/mean": reward}


def test_figures_over_the_steps_after_skip(tmp_path):
    rows = [_row(1, 100.0, 99.0, 9.0, 50.0, 0.0),  # compilation: left out by --skip 1
            _row(2, 2.0, 1.0, 1.0, 0.01, 0.2), _row(3, 4.0, 2.0, 2.0, 0.01, 0.4), _row(4, 1.0, 0.5, 3.0, 0.04, 0.6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    f = _module().run_figures(tmp_path, skip=1)
    assert f["steps"] == "2-4" and f["episodes_per_step"] == 128
    assert f["episodes_per_s"] == pytest.approx(64.0)  # median of 64, 32, 128
    assert f["rollout_episodes_per_s"] == pytest.approx(128.0)  # median of 128, 64, 256
    assert f["turns"] == pytest.approx(2.0) and f["tool_calls"] == pytest.approx(1.0)
    assert f["env_tokens"] == pytest.approx(3.0) and f["model_tokens"] == pytest.approx(4.0)
    assert f["tool_share_of_rollout"] == pytest.approx(0.01)  # median of 0.01, 0.005, 0.08
    assert f["reward"] == pytest.approx(0.4) and f["rollout_share_of_step"] == pytest.approx(0.5)


def test_the_script_prints_a_table_then_one_json_line_and_refuses_a_run_without_agent_steps(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(1, 1.0, 0.5, 2.0, 0.0, 0.5)) + "\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--skip", "0"], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()
    assert out[0].startswith("| run | steps | episodes/s") and json.loads(out[-1])[0]["turns"] == 2.0
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--skip", "5"], capture_output=True, text=True)
    assert bad.returncode != 0 and "no agents steps after --skip 5; run longer or lower --skip" in bad.stderr
