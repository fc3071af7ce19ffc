"""What every benchmark records beside its figures: the machine it ran on."""

from __future__ import annotations

import platform
import subprocess


def cpu_model() -> str:
    """`lscpu`'s model name (machines differ between sessions; figures are read with it)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=False).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.SubprocessError, StopIteration):
        return platform.processor() or "unknown"
