"""Session-wide test settings, made before anything imports JAX: compile fast, compile once.

- Fast compilation: XLA's LLVM back end optimises at level 0 without its expensive passes, and
  XLA:CPU emits fusions with its elemental emitters instead of the newer MLIR fusion emitters
  (`--xla_cpu_use_fusion_emitters=false`). The test models are tiny, so nearly all of a test's
  time is compilation: level 0 took about 45% off the callback and sampler tests' CPU time, the
  elemental emitters a further ~35% off `tests/models/test_decoder.py` (37 -> 24 CPU seconds).
  No fast-math either way, but a fused reduction can round differently from the default flags
  in its last bits (the emitters vectorise it differently): tests compare against derived
  tolerances (`float_tolerance.py`), and bit-equality checks compare two programs compiled
  under the same flags. A check that two *different* programs (with and without remat, a sharded
  and a plain gradient) give the same bits holds with the fusion emitters, not the elemental ones
  (they fuse each program's loops differently): such a check runs in a child process with the
  emitters on (`cpu_devices.run_on_cpu_devices(..., same_bits_across_programs=True)`). Benchmarks measure speed, so `tests/test_benchmarks.py` runs them with
  the user's own flags.
- One persistent compilation cache for the run: many tests jit the same programs in fresh
  closures, which JAX's in-memory cache (keyed by the Python function) would compile again.

A user's own XLA_FLAGS (e.g. `--xla_cpu_max_isa=AVX2`, to try another CPU's kernel choices) are
kept: the flags above are appended to them.
Subprocesses (the demo, the resume-contract scripts) inherit both through the environment.
RLBOLT_TEST_FULL_XLA=1 runs the tests with XLA's default optimisation and no shared cache.

- Worker processes for the default tier: `python -m pytest` as the README types it runs its
  test files on `min(4, CPUs)` pytest-xdist workers (`-n auto --dist loadfile` in pyproject.toml;
  a file's tests stay on one worker, so its module fixtures are built once). Every other run
  (a marker such as `-m slow`, named files or tests) stays in one process unless `-n N` is given:
  the slow and tpu tiers compile real-sized models, measured and sized as one process.
  The workers inherit this module's environment (flags and the one compilation cache).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from cpu_devices import EMITTERS_OFF  # imports no JAX

FAST_COMPILE_FLAGS = f"--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true {EMITTERS_OFF}"
USER_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")

if not os.environ.get("RLBOLT_TEST_FULL_XLA") and "jax" not in sys.modules and "PYTEST_XDIST_WORKER" not in os.environ:
    os.environ["RLBOLT_TEST_USER_XLA_FLAGS"] = USER_XLA_FLAGS  # what the benchmarks run with
    os.environ["XLA_FLAGS"] = f"{USER_XLA_FLAGS} {FAST_COMPILE_FLAGS}".strip()
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _cache_dir = tempfile.mkdtemp(prefix="rlbolt-test-jax-cache-")
        os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                          JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

        def pytest_unconfigure(config):
            shutil.rmtree(_cache_dir, ignore_errors=True)

import pytest  # noqa: E402

MAX_WORKERS = 4  # each worker holds ~3 GB at its peak (JAX, torch, transformers)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (pyproject.toml's addopts): workers for the README's `python -m pytest` (the default
    tier from testpaths), none (one process) for a marker expression or named paths."""
    default_tier = config.args_source is pytest.Config.ArgsSource.TESTPATHS and "not slow" in (config.option.markexpr or "")
    cpus = os.cpu_count() or 1
    return min(MAX_WORKERS, cpus) if default_tier and cpus > 1 else 0


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops JAX's in-memory compiled programs after each test module. The default tier compiles
    thousands of programs in one process; kept alive, their code mappings grew until XLA crashed
    compiling (a segfault inside a cache write, then an abort) ~1,100 tests in, at the same test
    each time, while every module passes alone. Later modules recompile what they need (the
    persistent cache above makes that a disk read)."""
    yield
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
