"""The matrix products of one decode step, alone: XLA as rlbolt's decode runs them, against vLLM's
CPU kernels on the same shapes.

A decode step at SmolLM2-135M's shapes (30 layers, width 576, 9 / 3 heads of 64, SwiGLU 1536,
vocabulary 49,152, tied) multiplies 32 rows (8 prompts x G=4) by every weight: q|k|v, o_proj,
gate|up and down per layer, then the tied lm_head. Those products are ~85% of the native decode
step, so their speed decides the rollout against vLLM. Timed here, each for all 30 layers (the
weights streamed from memory as in the loop; medians of interleaved rounds, ms per decode step):

- `xla`: `x @ W` in one jit with the decode's compiler options (YNNPACK dots), as
  `rlbolt.rollout.decode` runs them; the lm_head both ways: `x @ table^T` ([B, V]) and
  `table @ x^T` ([V, B], what `Decoder.next_token_logits` does with tied embeddings);
- `xla_weights_left`: the layer products with the weights as the left operand (`W^T @ x^T`,
  which needs the kernels stored [out, in]; a lever not taken, measured);
- `torch`: `torch.nn.functional.linear` (vLLM's fallback), and `vllm_onednn`: vLLM's prepacked
  oneDNN kernels (`create_onednn_mm` / `onednn_mm`, what its CPU worker uses for these layers);
  both only where vLLM imports (its own venv, docs/howto/engines.md).

Prints a table and one JSON line. `--quick`: 2 layers, fewer rounds (the figures mean little).

    .venv-vllm/bin/python benchmarks/decode_products.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

ROWS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 576, 9, 3, 64, 1536, 49152
# name: (in, out) of one layer's product
LAYER = {"qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, HIDDEN),
         "gate_up": (HIDDEN, 2 * FFN), "down": (FFN, HIDDEN)}


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def xla_timers(weights, table, x_in):
    from rlbolt.utils.xla_flags import configure_xla_flags, decode_compiler_options

    configure_xla_flags()
    import jax
    import jax.numpy as jnp

    opts = decode_compiler_options() or None

    def per_layer(product):
        # One product per layer in a scan: each layer's weights are read once per step, like the loop.
        return jax.jit(lambda x, w: jax.lax.scan(lambda c, wl: (c, product(c, wl)), x, w)[1], compiler_options=opts)

    timers = {}
    for name, stack in weights.items():
        w = jnp.asarray(stack)  # [L, in, out]
        w_left = jnp.asarray(np.ascontiguousarray(np.swapaxes(stack, 1, 2)))  # [L, out, in]
        x = jnp.asarray(x_in[name])
        right, left = per_layer(lambda c, wl: c @ wl), per_layer(lambda c, wl: wl @ c)
        timers[("xla", name)] = lambda f=right, x=x, w=w: jax.block_until_ready(f(x, w))
        timers[("xla_weights_left", name)] = lambda f=left, x=x.T + 0, w=w_left: jax.block_until_ready(f(x, w))
    e, h = jnp.asarray(table), jnp.asarray(x_in["qkv"])
    rows_first = jax.jit(lambda h, e: h @ e.T, compiler_options=opts)
    vocab_first = jax.jit(lambda h, e: jax.lax.dot_general(e, h, (((1,), (1,)), ((), ()))), compiler_options=opts)
    timers[("xla", "lm_head [B, V]")] = lambda: jax.block_until_ready(rows_first(h, e))
    timers[("xla", "lm_head [V, B]")] = lambda: jax.block_until_ready(vocab_first(h, e))
    return timers, jax.__version__


def torch_timers(weights, table, x_in, threads: int):
    import torch

    torch.set_num_threads(threads)
    timers = {}
    onednn = None
    try:
        from vllm import _custom_ops as ops

        if getattr(ops, "_supports_onednn", False):
            onednn = ops
    except ImportError:
        pass
    with torch.no_grad():
        for name, stack in weights.items():
            ws = [torch.from_numpy(np.ascontiguousarray(w.T)) for w in stack]  # nn.Linear's [out, in]
            x = torch.from_numpy(x_in[name])
            timers[("torch", name)] = lambda ws=ws, x=x: [torch.nn.functional.linear(x, w) for w in ws]
            if onednn is not None:
                handles = [onednn.create_onednn_mm(w.t(), ROWS) for w in ws]
                timers[("vllm_onednn", name)] = lambda hs=handles, x=x: [onednn.onednn_mm(h, x, None) for h in hs]
        e, h = torch.from_numpy(table), torch.from_numpy(x_in["qkv"])
        timers[("torch", "lm_head [B, V]")] = lambda: torch.nn.functional.linear(h, e)
        if onednn is not None:
            handle = onednn.create_onednn_mm(e.t(), ROWS)
            timers[("vllm_onednn", "lm_head [B, V]")] = lambda: onednn.onednn_mm(handle, h, None)
    return timers, torch.__version__, onednn is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 1 round of 3 calls")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each a median of 7 calls)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    layers, rounds, reps = (2, 1, 3) if args.quick else (30, args.rounds, 7)
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal((layers, i, o), dtype=np.float32) * 0.02 for n, (i, o) in LAYER.items()}
    table = rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32) * 0.02
    x_in = {n: rng.standard_normal((ROWS, i), dtype=np.float32) for n, (i, _) in LAYER.items()}

    timers, jax_version = xla_timers(weights, table, x_in)
    torch_version, has_onednn = None, False
    if importlib.util.find_spec("torch") is not None:
        more, torch_version, has_onednn = torch_timers(weights, table, x_in, args.threads)
        timers.update(more)
    samples = {key: [] for key in timers}
    for _ in range(rounds):
        for key, fn in timers.items():
            samples[key].append(median_ms(fn, reps))
    ms = {key: statistics.median(v) for key, v in samples.items()}

    products = [*LAYER, "lm_head [B, V]", "lm_head [V, B]"]
    kinds = [k for k in ("xla", "xla_weights_left", "torch", "vllm_onednn") if any(key[0] == k for key in ms)]
    print(f"decode-step products, {ROWS} rows, SmolLM2-135M shapes, {layers} layers; ms per step "
          f"(median of {rounds} round(s)); CPU {cpu_model()}")
    print(f"  {'product':16}" + "".join(f"{k:>18}" for k in kinds))
    for p in products:
        print(f"  {p:16}" + "".join(f"{ms[(k, p)]:18.2f}" if (k, p) in ms else f"{'-':>18}" for k in kinds))

    def total(kind: str, head: str) -> float | None:
        keys = [(kind, p) for p in LAYER] + [(kind if (kind, head) in ms else "xla", head)]
        return round(sum(ms[k] for k in keys), 2) if all(k in ms for k in keys) else None

    totals = {"xla": total("xla", "lm_head [V, B]"), "xla_lm_head_rows_first": total("xla", "lm_head [B, V]"),
              "xla_weights_left": total("xla_weights_left", "lm_head [V, B]"),
              "torch": total("torch", "lm_head [B, V]"), "vllm_onednn": total("vllm_onednn", "lm_head [B, V]")}
    print("  total ms per step: " + ", ".join(f"{k} {v}" for k, v in totals.items() if v is not None))
    print(json.dumps({"system": "rlbolt-decode-products", "cpu_model": cpu_model(), "cpus": os.cpu_count(),
                      "rows": ROWS, "layers": layers, "rounds": rounds, "quick": args.quick,
                      "ms_per_step": {f"{k}/{p}": round(v, 3) for (k, p), v in ms.items()},
                      "total_ms_per_step": totals, "vllm_onednn": has_onednn, "jax": jax_version,
                      "torch": torch_version}))


if __name__ == "__main__":
    main()
