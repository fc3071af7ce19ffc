"""Fixtures of the subprocess resume tests: an environment with a persistent JAX compilation
cache shared by the subprocesses (a cached executable is the same program, so it cannot change
a result), and uninterrupted reference runs computed once per setting."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from resume_helpers import SETTINGS, run_script


@pytest.fixture(scope="session")
def script_env(tmp_path_factory):
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax_cache")),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    return env


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory, script_env):
    """setting -> run dir of an uninterrupted run (computed once per setting)."""
    cache: dict[str, Path] = {}

    def get(setting: str) -> Path:
        if setting not in cache:
            run_dir = tmp_path_factory.mktemp(f"reference-{setting.replace('+', '-')}")
            run_script(run_dir, SETTINGS[setting], script_env)
            cache[setting] = run_dir
        return cache[setting]

    return get
