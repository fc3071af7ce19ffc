"""What storing the layers stacked would buy in compile time: a toy update, per-layer vs stacked parameters.

rlbolt stores the decoder's layers one by one (`layers.{i}...`); `model.scan_layers` stacks them at
every forward, and the gradient comes back as one slice per layer and leaf, each with its own
optimizer ops. This toy (a gated-MLP-and-projection residual layer, width 256, float32, AdamW,
per-layer `jax.checkpoint`, 256 tokens) compiles the whole update (gradient + AdamW, donated) for this
CPU in four layouts:

    per-layer   parameters stored per layer, stacked inside the jit, one `lax.scan` (today's scan_layers)
    stacked     parameters stored with a leading layer axis, one `lax.scan` (no stack, ~5 optimizer leaves)
    looped      parameters stored per layer, a Python loop over the layers (today's default)
    grad-only   per-layer with the stack and scan, the gradient alone (no optimizer)

    python benchmarks/stacked_storage_compile.py --layers 2 8 28 64 --rounds 2

Prints one line per compile (round, layers, layout, seconds), then the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

H, I, T = 256, 704, 256
LAYOUTS = ("per-layer", "stacked", "looped", "grad-only")


def _layer(p: dict, x: jax.Array) -> jax.Array:
    return x + (jax.nn.silu(x @ p["wg"]) * (x @ p["wu"])) @ p["wd"] + (x @ p["wq"]) @ p["wo"]


def _params(layers: int, stacked: bool):
    one = {"wq": (H, H), "wo": (H, H), "wg": (H, I), "wu": (H, I), "wd": (I, H)}
    if stacked:
        return {k: jax.ShapeDtypeStruct((layers, *s), jnp.float32) for k, s in one.items()}
    return [{k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in one.items()} for _ in range(layers)]


def compile_seconds(layers: int, layout: str) -> float:
    """Lowers and compiles the toy update for `layers` layers in `layout`; returns the wall seconds."""
    params = _params(layers, layout == "stacked")
    optimizer = optax.adamw(1e-3)
    state = jax.eval_shape(optimizer.init, params)

    def loss(params, x):
        if layout == "looped":
            for p in params:
                x = jax.checkpoint(_layer)(p, x)
        else:
            stack = params if layout == "stacked" else jax.tree.map(lambda *a: jnp.stack(a), *params)
            x, _ = jax.lax.scan(jax.checkpoint(lambda x, p: (_layer(p, x), None)), x, stack)
        return jnp.sum(x * x)

    def update(params, state, x):
        grads = jax.grad(loss)(params, x)
        if layout == "grad-only":
            return grads
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    started = time.perf_counter()
    jax.jit(update, donate_argnums=(0, 1)).lower(params, state, jax.ShapeDtypeStruct((T, H), jnp.float32)).compile()
    return time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 28, 64])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    from machine import cpu_model

    print(f"# {cpu_model()}; toy update compile seconds (lower + compile) for this CPU", flush=True)
    times: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):  # interleaved: a load change hits every layout alike
        for layers in args.layers:
            for layout in LAYOUTS:
                seconds = compile_seconds(layers, layout)
                times.setdefault((layers, layout), []).append(seconds)
                print(r, layers, layout, f"{seconds:.2f}", flush=True)
    print("layers " + " ".join(f"{name:>10}" for name in LAYOUTS))
    for layers in args.layers:
        print(f"{layers:>6} " + " ".join(f"{statistics.median(times[(layers, n)]):>10.2f}" for n in LAYOUTS))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
