"""The expert-parallel case shared by test_moe_kernel_grads.py and test_expert_blocks.py, which prepend
this file to the scripts they run in a fresh process with 8 CPU devices: data 1 x fsdp 4 x expert 2, n tokens
of width h routed to k of e experts with intermediate size i, the kernels placed in their fsdp shards."""

import re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from rlbolt.distributed import MeshSpec
from rlbolt.models.moe import expert_parallel_experts
mesh = MeshSpec(fsdp=4, expert=2).build()
n, h, i, e, k = 32, 16, 8, 4, 2
rows = NamedSharding(mesh, P(("data", "fsdp", "expert")))
specs = (P("expert", "fsdp", None), P("expert", None, "fsdp"))
keys = jax.random.split(jax.random.key(0), 5)
x = jax.device_put(jax.random.normal(keys[0], (n, h)), rows)
experts = jax.device_put(jax.random.randint(keys[1], (n, k), 0, e), rows)
weights = jax.device_put(jax.nn.softmax(jax.random.normal(keys[2], (n, k))), rows)
gate_up = jax.device_put(jax.random.normal(keys[3], (e, h, 2 * i)) * 0.3, NamedSharding(mesh, specs[0]))
down = jax.device_put(jax.random.normal(keys[4], (e, i, h)) * 0.3, NamedSharding(mesh, specs[1]))
