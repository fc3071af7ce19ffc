"""Compiled memory per device of one training step against sequence length, for mesh.context 1/2/4/8.

The step is the loss + gradient of a small decoder (2 layers, hidden 256, 4/2 heads of 64, MLP
512, vocabulary 256, float32) over one sequence of T tokens (the mean next-token log-likelihood,
as the update's token log-probs reduce it), on a CPU mesh `{context: n}` of n of 8 host devices.
Context 1 is today's XLA path (causal attention in 128-row query chunks, whose kept scores grow
with T^2); context n > 1 runs ring attention (`rlbolt.models.context_attention`). The figure is
the compiled program's per-device memory (`jit(...).lower(...).compile().memory_analysis()`:
temp + arguments + outputs), so nothing runs and every point is given; `--run T` also executes
one step at length T with the largest context (wall time and its loss, to show it trains);
`--optimizer` makes that step a whole training step (loss, gradient and an AdamW update applied to
the parameters, one jitted program) and `--steps N` runs N of them (the loss of step 2 is the loss
after the first update).

    python benchmarks/context_memory.py                       # the table, lengths 1k..64k
    python benchmarks/context_memory.py --run 65536 --no-table   # one executed step at 64k, context 8
    python benchmarks/context_memory.py --run 65536 --no-table --optimizer --steps 2   # with AdamW updates
    python benchmarks/context_memory.py --quick               # tiny lengths (a smoke run)
    python benchmarks/context_memory.py --ab 8192 --no-table  # the ring's causal halving: time, whole vs half

Prints a Markdown table and one JSON line with every figure and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from rlbolt.distributed import MeshSpec, ShardingPlan  # noqa: E402
from rlbolt.models import Decoder, tiny_config  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
             intermediate_size=512)


def step_fn(context: int):
    """(jitted loss-and-gradient, params, batch placement) on a `{context: n}` mesh (n = 1: one device)."""
    model = Decoder(tiny_config(**SHAPE), rngs=nnx.Rngs(0))
    plan = ShardingPlan(MeshSpec(fsdp=1, context=context).build(jax.devices()[:context]))
    nnx.update(model, plan.place(nnx.state(model)))
    plan.shard_activations(model)
    graphdef, params = nnx.split(model)

    def loss(params, ids):
        positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
        logits, _ = nnx.merge(graphdef, params)(ids, positions)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    return jax.jit(jax.value_and_grad(loss)), params, plan


def compiled_bytes(context: int, length: int) -> dict:
    step, params, plan = step_fn(context)
    ids = jax.ShapeDtypeStruct((1, length), jnp.int32, sharding=plan.replicated)
    analysis = step.lower(params, ids).compile().memory_analysis()
    return {"temp": int(analysis.temp_size_in_bytes), "args": int(analysis.argument_size_in_bytes),
            "out": int(analysis.output_size_in_bytes)}


def run_once(context: int, length: int) -> dict:
    step, params, plan = step_fn(context)
    ids = jax.device_put(np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (1, length), np.int32),
                         plan.replicated)
    start = time.perf_counter()
    value, grads = step(params, ids)
    jax.block_until_ready(grads)
    return {"context": context, "length": length, "seconds": round(time.perf_counter() - start, 1),
            "loss": float(value), "grads_finite": bool(all(np.isfinite(np.asarray(g)).all()
                                                           for g in jax.tree.leaves(grads)))}


def train_steps(context: int, length: int, steps: int, lr: float = 1e-3) -> dict:
    """`steps` whole training steps (loss, gradient, AdamW update applied) on one sequence of `length`."""
    import optax

    grad_step, params, plan = step_fn(context)
    optimizer = optax.adamw(lr)

    @jax.jit
    def train_step(params, opt_state, ids):
        value, grads = grad_step(params, ids)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    ids = jax.device_put(np.random.default_rng(0).integers(0, SHAPE["vocab_size"], (1, length), np.int32),
                         plan.replicated)
    first = params
    opt_state = optimizer.init(params)
    losses, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        value, params, opt_state = train_step(params, opt_state, ids)
        jax.block_until_ready(params)
        losses.append(float(value))
        seconds.append(round(time.perf_counter() - start, 1))
    moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
                for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(params)))
    return {"context": context, "length": length, "optimizer": f"adamw({lr})", "seconds": seconds, "losses": losses,
            "max_param_change": moved,
            "params_finite": bool(all(np.isfinite(np.asarray(p)).all() for p in jax.tree.leaves(params)))}


def halving_ab(length: int, context: int, rounds: int) -> dict:
    """Ring attention's forward + backward alone at `length` tokens on `{context: n}`: every block whole
    (`balanced=False`) against only the visible half of each later step (`balanced=True`), the two
    taking turns for `rounds` rounds; medians of wall seconds."""
    from rlbolt.models.context_attention import balanced_order, ring_attention

    mesh = MeshSpec(fsdp=1, context=context).build(jax.devices()[:context])
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, length, 4, 64))
    k, v = (jax.random.normal(key, (1, length, 2, 64)) for key in keys[1:])
    segments, slots = jnp.ones((1, length), jnp.int32), jnp.asarray(balanced_order(length, context))

    def make(balanced):
        def loss(q, k, v):
            return jnp.sum(ring_attention(q, k, v, segments, slots, mesh=mesh, scale=0.125, balanced=balanced))
        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        jax.block_until_ready(step(q, k, v))  # compiled outside the timing
        return step

    steps = {name: make(name == "half") for name in ("whole", "half")}
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(q, k, v))
            times[name].append(time.perf_counter() - start)
    medians = {name: float(np.median(t)) for name, t in times.items()}
    return {"length": length, "context": context, "rounds": rounds, **{f"{n}_s": round(t, 2) for n, t in medians.items()},
            "speedup": round(medians["whole"] / medians["half"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="lengths 64 and 128 only")
    parser.add_argument("--run", type=int, default=0, help="also execute one step at this length (largest context)")
    parser.add_argument("--max-context1", type=int, default=16384, help="longest length compiled with context 1")
    parser.add_argument("--no-table", action="store_true", help="only the executed step (--run)")
    parser.add_argument("--optimizer", action="store_true", help="--run: whole training steps (AdamW applied)")
    parser.add_argument("--steps", type=int, default=1, help="--run --optimizer: how many steps")
    parser.add_argument("--ab", type=int, default=0, help="time the ring's causal halving at this length (context 4)")
    args = parser.parse_args()
    lengths = () if args.no_table else (64, 128) if args.quick else (1024, 4096, 16384, 32768, 65536)
    contexts = (1, 2, 4, 8)
    rows = []
    for length in lengths:
        for context in contexts:
            if context == 1 and length > args.max_context1:
                continue  # its T^2 scores: 64k would ask for hundreds of GB to compile a plan for
            mem = compiled_bytes(context, length)
            rows.append({"length": length, "context": context, **mem,
                         "per_device_mib": round((mem["temp"] + mem["args"] + mem["out"]) / 2**20, 1)})
            print(f"T={length} context={context}: {rows[-1]['per_device_mib']} MiB", file=sys.stderr, flush=True)
    print("| tokens | " + " | ".join(f"context {c}" for c in contexts) + " |")
    print("|---|" + "---|" * len(contexts))
    for length in lengths:
        cells = {r["context"]: f"{r['per_device_mib']:,} MiB" for r in rows if r["length"] == length}
        print(f"| {length:,} | " + " | ".join(cells.get(c, "-") for c in contexts) + " |")
    if args.run and args.optimizer:
        executed = train_steps(max(contexts), args.run, args.steps)
    else:
        executed = run_once(max(contexts), args.run) if args.run else None
    if executed:
        print(f"executed: {executed}")
    halving = halving_ab(args.ab, 4, 3) if args.ab else None
    if halving:
        print(f"halving: {halving}")
    print(json.dumps({"cpu": cpu_model(), "shape": SHAPE, "rows": rows, "executed": executed, "halving": halving}))


if __name__ == "__main__":
    main()
