"""XLA flags that were measured to help on CPU, applied only where they are known to exist.

An unknown flag in XLA_FLAGS aborts the process, so a flag is added only for the jaxlib
versions it was checked on, only when no GPU plugin is installed, and never twice. Call before
the first JAX computation (the `rlbolt` command and the benchmarks do).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os

# Single dots outside YNNPACK: a large f32 matmul went 117 -> 139 GFLOP/s on the 2-core CI
# machine (measured with and without the flag in one session); checked to exist in jaxlib 0.10.x. Reductions stay in YNNPACK: taking
# them out too ("-reduce") made decode attention's multiply + sum 2.5x slower and the GRPO step
# ~0.1 s slower (benchmarks/RESULTS.md).
_CPU_FLAGS = {"0.10.": "--xla_cpu_experimental_ynn_fusion_type=-individual_dot"}
# The decode's dots are the opposite case: a micro batch's ~32 rows against weights streamed from
# memory ran ~12% faster per decode step in YNNPACK at SmolLM2-135M shapes (benchmarks/RESULTS.md),
# so the decode executables take jaxlib's default fusion types back (the flag above is global).
_DECODE_OPTIONS = {"0.10.": {"xla_cpu_experimental_ynn_fusion_type": ",".join(
    "LIBRARY_FUSION_TYPE_" + kind for kind in ("REDUCE", "INDIVIDUAL_DOT", "INDIVIDUAL_CONVOLUTION"))}}
_GPU_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_plugins.xla_cuda12")


def configure_xla_flags(enable: bool = True) -> list[str]:
    """Adds the CPU flags for the installed jaxlib to XLA_FLAGS; returns the flags added."""
    if not enable or os.environ.get("RLBOLT_NO_XLA_FLAGS"):
        return []
    jaxlib_version = _jaxlib_version()
    if not jaxlib_version:  # no jaxlib metadata: add nothing
        return []
    if any(_has_module(name) for name in _GPU_PLUGINS):
        return []
    current = os.environ.get("XLA_FLAGS", "")
    added = [flag for prefix, flag in _CPU_FLAGS.items() if jaxlib_version.startswith(prefix) and flag.split("=")[0] not in current]
    if added:
        os.environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def decode_compiler_options() -> dict[str, str]:
    """Per-executable XLA options for the decode loops; empty unless this module's CPU flag is set.

    Only where `configure_xla_flags` (or the user) took single dots out of YNNPACK: without that
    flag the decode already compiles with jaxlib's defaults.
    """
    current = os.environ.get("XLA_FLAGS", "")
    for prefix, flag in _CPU_FLAGS.items():
        if flag in current.split() and _jaxlib_version().startswith(prefix):
            return dict(_DECODE_OPTIONS.get(prefix, {}))
    return {}


class DecodeJit:
    """`jax.jit(fn, **jit_kwargs)` with `decode_compiler_options()`, built at its first use, so
    that flags configured after this module's import (the CLI configures them at start-up) count.
    """

    def __init__(self, fn, **jit_kwargs):
        self._fn, self._jit_kwargs, self._jitted = fn, jit_kwargs, None

    def _get(self):
        if self._jitted is None:
            import jax

            self._jitted = jax.jit(self._fn, compiler_options=decode_compiler_options() or None, **self._jit_kwargs)
        return self._jitted

    def __call__(self, *args, **kwargs):
        return self._get()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._get().lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return 0 if self._jitted is None else self._jitted._cache_size()


def _jaxlib_version() -> str:
    try:
        from importlib.metadata import version

        return version("jaxlib")
    except Exception:  # noqa: BLE001 - no jaxlib metadata
        return ""


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def release_freed_host_memory() -> bool:
    """Returns freed heap memory to the OS (glibc `malloc_trim`); True when it ran.

    XLA's CPU compiler frees hundreds of MB after the first step's compilations, but glibc keeps
    the fragments mapped, so the steady-state RSS sits ~100-170 MB higher and the update's
    temporaries come on top of it (RESULTS.md: peak RSS). Called once after warm-up; calling it
    every step would make the update fault its temporaries back in.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        return False
    if trim is None:  # not glibc (musl, macOS)
        return False
    trim(0)
    return True
