"""What the checkpoint checksums cost next to the save they protect.

For a float32 parameter pytree of `--mb` MB (layers of 1024 x 1024 matrices) with Adam's state
(3x the parameter bytes in all, what a checkpoint holds), measured on this machine:

- `checksum_s`: every array's checksum and finiteness with the method this backend uses (on
  the CPU: XXH3 of the bytes in place; on an accelerator: the jitted `sum64` pass), what
  `CheckpointIO.save` adds before Orbax starts and a restore adds after reading, median;
- `checksum_first_s`: the same, first call (compilation included for `sum64`);
- `sum64_s`: the accelerator method (`sum64`) forced, on this backend, median;
- `save_blocking_s`: `CheckpointIO.save` until it returns (device-to-host copy + checksums +
  Orbax's synchronous part), median; `save_total_s`: until the write is on disk, median;
- `restore_s`: `CheckpointIO.restore` of the step (read + checksum verification), median.

    python benchmarks/checkpoint_integrity.py            # 256 MB of parameters, 5 saves
    python benchmarks/checkpoint_integrity.py --quick    # 4 MB, 2 saves (CI keeps it from rotting)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402



def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="parameter megabytes (float32)")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    mb, saves = (4, 2) if args.quick else (args.mb, args.saves)

    import jax
    import jax.numpy as jnp
    import optax

    from rlbolt.checkpointing.integrity import checksums, named_leaves
    from rlbolt.checkpointing.io import CheckpointIO

    layers = max(1, mb // 4)  # a 1024 x 1024 float32 matrix is 4 MB
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    params = {f"layer_{i}": jax.random.normal(k, (1024, 1024), jnp.float32) for i, k in enumerate(keys)}
    tx = optax.adam(1e-3)
    arrays = {"params": params, "opt_state": tx.init(params), "rng": jax.random.PRNGKey(1)}
    jax.block_until_ready(arrays)
    named = named_leaves(arrays)

    start = time.perf_counter()
    checksums(named)
    first = time.perf_counter() - start
    times, sum64 = [], []
    forced = dict.fromkeys(named, "sum64")
    checksums(named, forced)  # compile
    for _ in range(max(3, saves)):
        start = time.perf_counter()
        checksums(named)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        checksums(named, forced)
        sum64.append(time.perf_counter() - start)

    blocking, total, restores = [], [], []
    with tempfile.TemporaryDirectory() as folder:
        io = CheckpointIO(Path(folder) / "checkpoints", async_save=True)
        for step in range(1, saves + 1):
            start = time.perf_counter()
            io.save(step, arrays, {"step": step})
            blocking.append(time.perf_counter() - start)
            io.wait()
            total.append(time.perf_counter() - start)
            start = time.perf_counter()
            io.restore(step, arrays, params)
            restores.append(time.perf_counter() - start)
        io.close()

    total_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(arrays)) / 2**20
    result = {"system": "rlbolt-checkpoint-integrity", "cpu": cpu_model(), "backend": jax.default_backend(),
              "param_mb": mb, "checkpoint_mb": round(total_mb, 1), "arrays": len(named), "saves": saves,
              "checksum_s": statistics.median(times), "checksum_first_s": first, "sum64_s": statistics.median(sum64),
              "save_blocking_s": statistics.median(blocking), "save_total_s": statistics.median(total),
              "restore_s": statistics.median(restores)}
    result["checksum_share_of_save"] = result["checksum_s"] / result["save_total_s"]
    result["checksum_gb_per_s"] = total_mb / 1024 / result["checksum_s"]

    print(f"checkpoint checksums, {total_mb:.0f} MB in {len(named)} arrays, {jax.default_backend()} ({result['cpu']})")
    print(f"{'what':<32}{'seconds':>10}")
    for key in ("checksum_s", "checksum_first_s", "sum64_s", "save_blocking_s", "save_total_s", "restore_s"):
        print(f"{key:<32}{result[key]:>10.3f}")
    print(f"checksum share of a save: {result['checksum_share_of_save']:.1%}, "
          f"{result['checksum_gb_per_s']:.2f} GB/s")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
