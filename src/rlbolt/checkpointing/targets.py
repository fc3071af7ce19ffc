"""What a checkpoint restore reads into: target trees of abstract arrays and their placement.

`CheckpointIO` restores into these: `abstract` (the run's arrays or ShapeDtypeStructs, shardings kept),
`local_target` (a saved item on this process's first device, for reading a checkpoint that other
processes wrote), and `placed_like` (restored arrays moved onto a target's shardings after a layout
conversion).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def local_target(item: Path) -> Any:
    """A StandardSave item's tree as arrays on this process's first device. Without a target Orbax restores
    onto the shardings it saved, which name the writers' devices: a checkpoint several processes wrote
    (a training group of 2) then fails on one with "Topology mismatch".

    Args:
      item: the item's folder inside a finalized step.

    Returns:
      The saved tree (nested dicts and lists) with a `jax.ShapeDtypeStruct` for every array.
    """
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    saved = ocp.StandardCheckpointHandler().metadata(item).tree
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device)
                        if hasattr(m, "shape") and hasattr(m, "dtype") else m, saved)


def abstract(tree: Any) -> Any:
    """Arrays -> ShapeDtypeStructs keeping their shardings (already abstract leaves pass through)."""

    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        x = np.asarray(x)
        return jax.ShapeDtypeStruct(x.shape, x.dtype)

    return jax.tree.map(leaf, tree)


def placed_like(tree: Any, target: Any) -> Any:
    """`tree`'s arrays moved onto the shardings of `target` (ShapeDtypeStructs of the same structure)."""
    def put(x, t):
        sharding = getattr(t, "sharding", None)
        return x if sharding is None else jax.device_put(x, sharding)

    return jax.tree.map(put, tree, target)
