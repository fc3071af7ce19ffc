"""Starting JAX's distributed runtime for a run over several processes (hosts).

rlbolt does not manage a cluster: every process runs the same command, and `initialize` calls
`jax.distributed.initialize`, which connects the processes through a coordinator (process 0).
Where the values come from, first match wins:

1. arguments (the config's `distributed` section);
2. the environment: `JAX_COORDINATOR_ADDRESS` (`host:port` of process 0), `JAX_NUM_PROCESSES`,
   `JAX_PROCESS_ID`;
3. JAX's cluster detection (Slurm, Cloud TPU, Open MPI, Kubernetes) when `mode="on"`, or in
   `mode="auto"` when Slurm runs more than one task.

Call it before anything touches a device (building a model does): `rlbolt fit` does so first.
With `$RLBOLT_TRANSFER_ADDRESS` (`host:port`, one per process) it also sets where this process
serves cross-host array transfers (`rlbolt.distributed.weight_push`; CPU and GPU need it).

A dead process: JAX's coordination service notices a process whose heartbeats stop after
`heartbeat_timeout_s`, and terminates every other process with an error; a collective that
loses its peer fails at once. Either way a run never waits forever on a dead peer.
"""

from __future__ import annotations

import logging
import os

import jax

from rlbolt.utils.jax_env import ENV_ADDRESS, ENV_COUNT, ENV_ID, ENV_TRANSFER

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")
DEFAULT_HEARTBEAT_TIMEOUT_S = 30


def initialize(mode: str = "auto", *, coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
               initialization_timeout_s: int = 300) -> bool:
    """Starts `jax.distributed` when this run spans several processes; a no-op otherwise.

    Args:
      mode: "auto" (start when an address or process count is given here or in the environment,
        or Slurm runs > 1 task), "on" (always; JAX detects TPU / Slurm / MPI / Kubernetes
        settings that are not given), "off" (never: one process).
      coordinator_address: `host:port` of process 0 (default `$JAX_COORDINATOR_ADDRESS`).
      num_processes: how many processes take part (default `$JAX_NUM_PROCESSES`).
      process_id: this process's index, 0 .. num_processes - 1 (default `$JAX_PROCESS_ID`).
      heartbeat_timeout_s: a process silent this long is declared dead and the others stop.
      initialization_timeout_s: how long to wait for every process to connect.

    Returns:
      True when the distributed runtime runs (started now or before), False for one process.

    Raises:
      ValueError: an unknown mode, or a partial set of values (an address without a count).
    """
    if mode not in MODES:
        raise ValueError(f"distributed.mode={mode!r}; use one of {MODES}")
    if is_initialized():
        return True
    address = coordinator_address or os.environ.get(ENV_ADDRESS) or None
    count = num_processes if num_processes is not None else _env_int(ENV_COUNT)
    index = process_id if process_id is not None else _env_int(ENV_ID)
    slurm_tasks = _env_int("SLURM_NTASKS") or 0
    if mode == "off" or (mode == "auto" and address is None and count is None and slurm_tasks < 2):
        return False
    if mode == "auto" and slurm_tasks < 2 and (address is None or count is None or index is None):
        missing = [n for n, v in (("coordinator_address", address), ("num_processes", count), ("process_id", index)) if v is None]
        raise ValueError(f"distributed: {missing} not set (config distributed.* or ${ENV_ADDRESS} / ${ENV_COUNT} / "
                         f"${ENV_ID}); give all three, or distributed.mode=on to let JAX detect a TPU/Slurm/MPI cluster")
    if count == 1:
        return False
    # CPU collectives across processes (tests, CPU clusters); GPU and TPU backends ignore it.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if os.environ.get(ENV_TRANSFER):  # where this process serves the weight push between process groups
        jax.config.update("jax_cross_host_transfer_socket_address", os.environ[ENV_TRANSFER])
    jax.distributed.initialize(address, count, index, heartbeat_timeout_seconds=int(heartbeat_timeout_s),
                               initialization_timeout=int(initialization_timeout_s))
    log.info("jax.distributed: process %d of %d (coordinator %s)", jax.process_index(), jax.process_count(), address)
    return True


def is_initialized() -> bool:
    """Whether `jax.distributed` runs in this process."""
    from jax._src import distributed  # the public module has no query for it

    return distributed.global_state.client is not None


def is_main_process() -> bool:
    """True on process 0, the one that writes metrics, logs, plots and run-directory files."""
    return jax.process_index() == 0


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name}={raw!r} must be an integer") from None
