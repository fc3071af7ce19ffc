"""What the ExperienceDock costs per global step, against the plain hand-over it replaced.

One step's traffic at GRPO-like shapes, on one thread (the dock's own work, no waiting): the
feeder adds N prompt rows; rollout takes micro batches and writes completions and sampler logps;
logps takes its micro batches and writes old/ref logps; advantage takes the whole batch and
writes rewards and advantages; train takes the whole batch. The baseline does what the old
sequential producer did with the same arrays: slice chunks, add columns, concatenate them.

    python benchmarks/dock.py            # N = 64 and 512 samples, 30 steps each
    python benchmarks/dock.py --quick    # N = 64, 3 steps (CI: fields only)

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from rlbolt.batch import Batch
from rlbolt.producer.dock import ExperienceDock
from rlbolt.producer import STAGE_INPUTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

P_LEN, C_LEN, G = 128, 512, 8


def columns(n: int, rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    """Per stage, the columns it writes for n samples."""
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    return {
        "prompts": {"prompt_index": np.repeat(np.arange(n // G), G), "group_ids": np.repeat(np.arange(n // G), G).astype(np.int32),
                    "policy_version": np.zeros(n, np.int32), "sample_keys": rng.integers(0, 2**32, (n, 2), dtype=np.uint32),
                    "question": np.array([f"q{i}" for i in range(n)], dtype=object)},
        "rollout": {"prompt_ids": rng.integers(0, 1000, (n, P_LEN), dtype=np.int32), "prompt_mask": np.ones((n, P_LEN), bool),
                    "completion_ids": rng.integers(0, 1000, (n, C_LEN), dtype=np.int32),
                    "completion_mask": np.ones((n, C_LEN), bool), "sampler_logps": f(n, C_LEN)},
        "logps": {"old_logps": f(n, C_LEN), "ref_logps": f(n, C_LEN)},
        "advantage": {"rewards": f(n), "advantages": f(n)},
    }


def dock_step(cols, n: int, micro: int) -> float:
    dock = ExperienceDock({k: v for k, v in STAGE_INPUTS.items() if k != "reward"})  # a module without on_reward
    t0 = time.perf_counter()
    dock.add(cols["prompts"], key=0)
    for stage in ("rollout", "logps"):
        for start in range(0, n, micro):
            _, idx = dock.get(stage, n=micro, one_batch=True)
            dock.put({k: v[start:start + micro] for k, v in cols[stage].items()}, idx)
    _, idx = dock.get("advantage", one_batch=True, whole_groups=True)
    dock.put(cols["advantage"], idx)
    batch, idx = dock.get("train", n=n, one_batch=True)
    assert batch.num_samples == n and len(dock) == 0
    return time.perf_counter() - t0


def concat_step(cols, n: int, micro: int) -> float:
    t0 = time.perf_counter()
    batch = Batch(cols["prompts"])
    for stage in ("rollout", "logps"):
        pieces = []
        for start in range(0, n, micro):
            piece = batch.slice(start, start + micro)
            pieces.append(piece.with_columns({k: v[start:start + micro] for k, v in cols[stage].items()}))
        batch = Batch.concat(pieces)
    batch = batch.with_columns(cols["advantage"])
    assert batch.num_samples == n
    return time.perf_counter() - t0



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one size, 3 steps (CI)")
    args = ap.parse_args()
    sizes, steps = ((64,), 3) if args.quick else ((64, 512), 30)
    rng = np.random.default_rng(0)
    results = {}
    for n in sizes:
        cols, micro = columns(n, rng), max(G, n // 8)
        dock_s, concat_s = [], []
        for _ in range(steps):  # alternate, so load changes hit both alike
            dock_s.append(dock_step(cols, n, micro))
            concat_s.append(concat_step(cols, n, micro))
        results[n] = {"micro": micro, "dock_ms": 1e3 * statistics.median(dock_s),
                      "concat_ms": 1e3 * statistics.median(concat_s)}
        results[n]["dock_us_per_sample"] = 1e3 * results[n]["dock_ms"] / n
    print(f"ExperienceDock vs chunk-and-concatenate, one step on one thread, median of {steps} ({cpu_model()})")
    print(f"{'samples':>8} {'micro':>6} {'dock ms':>9} {'concat ms':>10} {'dock us/sample':>15}")
    for n, r in results.items():
        print(f"{n:>8} {r['micro']:>6} {r['dock_ms']:>9.2f} {r['concat_ms']:>10.2f} {r['dock_us_per_sample']:>15.1f}")
    print(json.dumps({"system": "rlbolt-dock", "cpu": cpu_model(), "steps": steps,
                      "sizes": {str(n): r for n, r in results.items()}}))


if __name__ == "__main__":
    main()
