"""Checksums of what a checkpoint saved, checked when it is read back.

Orbax verifies the structure of what it reads (a truncated, zeroed or missing file fails to
restore) but not the values: flipped bytes inside the array data come back as silently wrong
numbers (the OCDBT format checksums its index, not the chunks; Orbax 0.12 has no option to
verify the data). So every checkpoint records, per array, its dtype, its shape, a 64-bit
checksum of its bytes and whether it was finite, and a restore recomputes and compares them.

Where the array lives decides how its checksum is computed, and the record names the method:

- `xxh3:` arrays in host memory (the CPU backend, CPUOffload's optimizer state): xxHash's
  XXH3-64 of the array's bytes, read in place (tens of GB/s; no copy);
- `sum64:` arrays on an accelerator, or sharded across hosts: one jitted pass on the device
  over every array, and only scalars come back (no device-to-host copy; works unchanged on
  sharded arrays). Each array is viewed as 32-bit words `u[i]` (narrower types are widened,
  64-bit types split in two) and the checksum is the pair

      a = sum_i u[i] * w1[i]  (mod 2**32),   b = sum_i mix(u[i]) * w2[i]  (mod 2**32)

  with odd position weights `w1`, `w2` and `mix(u) = v ^ (v >> 16)`, `v = u * 0x9E3779B1` (a
  bijection of 32-bit words). An odd weight makes any change of a single word change `a`; the
  second sum, of differently mixed and weighted words, makes an unnoticed change of several
  words a 2**-64 accident. Modular sums do not depend on the summation order, so the value is
  the same for any sharding. `numpy_checksum` is the same function in NumPy (the tests'
  reference).

A restore recomputes each array's checksum with the method its record names, wherever the
array was restored to.

Arrays are named by their path with every key as text (`params/layers/0/attn/kernel/value`),
which is the same for a tree restored into a template and for one restored without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import xxhash

METHODS = ("xxh3", "sum64")
_M1, _C1 = 0x9E3779B1, 0x7F4A7C15
_M2, _C2 = 0x85EBCA6B, 0xC2B2AE35


class CheckpointCorrupt(Exception):
    """A checkpoint step cannot be used; the message is the one-line reason."""


def path_name(path: tuple) -> str:
    """A tree path as `a/b/0/c`: dict keys, attribute names and indices all as text."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def named_leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{path name: leaf} of a pytree (leaves that are None are skipped)."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {f"{prefix}{path_name(path)}": leaf for path, leaf in leaves if leaf is not None}


def _words(x: jax.Array) -> jax.Array:
    """The bytes of `x` as a flat uint32 vector (the layout `numpy_checksum` reproduces)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.iscomplexobj(x):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    size = x.dtype.itemsize
    if size in (1, 2):
        unsigned = jnp.uint8 if size == 1 else jnp.uint16
        return jax.lax.bitcast_convert_type(x, unsigned).reshape(-1).astype(jnp.uint32)
    return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)  # 8-byte types gain a trailing 2


def _checksum_and_finite(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    u = _words(x)
    i = jax.lax.iota(jnp.uint32, u.shape[0])
    w1 = (i * jnp.uint32(_M1) + jnp.uint32(_C1)) | jnp.uint32(1)
    w2 = ((i ^ jnp.uint32(_C2)) * jnp.uint32(_M2)) | jnp.uint32(1)
    v = u * jnp.uint32(_M1)
    mixed = v ^ (v >> 16)
    a = jnp.sum(u * w1, dtype=jnp.uint32)
    b = jnp.sum(mixed * w2, dtype=jnp.uint32)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
    return a, b, finite


_checksums = jax.jit(lambda leaves: [_checksum_and_finite(x) for x in leaves])


def _host(x: jax.Array) -> np.ndarray:
    # A replicated scalar; on several hosts it is not "fully addressable", its local copy is.
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def checksums(named: Mapping[str, Any], methods: Mapping[str, str] | None = None) -> dict[str, tuple[str, bool]]:
    """{name: ("method:hex digits", all finite)} of every array.

    Args:
      named: {name: array}.
      methods: {name: "xxh3" or "sum64"} to use (a restore passes the recorded ones); by
        default "xxh3" for arrays in host memory and "sum64" for the others.
    """
    methods = {n: (methods or {}).get(n) or ("xxh3" if _in_host_memory(x) else "sum64") for n, x in named.items()}
    on_device = {n: x for n, x in named.items() if methods[n] == "sum64"}
    arrays = [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in on_device.values()]
    out = {n: (f"sum64:{int(_host(a)):08x}{int(_host(b)):08x}", bool(_host(f)))
           for n, (a, b, f) in zip(on_device, _checksums(arrays) if arrays else [])}
    for name, x in named.items():
        if methods[name] != "sum64":
            host = np.asarray(jax.random.key_data(x) if _is_key(x) else x)
            finite = bool(np.isfinite(host).all()) if jnp.issubdtype(host.dtype, jnp.inexact) else True
            data = memoryview(np.ascontiguousarray(host).reshape(-1).view(np.uint8))
            out[name] = (f"xxh3:{xxhash.xxh3_64_hexdigest(data)}", finite)
    return {n: out[n] for n in named}


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _in_host_memory(x: Any) -> bool:
    """NumPy arrays, and JAX arrays whose every shard is in host memory on this process."""
    if not isinstance(x, jax.Array):
        return True
    if not x.is_fully_addressable:
        return False
    kind = getattr(x.sharding, "memory_kind", None)
    return (kind is not None and "host" in kind) or all(d.platform == "cpu" for d in x.sharding.device_set)


def numpy_checksum(x: np.ndarray) -> str:
    """The "sum64" checksum computed in NumPy from the array's bytes (a reference for tests)."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        u = x.reshape(-1).astype(np.uint64)
    elif x.dtype.itemsize in (1, 2):
        u = x.reshape(-1).view(np.uint8 if x.dtype.itemsize == 1 else np.uint16).astype(np.uint64)
    else:
        u = np.ascontiguousarray(x).reshape(-1).view("<u4").astype(np.uint64)
    i = np.arange(u.shape[0], dtype=np.uint64)
    mask = np.uint64(0xFFFFFFFF)
    w1 = ((i * np.uint64(_M1) + np.uint64(_C1)) & mask) | np.uint64(1)
    w2 = (((i ^ np.uint64(_C2)) * np.uint64(_M2)) & mask) | np.uint64(1)
    v = (u * np.uint64(_M1)) & mask
    mixed = v ^ (v >> np.uint64(16))
    a = int(((u * w1) & mask).sum() & mask)
    b = int(((mixed * w2) & mask).sum() & mask)
    return f"sum64:{a:08x}{b:08x}"


def record(tree: Any, prefix: str = "") -> dict[str, dict]:
    """What a checkpoint stores about each array of `tree`: dtype, shape, checksum, finite.

    Args:
      tree: a pytree of arrays (what is about to be saved).
      prefix: prepended to every name (e.g. "params/" when `tree` is one item's subtree).

    Returns:
      {name: {"dtype": str, "shape": [int], "checksum": str, "finite": bool}} (JSON-ready).
    """
    named = named_leaves(tree, prefix)
    sums = checksums(named)
    return {name: {"dtype": str(jnp.asarray(x).dtype) if not hasattr(x, "dtype") else str(x.dtype),
                   "shape": [int(d) for d in np.shape(x)], "checksum": sums[name][0], "finite": sums[name][1]}
            for name, x in named.items()}


def check_record(value: Any, where: str) -> dict[str, dict]:
    """Validates a stored record's types (it comes from a file that may be damaged)."""
    if not isinstance(value, dict):
        raise CheckpointCorrupt(f"{where} is {type(value).__name__}, expected a mapping of array records")
    for name, entry in value.items():
        ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
              and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
              and isinstance(entry.get("checksum"), str)
              and isinstance(entry.get("finite"), bool))
        method = entry.get("checksum", "").split(":")[0] if ok else ""
        if not ok or method not in METHODS:
            raise CheckpointCorrupt(f"{where}[{name!r}] is malformed: {str(entry)[:120]}")
    return value


def check_layout(stored: Mapping[str, dict], template: Any, prefix: str = "") -> None:
    """Raises CheckpointCorrupt when the stored arrays are not the template's (names, shapes, dtypes):
    the model or optimizer changed, or the record is damaged. Checked before reading any array."""
    wanted = {name: (list(np.shape(x)), str(x.dtype)) for name, x in named_leaves(template, prefix).items()}
    have = {name: (e["shape"], e["dtype"]) for name, e in stored.items() if name.startswith(prefix)}
    if wanted == have:
        return
    missing, extra = sorted(set(wanted) - set(have)), sorted(set(have) - set(wanted))
    if missing or extra:
        detail = (f"this run has {missing[0]}, the checkpoint does not" if missing else
                  f"the checkpoint has {extra[0]}, this run does not")
        raise CheckpointCorrupt(f"it holds different arrays than this run builds ({detail}; {len(missing)} missing, "
                                f"{len(extra)} extra): did the model or the optimizer change?")
    name = next(n for n in sorted(wanted, key=lambda n: (not n.startswith("params/"), n)) if wanted[n] != have[n])
    raise CheckpointCorrupt(f"{name} is {have[name][1]}{tuple(have[name][0])} in the checkpoint but "
                            f"{wanted[name][1]}{tuple(wanted[name][0])} in this run: did the model or the optimizer change?")


def verify(tree: Any, stored: Mapping[str, dict], prefix: str = "", finite: tuple[str, ...] = ()) -> None:
    """Recomputes the checksums of a restored tree and compares them with the stored record.

    Args:
      tree: the restored pytree.
      stored: the record written at save time.
      prefix: the prefix its names were recorded with.
      finite: name prefixes whose arrays must be finite (the parameters).

    Raises:
      CheckpointCorrupt: a missing array, a different shape or dtype, a checksum mismatch, or
        non-finite values where `finite` requires them.
    """
    named = named_leaves(tree, prefix)
    absent = sorted(n for n in stored if n.startswith(prefix) and n not in named)
    if absent:
        raise CheckpointCorrupt(f"{absent[0]} is missing from the restored arrays")
    missing = sorted(n for n in named if n not in stored)
    if missing:
        raise CheckpointCorrupt(f"{missing[0]} has no checksum in the checkpoint's record")
    sums = checksums(named, {n: stored[n]["checksum"].split(":")[0] for n in named})
    for name, x in named.items():
        entry = stored[name]
        if list(np.shape(x)) != entry["shape"] or str(x.dtype) != entry["dtype"]:
            raise CheckpointCorrupt(f"{name} restored as {x.dtype}{tuple(np.shape(x))}, "
                                    f"saved as {entry['dtype']}{tuple(entry['shape'])}")
        checksum, all_finite = sums[name]
        if checksum != entry["checksum"]:
            raise CheckpointCorrupt(f"checksum mismatch in {name} (the array data changed on disk)")
        if not all_finite and name.startswith(finite):
            saved = "it was saved that way: the run had diverged" if not entry["finite"] else "damaged on disk"
            raise CheckpointCorrupt(f"non-finite values (NaN or inf) in {name} ({saved})")
