"""The environment variables that name a process's place in a multi-process run.

`rlbolt.distributed.runtime.initialize` reads them and `rlbolt launch` sets them; they live here,
apart from both, so the launcher can name them without importing JAX.
"""

from __future__ import annotations

from collections.abc import Mapping

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"  # host:port of process 0 (the coordinator)
ENV_COUNT = "JAX_NUM_PROCESSES"  # how many processes take part
ENV_ID = "JAX_PROCESS_ID"  # this process's index, 0 .. count - 1
ENV_LOCAL_DEVICES = "JAX_LOCAL_DEVICE_IDS"  # the accelerators this process takes (JAX reads it itself)
# host:port where this process serves cross-host array transfers (the weight push between groups of
# processes, `rlbolt.distributed.weight_push`) on backends without a native cross-host path (CPU, GPU)
ENV_TRANSFER = "RLBOLT_TRANSFER_ADDRESS"


def named_process_id(configured: object, environ: Mapping[str, str]) -> int | None:
    """This process's index as the config or the environment names it, before `jax.distributed` starts.

    Args:
      configured: the config's `distributed.process_id` (None: not set).
      environ: the environment (`$JAX_PROCESS_ID`, or Slurm's `$SLURM_PROCID` when Slurm runs several tasks).

    Returns:
      The index, or None when nothing names one (one process, or JAX's own detection decides).
    """
    if isinstance(configured, int) and not isinstance(configured, bool):
        return configured
    for value in (environ.get(ENV_ID),
                  environ.get("SLURM_PROCID") if int(environ.get("SLURM_NTASKS", "1") or 1) > 1 else None):
        if value is not None and value.strip().isdigit():
            return int(value)
    return None
