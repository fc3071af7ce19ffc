"""Session-wide test settings, made before anything imports JAX: compile fast, compile once.

- Fast compilation: XLA's LLVM back end optimises at level 0 without its expensive passes. The
  test models are tiny, so nearly all of a test's time is compilation (about 45% less CPU time
  for the callback and sampler tests); the numerics do not change (no fast-math either way).
  Benchmarks measure speed, so `tests/test_benchmarks.py` runs them with the user's own flags.
- One persistent compilation cache for the run: many tests jit the same programs in fresh
  closures, which JAX's in-memory cache (keyed by the Python function) would compile again.

Subprocesses (the demo, the resume-contract scripts) inherit both through the environment.
RLBOLT_TEST_FULL_XLA=1 runs the tests with XLA's default optimisation and no shared cache.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
USER_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")

if not os.environ.get("RLBOLT_TEST_FULL_XLA") and "jax" not in sys.modules:
    os.environ["RLBOLT_TEST_USER_XLA_FLAGS"] = USER_XLA_FLAGS  # what the benchmarks run with
    os.environ["XLA_FLAGS"] = f"{USER_XLA_FLAGS} {FAST_COMPILE_FLAGS}".strip()
    # No persistent compilation cache: on jaxlib 0.10.2 (CPU) writing one entry segfaulted, the same
    # test each time (test_sampler.py's test_samples_depend_only_on_their_own_key) after ~1,100
    # tests of the default tier, inside XLA's executable serialisation; the tests alone pass.
    # RLBOLT_TEST_JAX_CACHE=1 turns it back on.
    if os.environ.get("RLBOLT_TEST_JAX_CACHE") and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _cache_dir = tempfile.mkdtemp(prefix="rlbolt-test-jax-cache-")
        os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                          JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

        def pytest_unconfigure(config):
            shutil.rmtree(_cache_dir, ignore_errors=True)
