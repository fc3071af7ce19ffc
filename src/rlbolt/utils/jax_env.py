"""The environment variables that name a process's place in a multi-process run.

`rlbolt.distributed.runtime.initialize` reads them and `rlbolt launch` sets them; they live here,
apart from both, so the launcher can name them without importing JAX.
"""

ENV_ADDRESS = "JAX_COORDINATOR_ADDRESS"  # host:port of process 0 (the coordinator)
ENV_COUNT = "JAX_NUM_PROCESSES"  # how many processes take part
ENV_ID = "JAX_PROCESS_ID"  # this process's index, 0 .. count - 1
