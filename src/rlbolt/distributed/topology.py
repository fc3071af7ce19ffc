"""Devices to plan for: a TPU slice described by name (no TPU needed), or the devices this process sees,
and what each kind of chip holds and computes.

    devices = target_devices("v5p:2x2x2")   the 8 abstract chips of a v5p slice (needs libtpu: rlbolt[tpu])
    devices = target_devices(None)          jax.devices(): this host's CPU, GPUs or TPU chips
    chip = chip_of(devices[0])              Chip(name, hbm_bytes, peak_flops) from the table below

Abstract devices take shardings and compile (`jax.jit(...).lower(ShapeDtypeStructs).compile()` runs
XLA's real TPU compiler on any x86-64 Linux host with libtpu installed), but hold no arrays: a run is
built for them with `jax.eval_shape` and ShapeDtypeStructs only (`rlbolt.planning`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax

GENERATIONS = ("v4", "v5e", "v5p", "v6e")
_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v6e):([1-9]\d*)x([1-9]\d*)(?:x([1-9]\d*))?$")
TOPOLOGY_FORMS = "v5e:4x4, v5e:2x2, v6e:2x4 (two dimensions), v5p:2x2x2, v4:2x2x1 (three dimensions)"


class TopologyError(ValueError):
    """A topology name that cannot be described (the message names the field and the valid forms)."""


@dataclasses.dataclass(frozen=True)
class Chip:
    """What one device of a kind holds and computes (vendor data sheets; bf16 dense peak).

    Attributes:
      name: the short name (v5p, H100, ...).
      hbm_bytes: memory per device in bytes.
      peak_flops: peak dense bf16 FLOP/s per device.
    """

    name: str
    hbm_bytes: int
    peak_flops: float


GIB, GB = 1 << 30, 10**9
# device_kind substring (lower case, most specific first) -> Chip. TPU kinds as libtpu names them.
CHIPS: tuple[tuple[str, Chip], ...] = (
    ("tpu v5 lite", Chip("v5e", 16 * GIB, 197e12)),
    ("tpu v5e", Chip("v5e", 16 * GIB, 197e12)),
    ("tpu v5p", Chip("v5p", 95 * GIB, 459e12)),
    ("tpu v5", Chip("v5p", 95 * GIB, 459e12)),
    ("tpu v6 lite", Chip("v6e", 32 * GIB, 918e12)),
    ("tpu v6e", Chip("v6e", 32 * GIB, 918e12)),
    ("tpu v4", Chip("v4", 32 * GIB, 275e12)),
    ("h200", Chip("H200", 141 * GB, 989e12)),
    ("h100", Chip("H100", 80 * GB, 989e12)),
    ("a100-sxm4-40gb", Chip("A100-40GB", 40 * GB, 312e12)),
    ("a100", Chip("A100", 80 * GB, 312e12)),
    ("l4", Chip("L4", 24 * GB, 121e12)),
)


def chip_of(device: Any) -> Chip | None:
    """The Chip of a device by its `device_kind` (None: not in the table, e.g. a CPU)."""
    kind = str(getattr(device, "device_kind", "")).lower()
    return next((chip for key, chip in CHIPS if key in kind), None)


def device_hbm_bytes(device: Any) -> tuple[int | None, str]:
    """(bytes one device can hold, where the number comes from): the backend's `memory_stats()`
    `bytes_limit` on a real device, else the chip table by device kind; (None, "unknown") otherwise."""
    try:
        stats = device.memory_stats()
    except Exception:  # abstract devices and CPUs: no allocator to ask
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), "memory_stats"
    chip = chip_of(device)
    return (chip.hbm_bytes, f"table ({chip.name})") if chip else (None, "unknown")


def parse_topology(name: str) -> tuple[str, tuple[int, ...]]:
    """`"v5p:2x2x2"` -> ("v5p", (2, 2, 2)).

    Raises:
      TopologyError: one line naming --topology and the valid forms.
    """
    match = _TOPOLOGY.match(str(name).strip())
    if not match:
        raise TopologyError(f"--topology={name!r} is not a slice name; use <generation>:<shape> with generation one "
                            f"of {', '.join(GENERATIONS)}, e.g. {TOPOLOGY_FORMS}")
    dims = tuple(int(d) for d in match.groups()[1:] if d is not None)
    generation = match.group(1)
    if generation in ("v4", "v5p") and len(dims) != 3:
        raise TopologyError(f"--topology={name!r}: {generation} slices have three dimensions, e.g. {generation}:2x2x2")
    if generation in ("v5e", "v6e") and len(dims) != 2:
        raise TopologyError(f"--topology={name!r}: {generation} slices have two dimensions, e.g. {generation}:4x4")
    return generation, dims


def target_devices(topology: str | None) -> list[Any]:
    """The devices to plan for: the abstract chips of `topology` (a TPU slice name), or, for None,
    every device this process sees (`jax.devices()`).

    Raises:
      TopologyError: a malformed name, libtpu missing, or a shape libtpu does not describe.
    """
    if topology is None:
        return list(jax.devices())
    generation, dims = parse_topology(topology)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise TopologyError(f"--topology={topology}: describing a TPU slice needs libtpu; install the rlbolt[tpu] "
                            "extra (pip install 'rlbolt[tpu]'), or leave --topology out to plan for this host's "
                            "devices") from None
    import os

    from jax.experimental import topologies

    # Describing a slice opens no TPU: let several planning processes load libtpu side by side
    # (otherwise the second one fails on libtpu's lock file).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    # Off a TPU VM libtpu probes the metadata server for these and logs screens of warnings; they do
    # not change the description (checked for v5e:4x4, v5p:2x2x2, v5p:4x4x4, v6e:2x4), so name the slice.
    chips = math.prod(dims)
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", {"v4": f"v4-{2 * chips}", "v5p": f"v5p-{2 * chips}",
                                                   "v5e": f"v5litepod-{chips}", "v6e": f"v6e-{chips}"}[generation])
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        return list(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)
    except Exception as error:  # libtpu's own refusal (an unsupported shape)
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TopologyError(f"--topology={topology}: libtpu cannot describe it ({first}); use a slice shape of "
                            f"that generation, e.g. {TOPOLOGY_FORMS}") from None


def is_abstract(devices: list[Any]) -> bool:
    """True when `devices` are not this process's (a described slice): nothing can be placed on them."""
    local = {id(d) for d in jax.devices()} if devices else set()
    return bool(devices) and not any(id(d) in local for d in devices)


__all__ = ["CHIPS", "Chip", "TopologyError", "chip_of", "device_hbm_bytes", "is_abstract", "parse_topology",
           "target_devices"]
