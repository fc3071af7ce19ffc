"""The lm_head's weight gradient stays in the weight's sharding when the batch is sharded over devices.

Each device's tokens give it a partial sum of dW = h^T dz over the whole [H, V]; summed over token chunks
that partial sum was a whole float32 [H, V] per device (2 GiB at Qwen2.5-7B), all-reduced once at the end.
The backward now runs over vocabulary blocks, each block's columns whole after one pass, summed across
devices block by block into the weight's sharding. Read from the compiled HLO on 8 CPU devices (a fresh
process: the device count is fixed when JAX starts): no all-reduce of the whole [H, V] float32 gradient,
block-sized ones instead, and the backward loop carries the [H / 8, V] shard
(seen as [H / 8, width, k]: block j holds the columns j, j + k, ...). The forward too runs over
vocabulary blocks: no device gathers the whole [H, V] weight (over token chunks, each chunk gathered it
whole: 1 GiB per chip at Qwen2.5-7B)."""

import os

import pytest
from cpu_devices import run_on_cpu_devices

COMMON = r"""
import re, sys
import jax
import numpy as np
def collectives(hlo):
    # result shapes of every all-reduce / reduce-scatter (tuple results included)
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (\(.*?\)|\S+) (all-reduce|reduce-scatter)(-start)?\(", line)
        if m:
            out += [(dt, tuple(int(d) for d in dims.split(","))) for dt, dims in re.findall(r"(\w+)\[([\d,]+)\]", m.group(1))]
    return out
def gathered(hlo):
    # result shapes of every all-gather
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (\(.*?\)|\S+) all-gather(-start)?\(", line)
        if m:
            out += [tuple(int(d) for d in dims.split(",")) for _, dims in re.findall(r"(\w+)\[([\d,]+)\]", m.group(1))]
    return out
def loop_carries(hlo):
    return [[(dt, tuple(int(d) for d in dims.split(","))) for dt, dims in re.findall(r"(\w+)\[([\d,]+)\]", line.split(" while(")[0])]
            for line in hlo.splitlines() if " while(" in line]
def check(hlo, h, v, shards):
    f32 = [shape for dt, shape in collectives(hlo) if dt == "f32"]
    assert (h, v) not in f32, f"the whole [H, V] float32 gradient is all-reduced: {f32}"
    blocks = [s for s in f32 if len(s) == 2 and s[0] == h and s[1] < v]
    assert blocks, f"no [H, block] sum of the gradient found (the measure would be blind): {f32}"
    shard = [s for carry in loop_carries(hlo) for dt, s in carry if dt == "f32" and s[0] == h // shards
             and len(s) > 1 and int(np.prod(s[1:])) >= v]
    assert shard, "no loop carries the [H/8, V] shard"
    assert (h, v) not in gathered(hlo), f"the whole [H, V] weight is gathered: {sorted(set(gathered(hlo)))}"
    print("ok", sorted(set(blocks)))
"""

HEAD = COMMON + r"""
import jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rlbolt.models.lm_head_logps import lm_head_logps
mesh = Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))
b, c, h, v = 8, 24, 64, 512
rows, cols = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P("fsdp", None))
t = jax.ShapeDtypeStruct((b, c), jnp.int32, sharding=rows)
def loss(hidden, w, targets):
    lp, en = lm_head_logps(hidden, w, targets, chunk_tokens=48, with_entropy=True)
    return jnp.sum(lp) + jnp.sum(en)
grad = jax.jit(jax.grad(loss, (0, 1)), out_shardings=(NamedSharding(mesh, P("fsdp", None, None)), cols))
hlo = grad.lower(jax.ShapeDtypeStruct((b, c, h), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None, None))),
                 jax.ShapeDtypeStruct((h, v), jnp.bfloat16, sharding=cols), t).compile().as_text()
check(hlo, h, v, 8)
"""

UPDATE = COMMON + r"""
sys.path.insert(0, sys.argv[1])
from rlbolt.config import load_config
from rlbolt.planning import build_abstract
from rlbolt.planning.compile import _lower_update
from plan_tiny import H, RUN
V = 384  # not 256: the MLP's gate|up is [H, 256], gathered whole as every fsdp layer weight is
model = {**RUN["model"], "remat": "full", "logits_chunk_tokens": 32,  # 4 token chunks of the 8 x 16 completions
         "tiny": {**RUN["model"]["tiny"], "vocab_size": V}}
plan = {**RUN["plan"], "prompts_per_step": 4}  # two micro batches: the accumulation loop too
run = build_abstract(load_config({**RUN, "model": model, "plan": plan, "mesh": {"fsdp": -1}}), jax.devices())
assert run.plan.grad_accum_steps == 2
check(_lower_update(run).compile().as_text(), H, V, 8)
"""


def _run(script, *args):
    out = run_on_cpu_devices(script, *args, timeout=900)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


def test_the_head_gradient_is_summed_block_by_block_into_the_weights_sharding():
    _run(HEAD)


@pytest.mark.slow
def test_the_compiled_update_keeps_the_head_gradient_sharded():
    """The planner's update executable (GRPO, bf16 with float32 masters, two micro batches, fsdp 8)."""
    _run(UPDATE, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
