"""The grouped matmul of the MoE experts (`model.moe_matmul`): XLA's `ragged_dot` or Pallas' megablox `gmm`.

Both compute `out[r] = lhs[r] @ rhs[g(r)]` for rows grouped contiguously by expert (`sizes[g]` rows
each, in order), and 0 for the rows after the last group. `resolve_moe_matmul` maps the config's
choice to a kernel:

    auto        TPU: gmm   else: ragged_dot
    gmm         TPU: gmm   else: an error (a Mosaic kernel: TPU only)
    ragged_dot  ragged_dot everywhere

Why gmm on TPU (measured from the TPU compiler's buffer assignment, benchmarks/RESULTS.md, "MoE on
TPU"): the TPU lowering of `ragged_dot` is a grouped kernel too, but it builds one [E, rows, 1]
predicate mask per matmul, tiled to 128 lanes (128 B per expert and row), and without a shard_map
XLA's partitioner runs the global sort and `ragged_dot` on every chip over all chips' rows (that way
Qwen3-30B-A3B's update at 4k asked 531 GiB per chip of v5p:4x4x4). Megablox `gmm`
(`jax.experimental.pallas.ops.tpu.megablox`) visits only the row tiles of each group and builds no
mask; its backward (a custom VJP in jax) is `gmm` of the transposed kernels for the rows and `tgmm`
for the kernels.

A Mosaic kernel cannot be partitioned by XLA, so on a mesh of several devices the caller runs it
under `jax.shard_map` (`rlbolt.models.moe.expert_parallel_experts`). "gmm-interpret" runs the same
kernel through Pallas' interpret mode on any platform (the CPU tests); it is never resolved.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlbolt.config.sections import MOE_MATMUL_CHOICES  # the choices of model.moe_matmul

KERNELS = ("ragged_dot", "gmm", "gmm-interpret")
_TILE = 128  # megablox's default tile on each of the row, contraction and output dimensions


def resolve_moe_matmul(choice: str, platform: str) -> str:
    """The kernel (one of KERNELS) that `model.moe_matmul=choice` runs on `platform`.

    Args:
      choice: one of MOE_MATMUL_CHOICES.
      platform: the training devices' platform ("cpu", "gpu", "tpu").

    Raises:
      ValueError: one line naming model.moe_matmul and the fix.
    """
    if choice not in MOE_MATMUL_CHOICES:
        raise ValueError(f"model.moe_matmul={choice!r}; use one of {MOE_MATMUL_CHOICES}.")
    if choice == "gmm" and platform != "tpu":
        raise ValueError(f"model.moe_matmul='gmm' is a TPU kernel (Pallas megablox) and the devices are {platform}; "
                         "use 'auto' or 'ragged_dot'.")
    if choice == "auto":
        return "gmm" if platform == "tpu" else "ragged_dot"
    return choice


def _tiles(m: int) -> tuple[int, int, int]:
    """gmm's (row, contraction, output) tiles. The backward reuses them with the contraction and
    output roles swapped, and tgmm puts the rows last, so each must suit Mosaic's block rule (a
    multiple of 128 in the last dimension, of 8 in the one before, or the whole dimension) in every
    role: 128 for the contraction and output (gmm masks a ragged last tile), and for the rows 128 or,
    below that, all of them (rounded up to 8)."""
    return min(_TILE, -(-m // 8) * 8), _TILE, _TILE


def grouped_matmul(lhs: jnp.ndarray, rhs: jnp.ndarray, sizes: jnp.ndarray, kernel: str = "ragged_dot") -> jnp.ndarray:
    """`out[r] = lhs[r] @ rhs[g]` for the rows of group g (`sizes[g]` consecutive rows), 0 after the last group.

    Args:
      lhs: [M, K] rows sorted by group.
      rhs: [G, K, N] one kernel per group.
      sizes: [G] int32 rows per group (sum <= M).
      kernel: one of KERNELS.

    Returns:
      [M, N] in lhs's dtype (float32 accumulation).
    """
    if kernel == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, sizes)
    if kernel not in KERNELS:
        raise ValueError(f"grouped_matmul: kernel={kernel!r}; use one of {KERNELS}.")
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    m = lhs.shape[0]
    tiles = _tiles(m)
    padded = -(-m // tiles[0]) * tiles[0]  # gmm takes whole row tiles
    if padded != m:
        lhs = jnp.pad(lhs, ((0, padded - m), (0, 0)))
    # The rows after the last group form one more group that has no kernel: gmm then writes zeros
    # there (forward and the rows' gradient) and tgmm computes the G real groups' kernels only.
    rest = (padded - jnp.sum(sizes)).astype(jnp.int32)
    sizes = jnp.concatenate([sizes.astype(jnp.int32), rest[None]])
    out = gmm(lhs, rhs, sizes, lhs.dtype, tiles, None, None, False, kernel == "gmm-interpret")
    return out[:m]
