"""`grpo_step.py --preset smollm2`: the step at real shapes, one fresh process per completion length.

Each length (32, 128, 512 new tokens; `--quick`: 32 on a 2-layer model) runs
`grpo_step.py --preset smollm2 --completion C` in its own process, so its peak RSS is its own,
and prints its full table there. With `--rounds R` the lengths take turns R times and each field
below is the median over that length's runs. Then one table row per length and one JSON line:

    step_s, split (rollout / logps / update / reward / other), bound_split (the products alone:
    prefill, decode, ref, update, update_attention; benchmarks/ceiling.py), phase_over_bound
    (rollout / its prefill + decode, logps / ref, update / its dense and attention products),
    update_over_bound (the target is <= 1.5), update_over_dense_bound (the dense products only),
    gen_tokens_per_s, peak_rss_mb, update_temp_mb, matmul_gflops, compiles_after_warmup, load_avg.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from machine import cpu_model

# What each length's line keeps from its process's result (the rest is in that process's own output).
KEPT = ("step_s_median", "step_s_all", "split", "bound_split", "bound_step_s", "phase_over_bound", "update_over_bound",
        "update_over_dense_bound",
        "gen_tokens_per_s", "peak_rss_mb", "update_temp_mb", "live_mb", "matmul_gflops", "gflops_per_step",
        "compiles_after_warmup", "load_avg", "train_micro", "layers", "vocab", "sequences", "prompt_len")


def run_lengths(script: Path, argv: list[str], lengths: tuple[int, ...], rounds: int) -> dict:
    """Runs `script argv --completion C` per length and round; prints the table and the JSON line.

    Args:
      script: grpo_step.py.
      argv: this process's arguments (passed on: --quick, --no-bound, --floor, ...).
      lengths: the completion lengths.
      rounds: how many times the lengths take turns.

    Returns:
      The final JSON line as a dict: {"system", "preset", "cpu_model", "cpus", "rounds", "lengths": [...]}.
    """
    if rounds < 1:
        raise ValueError(f"--rounds={rounds} must be at least 1")
    passed = list(argv)  # the child runs one length once: --rounds (and its value) stays here
    if "--rounds" in passed:
        i = passed.index("--rounds")
        del passed[i:i + 2]
    passed = [a for a in passed if not a.startswith("--rounds=")]
    runs: dict[int, list[dict]] = {c: [] for c in lengths}
    for _ in range(rounds):
        for c in lengths:
            out = subprocess.run([sys.executable, str(script), *passed, "--completion", str(c)],
                                 capture_output=True, text=True, check=False)
            sys.stdout.write(out.stdout)
            if out.returncode:
                sys.stderr.write(out.stderr[-4000:])
                raise SystemExit(f"grpo_step.py --completion {c} failed with exit status {out.returncode}")
            runs[c].append(json.loads(out.stdout.strip().splitlines()[-1]))
    lines = [{"completion": c, "runs": len(rs), **_median_fields(rs)} for c, rs in runs.items()]
    result = {"system": "rlbolt-real-shapes", "preset": "smollm2", "cpu_model": cpu_model(), "cpus": os.cpu_count(),
              "rounds": rounds, "quick": "--quick" in argv, "lengths": lines}
    _print_table(result)
    print(json.dumps(result))
    return result


def _median_fields(results: list[dict]) -> dict:
    """The kept fields, numbers (and dicts of numbers) as the median over runs; the first run's otherwise."""
    first = results[0]
    merged = {}
    for key in KEPT:
        value = first.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = statistics.median(r[key] for r in results)
        elif isinstance(value, dict) and all(isinstance(v, (int, float)) for v in value.values()):
            merged[key] = {k: statistics.median(r[key][k] for r in results) for k in value}
        elif key in ("step_s_all", "load_avg"):
            merged[key] = [r[key] for r in results]
        else:
            merged[key] = value
    return merged


def _print_table(result: dict) -> None:
    print(f"\nGRPO step at SmolLM2-135M shapes ({result['lengths'][0]['layers']} layers, vocab "
          f"{result['lengths'][0]['vocab']}), {result['cpu_model']}, medians of {result['rounds']} round(s)")
    print(f"{'new':>5} {'step s':>8} {'rollout':>8} {'logps':>7} {'update':>7} | {'bound: roll':>11} {'ref':>6} "
          f"{'update':>7} {'attn':>6} | {'upd/bnd':>7} {'dense':>6} {'roll/bnd':>8} {'gen tok/s':>9} {'RSS MB':>7} "
          f"{'load':>5}")
    for line in result["lengths"]:
        split, bound, ratio = line["split"], line["bound_split"] or {}, line["phase_over_bound"] or {}
        roll_bound = bound.get("prefill", float("nan")) + bound.get("decode", float("nan"))
        load = statistics.median(run[0] for run in line["load_avg"])
        print(f"{line['completion']:>5} {line['step_s_median']:8.2f} {split['rollout']:8.2f} {split['logps']:7.2f} "
              f"{split['update']:7.2f} | {roll_bound:11.2f} {bound.get('ref', float('nan')):6.2f} "
              f"{bound.get('update', float('nan')):7.2f} {bound.get('update_attention', float('nan')):6.2f} | "
              f"{ratio.get('update', float('nan')):7.2f} {line.get('update_over_dense_bound') or float('nan'):6.2f} "
              f"{ratio.get('rollout', float('nan')):8.2f} {line['gen_tokens_per_s']:9.1f} {line['peak_rss_mb']:7.0f} {load:5.1f}")
