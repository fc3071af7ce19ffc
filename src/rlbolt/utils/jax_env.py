"""The environment variables that name a process's place in a multi-process run.

`rlbolt.distributed.runtime.initialize` reads them and `rlbolt launch` sets them; they live here,
apart from both, so the launcher can name them without importing JAX.
"""

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"  # host:port of process 0 (the coordinator)
ENV_COUNT = "JAX_NUM_PROCESSES"  # how many processes take part
ENV_ID = "JAX_PROCESS_ID"  # this process's index, 0 .. count - 1
ENV_LOCAL_DEVICES = "JAX_LOCAL_DEVICE_IDS"  # the accelerators this process takes (JAX reads it itself)
# host:port where this process serves cross-host array transfers (the weight push between groups of
# processes, `rlbolt.distributed.weight_push`) on backends without a native cross-host path (CPU, GPU)
ENV_TRANSFER = "RLBOLT_TRANSFER_ADDRESS"
