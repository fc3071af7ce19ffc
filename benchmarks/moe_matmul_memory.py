"""What one MoE layer's expert matmuls ask of a TPU chip, by grouped-matmul kernel (`model.moe_matmul`).

Compiles the forward and backward of one MoE feed-forward's experts (`rlbolt.models.moe`: sort the
(token, expert) pairs, two grouped matmuls, the weighted scatter back; gradients for the tokens and
both expert kernels) at Qwen3-30B-A3B's widths (128 experts, top 8, hidden 2048, expert MLP 768,
bf16) for a described TPU slice with libtpu's compiler on this CPU, and prints the compiler's
temporaries per chip (`memory_analysis`, an estimate of the compiler, nothing runs on a TPU):

    ragged_dot / xla    today's path without an expert axis: XLA partitions the sort and ragged_dot
    ragged_dot / shard  ragged_dot under the shard_map of expert parallelism (each chip its own rows)
    gmm / shard         Pallas megablox gmm under the same shard_map (model.moe_matmul: gmm)

    python benchmarks/moe_matmul_memory.py --topology v5p:2x2x2 --tokens 4096 [--expert 1] [--modes ...]

Tokens are per chip (one sequence of that length per chip). With XLA_FLAGS=--xla_dump_to=DIR
--xla_dump_hlo_as_text the buffer assignment of each compile lands in DIR (*buffer-assignment.txt).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

GIB = 1 << 30
MODES = ("ragged_dot/xla", "ragged_dot/shard", "gmm/shard")


def compile_mode(mode: str, topology: str, tokens: int, expert: int, experts: int = 128, top_k: int = 8,
                 hidden: int = 2048, inter: int = 768) -> dict:
    """Compiles one mode's forward + backward for `topology`; returns its memory figures (bytes per chip)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rlbolt.distributed.mesh import BATCH_AXES
    from rlbolt.distributed.topology import target_devices
    from rlbolt.models.moe import expert_parallel_experts, grouped_experts

    devices = target_devices(topology)
    n_dev = len(devices)
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, n_dev // expert, expert, 1, 1),
                             ("data", "fsdp", "expert", "context", "tp"))
    n = tokens * n_dev
    kernel, how = mode.split("/")
    rows = NamedSharding(mesh, P(BATCH_AXES))
    args = (jax.ShapeDtypeStruct((n, hidden), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((n, top_k), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((n, top_k), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((experts, hidden, 2 * inter), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P("expert", "fsdp", None))),
            jax.ShapeDtypeStruct((experts, inter, hidden), jnp.bfloat16,
                                 sharding=NamedSharding(mesh, P("expert", None, "fsdp"))),
            jax.ShapeDtypeStruct((n, hidden), jnp.bfloat16, sharding=rows))
    if how == "xla":
        experts_fn = functools.partial(grouped_experts, hidden_act="silu", kernel=kernel)
    else:
        experts_fn = functools.partial(expert_parallel_experts, hidden_act="silu", mesh=mesh, kernel=kernel)

    def loss(x, chosen, w, gate_up, down, cotangent):
        y = experts_fn(x, chosen, w, gate_up, down)
        return jnp.sum(y.astype(jnp.float32) * cotangent.astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 3, 4)))
    started = time.perf_counter()
    compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    return {"mode": mode, "topology": topology, "tokens_per_chip": tokens, "expert": expert,
            "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes,
            "output_bytes": mem.output_size_in_bytes, "compile_seconds": time.perf_counter() - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topology", default="v5p:2x2x2")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per chip")
    parser.add_argument("--expert", type=int, default=1, help="mesh.expert (the rest of the chips: fsdp)")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(f"{'mode':<18}{'slice':<11}{'tokens/chip':>12}{'expert':>7}{'args GiB':>9}{'temps GiB':>10}{'compile s':>10}")
    for mode in args.modes.split(","):
        try:
            r = compile_mode(mode, args.topology, args.tokens, args.expert)
        except Exception as err:  # noqa: BLE001  (a compiler refusal is a result: print it and go on)
            print(f"{mode:<18}{args.topology:<11}{args.tokens:>12}{args.expert:>7}  refused: "
                  f"{str(err).splitlines()[0][:300]}", flush=True)
            continue
        print(f"{mode:<18}{args.topology:<11}{args.tokens:>12}{args.expert:>7}{r['argument_bytes'] / GIB:>9.2f}"
              f"{r['temp_bytes'] / GIB:>10.2f}{r['compile_seconds']:>10.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
