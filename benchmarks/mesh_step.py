"""The GRPO step on 1, 2, 4 and 8 CPU devices: what a mesh costs, and that it changes nothing.

Each device count runs `grpo_step.py` (the shared CPU workload through the public API) in a
fresh process, since the CPU backend's device count is fixed when JAX starts. The CPU "devices"
share the machine's cores, so more of them cannot be faster: this measures correctness (the
same rewards and update metrics on every mesh) and the overhead of sharding (collectives, more
and smaller kernels), not speedup. On a GPU host run `grpo_step.py --preset gpu --mesh ...`.

    python benchmarks/mesh_step.py              # 1, 2, 4, 8 devices, all on fsdp, 12 steps each
    python benchmarks/mesh_step.py --quick      # 1 and 2 devices, 2 steps (CI keeps it from rotting)
    python benchmarks/mesh_step.py --meshes '[{"fsdp": 4, "tp": 2}]' --devices 8

Prints a table, then one JSON line with every run's figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

HERE = Path(__file__).resolve().parent


def run_one(devices: int, mesh: dict, steps: int) -> dict:
    cmd = [sys.executable, str(HERE / "grpo_step.py"), "--devices", str(devices), "--mesh", json.dumps(mesh),
           "--steps", str(steps), "--no-bound"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads([line for line in out.splitlines() if line.strip()][-1])



def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 and 2 devices, 2 steps: a smoke run")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--devices", type=int, nargs="*", default=None, help="device counts (default 1 2 4 8)")
    ap.add_argument("--meshes", default=None, help="JSON list of meshes to run on --devices (default: all on fsdp)")
    args = ap.parse_args(argv)
    counts = args.devices or ([1, 2] if args.quick else [1, 2, 4, 8])
    steps = 2 if args.quick else args.steps
    meshes = json.loads(args.meshes) if args.meshes else [{"fsdp": -1}]
    runs = []
    for devices in counts:
        for mesh in meshes:
            r = run_one(devices, mesh, steps)
            runs.append({k: r[k] for k in ("devices", "mesh", "step_s_median", "floor_step_s", "overhead_ratio",
                                           "split", "compiles_after_warmup", "reward_first_last", "peak_rss_mb",
                                           "memory_plan_bytes")})
    base = runs[0]["step_s_median"]
    print(f"rlbolt GRPO step on CPU meshes ({cpu_model()}; the devices share the cores: overhead, not speedup)")
    print(f"  {'devices':>7}  {'mesh':<24} {'step s':>7} {'x 1 dev':>7} {'floor s':>7} {'rollout':>7} {'logps':>6} "
          f"{'update':>6} {'compiles':>8} {'params/dev':>10}  reward first/last")
    for r in runs:
        mesh = ",".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "one device"
        split = r["split"]
        print(f"  {r['devices']:>7}  {mesh:<24} {r['step_s_median']:>7.3f} {r['step_s_median'] / base:>7.2f} "
              f"{r['floor_step_s']:>7.3f} {split['rollout']:>7.3f} {split['logps']:>6.3f} {split['update']:>6.3f} "
              f"{r['compiles_after_warmup']:>8} {r['memory_plan_bytes']['params'] / 2**20:>8.2f}MB  "
              f"{r['reward_first_last'][0]:.4f} / {r['reward_first_last'][1]:.4f}")
    result = {"system": "rlbolt-mesh", "cpu_model": cpu_model(), "steps": steps, "runs": runs,
              "same_rewards": len({tuple(r["reward_first_last"]) for r in runs}) == 1}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
