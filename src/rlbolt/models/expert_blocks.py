"""The experts' SwiGLU with their kernels gathered, and differentiated, a block of the intermediate dim at a
time, inside the experts' shard_map (`model.expert_block_size`; `rlbolt.models.moe.expert_parallel_experts`).

With the experts' kernels split over fsdp, each MoE layer gathered all E experts' whole gate|up [E, H, 2I]
and down [E, I, H] kernels, and its backward formed their whole gradients before the reduce-scatter: at
Qwen3-30B-A3B on v5p:4x4x4 about six 768 MiB gate|up and four 384 MiB down buffers were live at the update's
peak (benchmarks/RESULTS.md). Every expert's MLP is a sum over its intermediate units, so over k blocks of
b = I / k units

    experts(rows) = sum_j grouped(act(grouped(rows, gate_up[:, :, block j])), down[:, block j, :])

The forward gathers block j's kernels, adds its share (float32) and moves on; the backward (a custom vjp)
regathers block j, recomputes its intermediates and forms its kernels' gradients, which the gather's
transpose reduce-scatters into the stored shards before the next block. One block of the kernels and of
their gradients exists per chip at a time, and the [rows, 2b] intermediates are k times smaller. The
gathers move the same bytes as the whole kernels' (one per pass). Same values to float32 rounding.
This is `rlbolt.models.mlp_blocks`' split, for grouped matmuls inside a shard_map.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from rlbolt.models.moe_matmul import grouped_matmul


def experts_in_blocks(rows: jax.Array, sizes: jax.Array, gate_up: jax.Array, down: jax.Array, *, blocks: int,
                      specs: tuple[P, P], kernel: str) -> jax.Array:
    """`down(silu(gate) * up)` of each group's rows, the kernels gathered `blocks` blocks of I at a time.

    Inside a shard_map manual over the axes `specs` name.

    Args:
      rows: [M, H] rows sorted by expert (`sizes[e]` consecutive rows each, then rows of no group).
      sizes: [E] int32 rows per expert.
      gate_up: [E, h, 2I] this device's shard of the fused gate|up kernels (gate's I columns, then up's).
      down: [E, I, h'] this device's shard of the down kernels.
      blocks: k, dividing I.
      specs: gate_up's and down's in_specs at the shard_map's edge (`P("expert", hidden axes, None)`,
        `P("expert", None, hidden axes)`): each block is all-gathered over those axes.
      kernel: the grouped matmul (`rlbolt.models.moe_matmul.KERNELS`).

    Returns:
      [M, H] in rows' dtype.
    """
    return _blocked(blocks, tuple(specs), kernel)(rows, sizes, gate_up, down)


def gathered(kernel: jax.Array, spec: P) -> jax.Array:
    """The kernel's whole [E / X, ...] expert group inside the shard_map: all-gathered over its spec's axes
    past the expert axis (whose transpose is a reduce-scatter of the gradient)."""
    for dim, axes in enumerate(tuple(spec)[1:], start=1):
        if axes is not None:
            kernel = jax.lax.all_gather(kernel, axes, axis=dim, tiled=True)
    return kernel


def swiglu_experts(rows: jax.Array, sizes: jax.Array, gate_up: jax.Array, down: jax.Array, kernel: str) -> jax.Array:
    """`down(silu(gate) * up)` of each group's rows with whole kernels [E, H, 2I] and [E, I, H]: [M, H]."""
    gate, up = jnp.split(grouped_matmul(rows, gate_up, sizes, kernel), 2, axis=-1)
    return grouped_matmul(jax.nn.silu(gate) * up, down, sizes, kernel)


@functools.lru_cache(maxsize=None)
def _blocked(blocks: int, specs: tuple[P, P], kernel: str):
    def split(gate_up, down):
        """[k, E, h, 2b] gate|up blocks and [k, E, b, h'] down blocks, as the shards lie."""
        e, h, two_i = gate_up.shape
        b = two_i // 2 // blocks
        gus = gate_up.reshape(e, h, 2, blocks, b).transpose(3, 0, 1, 2, 4).reshape(blocks, e, h, 2 * b)
        return gus, down.reshape(e, blocks, b, down.shape[-1]).transpose(1, 0, 2, 3)

    def joined(gus, ds):
        """`split`'s inverse."""
        k, e, h, two_b = gus.shape
        gate_up = gus.reshape(k, e, h, 2, two_b // 2).transpose(1, 2, 3, 0, 4).reshape(e, h, k * two_b)
        return gate_up, ds.transpose(1, 0, 2, 3).reshape(e, -1, ds.shape[-1])

    def block_out(rows, sizes, gu, d):
        """One block's [M, H] share; its kernels gathered here (so a vjp reduce-scatters their gradients)."""
        return swiglu_experts(rows, sizes, gathered(gu, specs[0]), gathered(d, specs[1]), kernel)

    def forward(rows, sizes, gate_up, down):
        def one_block(total, weights):
            return total + block_out(rows, sizes, *weights).astype(jnp.float32), None

        total, _ = jax.lax.scan(one_block, jnp.zeros(rows.shape, jnp.float32), split(gate_up, down))
        return total.astype(rows.dtype)

    @jax.custom_vjp
    def run(rows, sizes, gate_up, down):
        return forward(rows, sizes, gate_up, down)

    def run_fwd(rows, sizes, gate_up, down):
        return forward(rows, sizes, gate_up, down), (rows, sizes, gate_up, down)

    def run_bwd(residuals, d_out):
        rows, sizes, gate_up, down = residuals
        d_out = d_out.astype(rows.dtype)

        def one_block(d_rows, weights):
            _, vjp = jax.vjp(lambda r, gu, d: block_out(r, sizes, gu, d), rows, *weights)
            d_r, d_gu, d_d = vjp(d_out)
            return d_rows + d_r.astype(jnp.float32), (d_gu, d_d)

        d_rows, (d_gus, d_ds) = jax.lax.scan(one_block, jnp.zeros(rows.shape, jnp.float32), split(gate_up, down))
        return d_rows.astype(rows.dtype), np.zeros(sizes.shape, jax.dtypes.float0), *joined(d_gus, d_ds)

    run.defvjp(run_fwd, run_bwd)
    return run


__all__ = ["experts_in_blocks", "gathered", "swiglu_experts"]
