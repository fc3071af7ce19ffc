"""The device layouts parameters are stored in, so the update can form their gradients in them.

An array placed on a TPU takes the platform's default layout for its shape, and that layout is
not always row-major: for a shard whose last dimension is not a multiple of 128 lanes (Gemma 3's
262,208 x 3,840 embedding table on fsdp 8 is a [262208, 480] shard) the TPU lays the first
dimension minor, which pads less. A gradient formed by a gather's transpose (a scatter-add into
the table's rows) comes out row-major. Left alone, XLA's layout assignment then runs the
optimizer's element-wise update in the gradient's layout and copies the master weights and both
AdamW moments into it and back: three whole float32 shards of temporaries (1.5 GiB per chip in
that row). Constraining the gradient accumulator to the stored layout instead costs at most one
relayout of the gradient and lets the update write the state in place. The constraint is kept only
where the compiler honours it without moving data: on 64 chips of v5p (libtpu 0.0.42.1) it compiled
to an all-reduce of every whole accumulator instead (`_stored_format` probes for that).

    layouts = accumulator_layouts(params, accumulator_dtypes)   # None where nothing to do
    grads = constrain(grads, layouts)

Only TPU is probed: the CPU and GPU clients store dense arrays row-major, where the constraint
would be a no-op, so their leaves get None and their executables do not change.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.layout import Format, Layout

PROBED_PLATFORMS = ("tpu",)
# An op of a compiled program that moves data between devices.
_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(-start)?\(")


def accumulator_layouts(params: Any, dtypes: Any) -> Any:
    """Per leaf of `params`: the `Format` (the stored layout's major-to-minor order, and the leaf's
    sharding) its gradient accumulator of dtype `dtypes` should take, or None where the stored layout
    is row-major or unknown, or where the compiler would move data to honour it (`_stored_format`).

    Args:
      params: placed arrays or `ShapeDtypeStruct`s carrying their `NamedSharding`s.
      dtypes: a tree like `params` of the accumulators' dtypes (the masters' float32 with
        master weights, else the parameters' own).
    """
    return jax.tree.map(_layout_of, params, dtypes)


def constrain(tree: Any, layouts: Any) -> Any:
    """`tree` with each leaf whose format is not None constrained to it (inside a jitted function);
    `layouts` None (no plan) leaves the whole tree as it is."""
    if layouts is None:
        return tree
    return jax.tree.map(_constrain_leaf, tree, layouts)


def _constrain_leaf(x: Any, stored: Format | None) -> Any:
    return x if stored is None else jax.lax.with_sharding_constraint(x, stored)


def _layout_of(param: Any, dtype: Any) -> Format | None:
    sharding = getattr(param, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or len(param.shape) < 2:
        return None
    if sharding.mesh.devices.flat[0].platform not in PROBED_PLATFORMS:
        return None
    return _stored_format(tuple(param.shape), jnp.dtype(dtype), sharding)


@functools.lru_cache(maxsize=512)
def _stored_format(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.NamedSharding) -> Format | None:
    """The stored layout of an array of this shape, dtype and sharding (the entry layout of a trivial
    executable compiled for it: milliseconds, no device is touched), as a `Format` with the sharding;
    None where it is row-major, or where the compiler cannot keep the sharding under the constraint:
    on v5p:4x4x4 (fsdp 64, libtpu 0.0.42.1) a trivial `x * 2` constrained to its own stored layout
    compiles to an all-reduce of the whole array, and the update's accumulators did the same per layer
    (Qwen3-30B-A3B: 48 whole float32 expert kernels), so a format is used only where that probe
    moves no data."""
    probe = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    order = tuple(jax.jit(lambda x: x).lower(probe).compile().input_formats[0][0].layout.major_to_minor)
    if order == tuple(range(len(shape))):
        return None
    stored = Format(Layout(order), sharding)
    constrained = jax.jit(lambda x: _constrain_leaf(x * 2, stored), out_shardings=sharding)
    return None if _COLLECTIVE.search(constrained.lower(probe).compile().as_text()) else stored


__all__ = ["PROBED_PLATFORMS", "accumulator_layouts", "constrain"]
