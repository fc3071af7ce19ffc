"""The dense MLP in weight blocks (`model.mlp_block_size`, rlbolt.models.mlp_blocks): the values and
gradients of the whole-kernel MLP, and on a mesh that splits the kernels' hidden dim no device
gathers a whole kernel or forms a whole kernel's gradient.

Tolerances: against float64 (below) each output is built from float32 products of length H and I
chained through the activation, so it may differ by (H + I) eps32 per unit of its terms'
magnitude (Higham Eq. 3.5); the bound takes 8x that of the largest term. Blocks against whole
kernels on 8 devices: `decoder_tolerance`-style, the same 8x bound of each array's own magnitude.
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from float_tolerance import EPS32
from rlbolt.models.decoder_layer import _geglu_tanh, _swiglu
from rlbolt.models.mlp_blocks import block_count, mlp_in_blocks
from cpu_devices import child_env, run_on_cpu_devices


def test_block_count_is_the_fewest_dividing_blocks_within_the_size():
    # Qwen2.5-7B / 32B, Llama-3.1-70B, Qwen2.5-1.5B, Gemma-3-12B: by hand, the first divisor >= I / 2048
    assert [block_count(i, 2048) for i in (18944, 27648, 28672, 8960, 15360)] == [16, 16, 14, 5, 8]
    assert block_count(2048, 2048) == 1 and block_count(2049, 2048) == 3  # 2049 = 3 x 683, 683 >= 2048 / 4
    assert block_count(4099, 2048) == 1  # prime: its divisor 4099 would give blocks of one unit
    assert block_count(2 * 4099, 2048) == 1  # the first divisor >= 5 is 4099: blocks of 2 units
    assert block_count(18944, 0) == 1 and block_count(64, 16) == 4 and block_count(96, 40) == 3


def _silu(v):
    return v / (1 + np.exp(-v))


def _gelu_tanh(v):
    return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))


def _reference(x, gate_up, down, d_y, act):
    """float64 values and (d_x, d_gate_up, d_down), by hand."""
    x, gate_up, down, d_y = (np.asarray(a, np.float64) for a in (x, gate_up, down, d_y))
    i = down.shape[0]
    g, u = np.split(x @ gate_up, 2, axis=-1)
    f = _silu if act is _swiglu else _gelu_tanh
    if act is _swiglu:
        s = 1 / (1 + np.exp(-g))
        df = s * (1 + g * (1 - s))
    else:
        c = np.sqrt(2 / np.pi)
        t = np.tanh(c * (g + 0.044715 * g ** 3))
        df = 0.5 * (1 + t) + 0.5 * g * (1 - t ** 2) * c * (1 + 3 * 0.044715 * g ** 2)
    h = f(g) * u
    y = h @ down
    d_h = d_y @ down.T
    d_gu = np.concatenate([d_h * u * df, d_h * f(g)], axis=-1)
    rows = x.reshape(-1, x.shape[-1])
    d_gate_up = rows.T @ d_gu.reshape(-1, 2 * i)
    d_down = h.reshape(-1, i).T @ d_y.reshape(-1, d_y.shape[-1])
    return y, (d_gu @ gate_up.T, d_gate_up, d_down)


@pytest.mark.parametrize("act", [_swiglu, _geglu_tanh])
def test_blocks_match_float64_with_hostile_sizes(act):
    """3 blocks of 4 units, 3 positions per piece of 7 (the last piece padded), batch of 2 and of 1."""
    h, i = 8, 12
    k = jax.random.split(jax.random.key(0), 4)
    for b in (2, 1):
        x = jax.random.normal(k[0], (b, 7, h)) * 3.0  # large enough that the activation's tails matter
        gate_up, down = jax.random.normal(k[1], (h, 2 * i)) * 0.5, jax.random.normal(k[2], (i, h)) * 0.5
        d_y = jax.random.normal(k[3], (b, 7, h))
        y, vjp = jax.vjp(jax.jit(lambda *a: mlp_in_blocks(*a, activate=act, blocks=3, positions=3, sharding=None)),
                         x, gate_up, down)
        ref_y, ref_grads = _reference(x, gate_up, down, d_y, act)
        for got, want in zip((y, *vjp(d_y)), (ref_y, *ref_grads)):
            bound = 8 * (h + i) * EPS32 * np.abs(want).max()
            np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=bound)


MESH = r"""
import re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rlbolt.models.decoder_layer import _swiglu
from rlbolt.models.mlp_blocks import mlp_in_blocks
mesh = Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))
b, t, h, i, k = 8, 24, 64, 128, 4
rows = NamedSharding(mesh, P("fsdp", None, None))
stored = NamedSharding(mesh, P("fsdp", None))
down_stored = NamedSharding(mesh, P(None, "fsdp"))
def whole(x, gate_up, down):
    return jnp.dot(_swiglu(x @ gate_up), down)
def blocked(x, gate_up, down):
    return mlp_in_blocks(x, gate_up, down, activate=_swiglu, blocks=k, positions=16, sharding=stored)
def loss(fn):
    return lambda x, gate_up, down: jnp.sum(fn(x, gate_up, down) * jnp.linspace(-1, 2, h))
keys = jax.random.split(jax.random.key(1), 3)
args = (jax.device_put(jax.random.normal(keys[0], (b, t, h)), rows),
        jax.device_put(jax.random.normal(keys[1], (h, 2 * i)) * 0.2, stored),
        jax.device_put(jax.random.normal(keys[2], (i, h)) * 0.2, down_stored))
shard = (rows, stored, down_stored)
outs = {}
for name, fn in (("whole", whole), ("blocked", blocked)):
    step = jax.jit(jax.value_and_grad(loss(fn), (0, 1, 2)), out_shardings=(None, shard))
    outs[name] = jax.jit(fn)(*args), step(*args)[1]
    hlo = step.lower(*args).compile().as_text()
    gathers = [tuple(int(d) for d in dims.split(",") if d != "1") for line in hlo.splitlines()
               for m in [re.search(r"= (\S+) all-gather(-start)?\(", line)] if m
               for dims in re.findall(r"\[([\d,]+)\]", m.group(1))]
    whole_kernel = {(h, 2 * i), (i, h), (2 * i, h), (h, i)}
    if name == "blocked":
        assert not whole_kernel & set(gathers), f"a whole kernel is gathered: {sorted(set(gathers))}"
        assert (h, 2 * i // k) in gathers and (i // k, h) in gathers, f"no block gathered (blind): {sorted(set(gathers))}"
        assert not re.search(r"f32\[%d,%d\]\S* (all-reduce|reduce-scatter)" % (h, 2 * i), hlo), "a whole gradient is summed"
    else:
        assert whole_kernel & set(gathers), f"the whole-kernel MLP no longer gathers its kernels (blind): {sorted(set(gathers))}"
(l0, g0), (l1, g1) = outs["whole"], outs["blocked"]
bound = lambda a: 8 * (h + i) * np.finfo(np.float32).eps * float(np.abs(np.asarray(a)).max())
np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), rtol=0, atol=bound(l0))
for a, c, s in zip(g0, g1, shard):
    assert c.sharding.is_equivalent_to(s, c.ndim), (c.sharding, s)
    np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=0, atol=bound(a))
print("ok")
"""


def test_blocks_on_an_fsdp_mesh_gather_one_block_and_match_whole_kernels():
    """8 CPU devices (a fresh process), fsdp over the hidden dim: the blocked MLP's compiled step
    gathers [H, 2I / k] and [I / k, H] blocks, never a whole kernel, and sums no whole gradient;
    the whole-kernel MLP gathers whole kernels (the check is not blind); losses and gradients match,
    gradients in the kernels' own shardings."""
    out = run_on_cpu_devices(MESH)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


DECODER = r"""
import re
import jax
jax.config.update("jax_num_cpu_devices", 8)
import jax.numpy as jnp, numpy as np
from flax import nnx
from rlbolt.distributed import MeshSpec, ShardingPlan
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.logps import token_logps
plan = ShardingPlan(MeshSpec(fsdp=8).build())
GEMMA3 = dict(architecture="Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh", norm_unit_offset=True,
              sandwich_norms=True, scale_embeddings=True, qk_norm=True, sliding_window=4, rope_local_theta=10.0,
              rope_theta=1e6, layer_types=("sliding_attention", "full_attention"), tie_word_embeddings=True)
keys = jax.random.split(jax.random.key(2), 2)
prompt = jax.random.randint(keys[0], (8, 6), 1, 128)
prompt_mask = jnp.arange(6)[None] >= jnp.asarray([0, 2, 0, 1, 0, 0, 3, 0])[:, None]
completion = jax.random.randint(keys[1], (8, 11), 1, 128)
completion_mask = jnp.arange(11)[None] < jnp.asarray([11, 4, 11, 1, 7, 11, 9, 2])[:, None]
weights = jnp.linspace(-1.0, 2.0, 11)
for name, fields, remat, scan in (("qwen2", {}, "full", True), ("gemma3", GEMMA3, "none", False)):
    config = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, **fields)
    model = plan.shard_activations(plan.build_module(lambda: Decoder(config, rngs=nnx.Rngs(3))))
    assert model.mlp_weight_sharding is not None, "the mesh's fsdp axis splits H: blocks apply"
    model.remat, model.scan_layers, model.mlp_chunk_positions = remat, scan, 7
    results = {}
    for block in (0, 32):  # 3 blocks of 32 units
        model.mlp_block_size = block
        graphdef, params = nnx.split(model)
        def loss(p):
            logps = token_logps(graphdef, p, prompt, prompt_mask, completion, completion_mask)
            return jnp.sum(jnp.where(completion_mask, logps * weights, 0.0)), logps
        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        gathers = {tuple(int(d) for d in dims.split(",") if d != "1") for line in step.lower(params).compile().as_text().splitlines()
                   for m in [re.search(r"= (\S+) all-gather(-start)?\(", line)] if m for dims in re.findall(r"\[([\d,]+)\]", m.group(1))}
        assert ((64, 192) in gathers) == (block == 0), (name, block, sorted(gathers))
        (_, logps), grads = step(params)
        results[block] = (np.where(completion_mask, logps, 0.0), grads)
    (l0, g0), (l1, g1) = results[0], results[32]
    bound = lambda a: 8 * (64 + 96) * config.num_layers * np.finfo(np.float32).eps * float(np.abs(np.asarray(a)).max())
    np.testing.assert_allclose(l1, l0, rtol=0, atol=bound(l0))
    for (path, a), (_, c) in zip(jax.tree_util.tree_leaves_with_path(g0), jax.tree_util.tree_leaves_with_path(g1)):
        np.testing.assert_allclose(np.asarray(c), np.asarray(a), rtol=0, atol=bound(a) + 1e-30, err_msg=str(path))
print("ok")
"""


@pytest.mark.slow
def test_decoder_with_mlp_blocks_on_an_fsdp_mesh_gives_the_whole_kernels_logps_and_gradients():
    """8 CPU devices, fsdp 8, a Qwen2-shaped model scanned under full remat and a Gemma 3-shaped one
    (GeGLU, sandwich norms) looped, 7 positions per piece: logps and every gradient of
    `model.mlp_block_size` 32 (3 blocks) equal the whole kernels' (0), and only the latter gathers a whole
    gate|up kernel. Tolerance: the bound above per layer of depth, of each array's own magnitude."""
    env = child_env(JAX_PLATFORMS="cpu")  # the script asks for its 8 devices itself
    out = subprocess.run([sys.executable, "-c", DECODER], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]
