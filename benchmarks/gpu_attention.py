"""XLA against cuDNN attention, forward + backward, at a Qwen2.5-0.5B layer's shape (model.attention).

One attention layer's core (14 query heads, 2 key/value heads, head_dim 64, bfloat16), two rows
of T tokens (row 0 all real, row 1 left-padded by T/8: the rotation of `cudnn_attention` runs),
T = 1k, 4k, 8k, 16k. "xla" is rlbolt's XLA path (causal query chunks of `attend`, what
model.attention=xla runs); "cudnn" is `rlbolt.models.attention_kernels.fused_attention`. Each
row: the median of --runs timed calls of the jitted value-and-gradient after one warm-up, XLA's
compiled temp memory, and the largest |cudnn - xla| of the outputs at real tokens against a bound
derived for two bfloat16 evaluations (below). Prints a markdown table, then one JSON line per row.

The bound: both paths read the same bfloat16 q, k, v and accumulate products in float32. XLA's
path rounds the scores to bfloat16 (the einsum's output dtype) before the float32 softmax: each
logit moves by at most EPS_BF16 / 2 * max|s|, which moves each softmax weight by a relative
factor of at most 2 * that (softmax is 2-Lipschitz in the max norm of its log-weights). Both
round the weights to bfloat16 for the product with v (EPS_BF16 / 2 relative each) and the output
to bfloat16 (EPS_BF16 / 2 of max|v| each). So |cudnn - xla| <= max|v| * (EPS_BF16 * max|s| +
2 * EPS_BF16), max|s| measured in float32 (`max_abs_score`).

    PYTHONPATH=src python benchmarks/gpu_attention.py            # on a GPU: < 3 minutes on an H100
    PYTHONPATH=src python benchmarks/gpu_attention.py --dry-run  # CPU: tiny T, jax's XLA backend for "cudnn"

Imports only jax and rlbolt.models' attention modules (a bare GPU image may lack the packages
rlbolt's checkpoint I/O needs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SRC = Path(__file__).resolve().parents[1] / "src"
EPS_BF16 = 2.0 ** -7
SHAPE = dict(heads=14, kv_heads=2, head_dim=64)  # Qwen2.5-0.5B: hidden 896, 14 / 2 heads of 64
LENGTHS = (1024, 4096, 8192, 16384)
DRY_LENGTHS = (128, 256)


def _attention_modules():
    """rlbolt.models' attention modules; without the package's __init__ when its I/O dependencies are missing."""
    try:
        import rlbolt.models  # noqa: F401
    except ImportError:  # skip rlbolt.models.__init__ (Hugging Face I/O: safetensors)
        for name, sub in (("rlbolt", SRC / "rlbolt"), ("rlbolt.models", SRC / "rlbolt" / "models")):
            if name not in sys.modules or name == "rlbolt.models":
                module = types.ModuleType(name)
                module.__path__ = [str(sub)]
                sys.modules[name] = module
    from rlbolt.models import attention, attention_chunks, attention_kernels
    return attention, attention_chunks, attention_kernels


def max_abs_score(q: jax.Array, k: jax.Array, scale: float) -> float:
    """max |scale * q_i . k_j| over rows, heads (query head h reads key head h // G) and all i, j, in
    float32, 256 query rows at a time (never the whole [T, T] at once)."""
    b, t, n_heads, d = q.shape
    group = n_heads // k.shape[2]
    kk = jnp.repeat(k.astype(jnp.float32), group, axis=2)  # [B, T, nH, D]
    rows = q.astype(jnp.float32).reshape(b, -1, min(256, t), n_heads, d).transpose(1, 0, 2, 3, 4)

    def all_max(rows, kk):
        return jax.lax.map(lambda q_rows: jnp.abs(jnp.einsum("bqhd,bkhd->bhqk", q_rows, kk)).max(), rows).max()

    return scale * float(jax.jit(all_max)(rows, kk))


def bf16_bound(max_score: float, v_max: float) -> float:
    """The module docstring's bound on |cudnn - xla|: max|v| * (EPS_BF16 * max|s| + 2 * EPS_BF16).

    Args:
      max_score: max |s| of the scaled scores (`max_abs_score`).
      v_max: max |v|.
    """
    return v_max * (EPS_BF16 * max_score + 2 * EPS_BF16)


def _inputs(t: int, seed: int = 0):
    b, d = 2, SHAPE["head_dim"]
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, SHAPE["heads"], d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (b, t, SHAPE["kv_heads"], d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (b, t, SHAPE["kv_heads"], d), jnp.bfloat16)
    cotangent = jax.random.normal(keys[3], (b, t, SHAPE["heads"] * d), jnp.bfloat16)
    real = jnp.arange(t)[None] >= jnp.asarray([0, t // 8])[:, None]
    return q, k, v, cotangent, real


def _paths(implementation: str):
    attention, attention_chunks, kernels = _attention_modules()
    scale = SHAPE["head_dim"] ** -0.5

    def xla(q, k, v, real):
        t = q.shape[1]
        visible = jnp.tril(jnp.ones((t, t), bool))[None] & real[:, None, :]
        return attention_chunks.causal_query_chunks(
            lambda *a: attention.attend(*a, scale=scale), q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3),
            visible, attention_chunks.DEFAULT_QUERY_CHUNK)

    def cudnn(q, k, v, real):
        call = kernels.KernelCall("cudnn", real.astype(jnp.int32))
        return kernels.fused_attention(call, q, k, v, scale=scale, implementation=implementation)

    return {"xla": xla, "cudnn": cudnn}, scale


def _value_and_grad(fn):
    def loss(q, k, v, cotangent, real):
        out = fn(q, k, v, real)
        return jnp.sum((out * cotangent).astype(jnp.float32), where=real[..., None]), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def measure(t: int, runs: int, implementation: str) -> list[dict]:
    """Rows of the table for length t: one per path, the cudnn row with its check against xla."""
    paths, scale = _paths(implementation)
    q, k, v, cotangent, real = _inputs(t)
    rows, outputs = [], {}
    for name, fn in paths.items():
        step = _value_and_grad(fn)
        compiled = step.lower(q, k, v, cotangent, real).compile()
        memory = compiled.memory_analysis()
        temp_mb = None if memory is None else memory.temp_size_in_bytes / 2 ** 20
        (_, out), _ = jax.block_until_ready(compiled(q, k, v, cotangent, real))  # warm-up
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, cotangent, real))
            times.append(time.perf_counter() - start)
        outputs[name] = np.asarray(out.astype(jnp.float32))[np.asarray(real)]
        rows.append({"path": name, "tokens": t, "rows": int(q.shape[0]), "ms_median": 1e3 * statistics.median(times),
                     "ms_all": [round(1e3 * s, 3) for s in times], "temp_mb": temp_mb,
                     "device": jax.devices()[0].device_kind,
                     "implementation": implementation if name == "cudnn" else "xla"})
    bound = bf16_bound(max_abs_score(q, k, scale), float(jnp.abs(v.astype(jnp.float32)).max()))
    diff = float(np.abs(outputs["cudnn"] - outputs["xla"]).max())
    rows[-1].update(max_abs_diff=diff, bound=bound, within_bound=diff <= bound,
                    speedup=rows[0]["ms_median"] / rows[-1]["ms_median"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny lengths, jax's XLA backend for the cudnn column (CPU)")
    parser.add_argument("--quick", action="store_true", help="as --dry-run (the benchmarks' test convention)")
    parser.add_argument("--runs", type=int, default=5, help="timed calls per row (median reported)")
    parser.add_argument("--lengths", type=int, nargs="*", help="override the sequence lengths")
    args = parser.parse_args(argv)
    dry = args.dry_run or args.quick
    implementation = "xla" if dry else "cudnn"
    lengths = args.lengths or (DRY_LENGTHS if dry else LENGTHS)
    rows = [row for t in lengths for row in measure(t, 2 if dry else args.runs, implementation)]
    print(f"attention fwd+bwd, {SHAPE}, bf16, 2 rows, device {jax.devices()[0].device_kind}\n")
    print("| T | path | median ms | XLA temp MB | max abs diff | bound | speedup |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        temp = "n/a" if row["temp_mb"] is None else f"{row['temp_mb']:.0f}"
        extra = (f"{row['max_abs_diff']:.2e} | {row['bound']:.2e} | {row['speedup']:.2f}x" if "bound" in row
                 else " | | ")
        print(f"| {row['tokens']} | {row['path']} | {row['ms_median']:.2f} | {temp} | {extra} |")
    print()
    for row in rows:
        print(json.dumps(row))
    return 0 if all(row.get("within_bound", True) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
