"""The device layouts parameters are stored in, so the update can form their gradients in them.

An array placed on a TPU takes the platform's default layout for its shape, and that layout is
not always row-major: for a shard whose last dimension is not a multiple of 128 lanes (Gemma 3's
262,208 x 3,840 embedding table on fsdp 8 is a [262208, 480] shard) the TPU lays the first
dimension minor, which pads less. A gradient formed by a gather's transpose (a scatter-add into
the table's rows) comes out row-major. Left alone, XLA's layout assignment then runs the
optimizer's element-wise update in the gradient's layout and copies the master weights and both
AdamW moments into it and back: three whole float32 shards of temporaries (1.5 GiB per chip in
that row). Constraining the gradient accumulator to the stored layout instead costs at most one
relayout of the gradient and lets the update write the state in place.

    layouts = accumulator_layouts(params, accumulator_dtypes)   # None where nothing to do
    grads = constrain(grads, layouts)

Only TPU is probed: the CPU and GPU clients store dense arrays row-major, where the constraint
would be a no-op, so their leaves get None and their executables do not change.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

PROBED_PLATFORMS = ("tpu",)


def accumulator_layouts(params: Any, dtypes: Any) -> Any:
    """Per leaf of `params`: the `Layout` (major-to-minor order only) its gradient accumulator of
    dtype `dtypes` should take, or None where the stored layout is row-major or unknown.

    Args:
      params: placed arrays or `ShapeDtypeStruct`s carrying their `NamedSharding`s.
      dtypes: a tree like `params` of the accumulators' dtypes (the masters' float32 with
        master weights, else the parameters' own).
    """
    return jax.tree.map(_layout_of, params, dtypes)


def constrain(tree: Any, layouts: Any) -> Any:
    """`tree` with each leaf whose layout is not None constrained to it (inside a jitted function);
    `layouts` None (no plan) leaves the whole tree as it is."""
    if layouts is None:
        return tree
    return jax.tree.map(lambda x, layout: x if layout is None else with_layout_constraint(x, layout),
                        tree, layouts)


def _layout_of(param: Any, dtype: Any) -> Layout | None:
    sharding = getattr(param, "sharding", None)
    if not isinstance(sharding, jax.sharding.NamedSharding) or len(param.shape) < 2:
        return None
    if sharding.mesh.devices.flat[0].platform not in PROBED_PLATFORMS:
        return None
    order = _default_order(tuple(param.shape), jnp.dtype(dtype), sharding)
    return None if order == tuple(range(len(param.shape))) else Layout(order)


@functools.lru_cache(maxsize=512)
def _default_order(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.NamedSharding) -> tuple[int, ...]:
    """The major-to-minor order the platform gives an array of this shape, dtype and sharding:
    the entry layout of a trivial executable compiled for it (milliseconds; no device is touched)."""
    compiled = jax.jit(lambda x: x).lower(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)).compile()
    return tuple(compiled.input_formats[0][0].layout.major_to_minor)


__all__ = ["PROBED_PLATFORMS", "accumulator_layouts", "constrain"]
