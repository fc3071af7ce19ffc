"""The dense MLP with its weights gathered and differentiated a block of the intermediate dim at a
time, for meshes whose fsdp axes split the weights' hidden dim (`model.mlp_block_size`).

Plain `down(act(x @ gate_up))` on such a mesh gathers each layer's whole gate|up [H, 2I] and down
[I, H] kernels, and its backward forms their whole gradients before the reduce-scatter: at
Qwen2.5-32B, eight 540 MiB copies of one layer's gate|up live at the update's peak
(benchmarks/RESULTS.md). The MLP is a sum over the intermediate units, so it splits exactly into
k blocks of b = I / k units:

    mlp(x) = sum_j down[j] . act(x @ [gate[:, j] | up[:, j]])

Here the forward gathers block j's kernels, adds its share (float32) and moves on; the backward
(a custom vjp) regathers block j, recomputes its intermediates and forms block j's weight
gradients, which are reduce-scattered into the stored shards before the next block. Per chip one
block of the weights and of their gradients exists at a time, and the [B, T, 2b] intermediates
are k times smaller; each block also runs `positions` positions of every row at a time
(`rlbolt.models.decoder_layer.over_position_chunks`' split), adding into one float32 [B, T, H]
accumulator in place per pass. The gathers move the same bytes as
the whole kernels' (one per pass). Same values to float32 rounding: the blocks' partial products
are summed in float32, then rounded once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class MlpSplit:
    """How a dense MLP over [B, T, H] is split (static, from the Decoder's settings).

    positions: positions of every row per piece (model.mlp_chunk_positions); None or 0: all.
    block: intermediate units per weight block (model.mlp_block_size); 0: whole kernels.
    weights: gate|up's stored sharding when a mesh's axes split its hidden dim and not its
      intermediate dim (`rlbolt.distributed.ShardingPlan.shard_activations`); None: no blocks.
    """

    positions: int | None = None
    block: int = 0
    weights: NamedSharding | None = None


def block_count(intermediate: int, block: int) -> int:
    """The number of blocks k the intermediate dim splits into: the fewest that divide it with at
    most `block` units each; 1 (no split) when block is 0, covers it whole, or when the divisor
    found gives blocks under a quarter of `block` (an intermediate size with no fitting divisor:
    narrow products would cost more than they save)."""
    if block <= 0 or intermediate <= block:
        return 1
    k = next(k for k in range(-(-intermediate // block), intermediate + 1) if intermediate % k == 0)
    return k if 4 * (intermediate // k) >= block else 1


def mlp_in_blocks(x: jax.Array, gate_up: jax.Array, down: jax.Array, *, activate: Callable[[jax.Array], jax.Array],
                  blocks: int, positions: int | None, sharding: NamedSharding | None) -> jax.Array:
    """`down(activate(x @ gate_up))` with the kernels used `blocks` blocks of the intermediate dim at a time.

    Args:
      x: [B, T, H] the normed residual stream.
      gate_up: [H, 2I] fused gate|up kernel (gate's I columns, then up's).
      down: [I, H] kernel.
      activate: [..., 2b] gate|up of one block -> [..., b] (the MLP's activation; its own vjp is used).
      blocks: k, dividing I.
      positions: positions of every row per piece inside a block; None or 0: all at once.
      sharding: gate_up's stored sharding, P(hidden axes, None) (down's is its transpose); each block
        is gathered whole from it and its gradients are constrained back into it. None: no mesh.

    Returns:
      [B, T, H] in x's dtype.
    """
    return _blocked(activate, blocks, positions or 0, sharding)(x, gate_up, down)


@functools.lru_cache(maxsize=None)
def _blocked(activate, blocks: int, positions: int, sharding: NamedSharding | None):
    def place(value, spec):
        return value if sharding is None else jax.lax.with_sharding_constraint(value, NamedSharding(sharding.mesh, spec))

    hidden = None if sharding is None else tuple(sharding.spec)[0]

    def split(gate_up, down):
        """[k, H, 2b] gate|up blocks and [k, b, H] down blocks, hidden dim as stored."""
        h, two_i = gate_up.shape
        b = two_i // 2 // blocks
        gu = gate_up.reshape(h, 2, blocks, b).transpose(2, 0, 1, 3).reshape(blocks, h, 2 * b)
        return place(gu, P(None, hidden, None)), place(down.reshape(blocks, b, h), P(None, None, hidden))

    def joined(gus, ds):
        """`split`'s inverse: [k, H, 2b] and [k, b, H] blocks -> [H, 2I] and [I, H], in the stored shards."""
        k, h, two_b = gus.shape
        gate_up = gus.reshape(k, h, 2, two_b // 2).transpose(1, 2, 0, 3).reshape(h, k * two_b)
        return place(gate_up, P(hidden, None)), place(ds.reshape(-1, h), P(None, hidden))

    def gathered(gu, d):
        return place(gu, P()), place(d, P())

    def padded(x):
        """x [B, T, ...] zero padded to n pieces of c positions: (x [B, n c, ...], n, c)."""
        t = x.shape[1]
        c = positions if 0 < positions < t else t
        n = -(-t // c)
        return jnp.pad(x, ((0, 0), (0, n * c - t)) + ((0, 0),) * (x.ndim - 2)), n, c

    def piece(a, j, c):
        return jax.lax.dynamic_slice_in_dim(a, j * c, c, axis=1)

    def add_piece(total, j, c, value):
        """total [B, n c, H] with value added to piece j, in place (one float32 accumulator per pass)."""
        return jax.lax.dynamic_update_slice_in_dim(total, piece(total, j, c) + value, j * c, axis=1)

    def forward(x, gate_up, down):
        xp, n, c = padded(x)

        def one_block(total, weights):
            gu, d = gathered(*weights)

            def one_piece(j, total):
                y = jnp.dot(activate(jnp.dot(piece(xp, j, c), gu)), d, preferred_element_type=jnp.float32)
                return add_piece(total, j, c, y)

            return jax.lax.fori_loop(0, n, one_piece, total), None

        total, _ = jax.lax.scan(one_block, jnp.zeros(xp.shape, jnp.float32), split(gate_up, down))
        return total[:, :x.shape[1]].astype(x.dtype)

    @jax.custom_vjp
    def run(x, gate_up, down):
        return forward(x, gate_up, down)

    def run_fwd(x, gate_up, down):
        return forward(x, gate_up, down), (x, gate_up, down)

    def run_bwd(residuals, d_out):
        x, gate_up, down = residuals
        (xp, n, c), (d_yp, _, _) = padded(x), padded(d_out)
        f32 = jnp.float32

        def one_block(d_x, weights):
            gu, d = gathered(*weights)

            def one_piece(j, carry):
                d_gu, d_d, d_x = carry
                xc, d_yc = piece(xp, j, c), piece(d_yp, j, c)  # [B, c, H] each
                h, act_vjp = jax.vjp(activate, jnp.dot(xc, gu))
                d_d = d_d + jnp.einsum("bci,bch->ih", h, d_yc, preferred_element_type=f32)
                (d_gu_c,) = act_vjp(jnp.dot(d_yc, d.T).astype(h.dtype))
                d_gu = d_gu + jnp.einsum("bch,bci->hi", xc, d_gu_c, preferred_element_type=f32)
                return d_gu, d_d, add_piece(d_x, j, c, jnp.dot(d_gu_c, gu.T, preferred_element_type=f32))

            zeros = (jnp.zeros(gu.shape, f32), jnp.zeros(d.shape, f32))
            d_gu, d_d, d_x = jax.lax.fori_loop(0, n, one_piece, (*zeros, d_x))
            grads = (place(d_gu.astype(gate_up.dtype), P(hidden, None)), place(d_d.astype(down.dtype), P(None, hidden)))
            return d_x, grads

        d_x, (d_gus, d_ds) = jax.lax.scan(one_block, jnp.zeros(xp.shape, f32), split(gate_up, down))
        return (d_x[:, :x.shape[1]].astype(x.dtype), *joined(d_gus, d_ds))

    run.defvjp(run_fwd, run_bwd)
    return run
