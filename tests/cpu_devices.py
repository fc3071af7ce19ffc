"""Run a Python script in a fresh process that sees several CPU devices (JAX fixes the device count when it
starts, so a test process cannot change its own): the test tier's XLA flags plus
`--xla_force_host_platform_device_count`."""

from __future__ import annotations

import os
import subprocess
import sys


def run_on_cpu_devices(script: str, *args: str, devices: int = 8, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -c script *args` on `devices` CPU devices; returns the finished process (stdout, stderr as text)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)
