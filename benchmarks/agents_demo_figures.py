"""The agents demos' throughput figures, read from the metrics of `rlbolt demo --task tool|guess` runs.

For each run directory (its `metrics.jsonl`), over the steps after `--skip` (compilation and the
first prompt buckets): episodes per second (end to end: rollout, scoring and the update; and of
the rollout alone), turns, tool calls and environment ids per episode, the share of the rollout's
time spent in tools (`agents/tool_time_s`, the calls' time summed over a step's episodes, over
`time/rollout`) and the mean reward. Medians over steps for rates, means for per-episode counts.

    rlbolt demo --task tool --max-steps 100 --run-dir runs/tool
    rlbolt demo --task guess --max-steps 100 --run-dir runs/guess
    python benchmarks/agents_demo_figures.py runs/tool runs/guess [--skip 20]

Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rlbolt.loggers import read_jsonl


def run_figures(run_dir: Path, skip: int) -> dict:
    """The figures of one run directory (see the module docstring)."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    rows = [r for r in rows if r.get("step", 0) > skip and "agents/turns" in r]
    if not rows:
        raise SystemExit(f"{run_dir}: no agents steps after --skip {skip}; run longer or lower --skip")
    episodes = [r["throughput/samples_per_s"] * r["time/step"] for r in rows]  # episodes in each step

    def mean(key):
        return statistics.fmean(r[key] for r in rows)

    return {
        "run": run_dir.name, "steps": f"{rows[0]['step']}-{rows[-1]['step']}",
        "episodes_per_step": round(statistics.median(episodes)),
        "episodes_per_s": statistics.median(r["throughput/samples_per_s"] for r in rows),
        "rollout_episodes_per_s": statistics.median(e / r["time/rollout"] for e, r in zip(episodes, rows)),
        "rollout_share_of_step": statistics.median(r["time/rollout"] / r["time/step"] for r in rows),
        "turns": mean("agents/turns"), "tool_calls": mean("agents/tool_calls"), "env_tokens": mean("agents/env_tokens"),
        "model_tokens": mean("agents/model_tokens"),
        "tool_share_of_rollout": statistics.median(r["agents/tool_time_s"] / r["time/rollout"] for r in rows),
        "reward": mean("reward/mean"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--skip", type=int, default=20, help="leave out the first N steps (default 20)")
    args = parser.parse_args()
    figures = [run_figures(d, args.skip) for d in args.run_dirs]
    print("| run | steps | episodes/s (step) | episodes/s (rollout) | turns | tool calls | env ids | model ids "
          "| time in tools | reward |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in figures:
        print(f"| {f['run']} | {f['steps']} | {f['episodes_per_s']:.0f} | {f['rollout_episodes_per_s']:.0f} | "
              f"{f['turns']:.2f} | {f['tool_calls']:.2f} | {f['env_tokens']:.1f} | {f['model_tokens']:.1f} | "
              f"{100 * f['tool_share_of_rollout']:.3f}% | {f['reward']:.3f} |")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
