"""A fingerprint of a parameter pytree: which weights a run was trained on, without a copy.

Each array is reduced on its device(s) to two position-weighted checksums of its raw bits,
`sum_i bits_i * m_i mod 2^32` with an odd multiplier `m_i` per position (two multiplier
sequences), so changing any one value, even by one ulp, always changes the checksum (an odd
number is invertible mod 2^32), and moving values to other positions changes it too. The host
then hashes the checksums with every leaf's path, dtype and shape (SHA-256). One jitted pass
over the weights and 8 bytes per leaf to the host: cheap for a 70B base, and it works on
sharded arrays as they are. It tells a different base from the right one; it is not a
cryptographic hash of the bytes (someone crafting a collision could make one).
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_M1, _M2 = np.uint32(2654435761), np.uint32(2246822519)  # odd: Knuth's and xxHash's primes


def _bits(x: jax.Array) -> jax.Array:
    """The raw bits of every element as uint32 (floats bitcast, integers and bools by value)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        width = jnp.dtype(x.dtype).itemsize * 8
        return jax.lax.bitcast_convert_type(x, {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[width]).astype(jnp.uint32)
    return x.astype(jnp.uint32)


@jax.jit
def _checksums(leaves: list[jax.Array]) -> jax.Array:
    out = []
    for x in leaves:
        bits = _bits(x).reshape(-1)
        odd = jnp.arange(bits.size, dtype=jnp.uint32) * np.uint32(2) + np.uint32(1)
        mixed = bits ^ (bits >> np.uint32(16))  # the second sum sees the bits mixed differently
        out.append(jnp.stack([jnp.sum(bits * (odd * _M1), dtype=jnp.uint32),
                              jnp.sum(mixed * (odd * _M2), dtype=jnp.uint32)]))
    return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)


def fingerprint(tree: Any) -> str:
    """A 64-hex-digit digest of a pytree of arrays: values, dtypes, shapes and paths.

    Args:
      tree: any pytree of jax or numpy arrays (an `nnx.State`, a dict of weights).

    Returns:
      The SHA-256 hex digest; equal trees give equal digests in every process.
    """
    with_paths = jax.tree_util.tree_leaves_with_path(tree)
    sums = np.asarray(jax.device_get(_checksums([jnp.asarray(leaf) for _, leaf in with_paths])))
    digest = hashlib.sha256()
    for (path, leaf), (a, b) in zip(with_paths, sums):
        digest.update(f"{jax.tree_util.keystr(path)}|{leaf.dtype}|{tuple(leaf.shape)}|{a}|{b}\n".encode())
    return digest.hexdigest()
