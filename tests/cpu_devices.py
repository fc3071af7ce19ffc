"""Run a Python script in a fresh process that sees several CPU devices (JAX fixes the device count when it
starts, so a test process cannot change its own): the test tier's XLA flags plus
`--xla_force_host_platform_device_count`.

`child_env` is the environment for any test's child process: the session's XLA_FLAGS are kept (tests/
conftest.py's fast-compile flags, so a child compiles as fast as the test process; same numerics), the
variables named by `drop` (prefixes such as `JAX_`, `SLURM_`) are not."""

from __future__ import annotations

import os
import subprocess
import sys


def child_env(drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    """os.environ less the variables whose names start with a prefix in `drop`, plus `extra`. Keep XLA_FLAGS
    out of `drop`: a script that wants N devices asks jax_num_cpu_devices, or appends the count to it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(extra)
    return env


EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"  # one of tests/conftest.py's fast-compile flags


def run_on_cpu_devices(script: str, *args: str, devices: int = 8, timeout: int = 600,
                       same_bits_across_programs: bool = False) -> subprocess.CompletedProcess:
    """`python -c script *args` on `devices` CPU devices; returns the finished process (stdout, stderr as text).

    `same_bits_across_programs`: the script asserts that two different programs (with and without remat, a
    sharded and a plain gradient) give the same bits for the same operations. XLA:CPU does so with its fusion
    emitters, not with the elemental ones the test tier compiles with for speed (which fuse each program's
    loops differently), so the child leaves the emitters on."""
    flags = os.environ.get("XLA_FLAGS", "")
    if same_bits_across_programs:
        flags = flags.replace(EMITTERS_OFF, "")
    env = child_env(JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
