"""Mixture-of-experts layers stored stacked (`model.scan_layers` without routing features) on an expert mesh:
8 CPU devices (data 1 x fsdp 4 x expert 2) in a fresh process, megablox gmm in Pallas' interpret mode under
the shard_map over every axis (as on TPU), its kernels gathered in blocks of the intermediate dim
(`model.expert_block_size`). The stacked model's scanned update gives the per-layer model's (scanned with a
`jnp.stack` of every layer's kernels per forward, what main ran) logits and gradients, each gradient in its
parameter's stored sharding; the stacked block carries one layer's kernel specs, which its views see, and a
forward with a KV cache over the views gives the per-layer model's logits.

Tolerances: both run the same scanned body over the same values; only the stack copy and what XLA fuses
around it differ, so `decoder_tolerance` of the logits (another fusion of the same ops), and for the
gradients 3x that bound of their own magnitude, as tests/models/test_scan_layers.py explains."""

import numpy as np
import pytest
from cpu_devices import run_on_cpu_devices
from float_tolerance import decoder_tolerance

SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from rlbolt.distributed import MeshSpec, ShardingPlan
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.cache import init_cache
from rlbolt.models.moe import moe_layers
from rlbolt.models.stacked_layers import is_stacked, stack_layers, unstack_layer_state

plan = ShardingPlan(MeshSpec(fsdp=4, expert=2).build())
config = tiny_config(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=3,
                     architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, norm_topk_prob=True)
ids = jax.random.randint(jax.random.key(1), (8, 12), 0, config.vocab_size)
mask = jnp.arange(12)[None] >= (jnp.arange(8) % 4)[:, None]  # left padding of varied lengths
positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
ids, mask, positions = plan.put_full((ids, mask, positions))


def build(stacked):
    model = Decoder(config, rngs=nnx.Rngs(3))
    nnx.update(model, jax.tree.map(lambda x: x * 4 if x.ndim >= 2 else x, nnx.state(model, nnx.Param)))
    model.scan_layers, model.remat = True, "full"
    if stacked:
        stack_layers(model)
    nnx.update(model, plan.place(nnx.state(model)))
    plan.shard_activations(model)
    for block in moe_layers(model):
        block.matmul, block.block_size = "gmm-interpret", 8  # 2 blocks of the intermediate dim
    return model


def loss_and_grads(model):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        logits = nnx.merge(graphdef, p)(ids, positions, attention_mask=mask)[0]
        return jnp.sum(jnp.where(mask, jax.nn.log_softmax(logits)[..., 3], 0.0)), logits

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    jaxpr = str(step.trace(params).jaxpr)
    (_, logits), grads = step(params)
    return jaxpr, logits, grads


def cached(model):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        m = nnx.merge(graphdef, state)
        logits, cache = m(ids, positions, attention_mask=mask, cache=init_cache(m.config, 8, 13))
        step, _ = m(ids[:, :1], positions[:, -1:] + 1, cache=cache)
        return logits[:, -1], step[:, 0]

    return run(state)


per_layer, stacked = build(False), build(True)
assert is_stacked(stacked) and not is_stacked(per_layer)
(block,) = moe_layers(stacked)
ref = per_layer.layers[0].mlp
assert block.kernel_specs == ref.kernel_specs == (P("expert", "fsdp", None), P("expert", None, "fsdp")), block.kernel_specs
assert block.expert_mesh is plan.mesh and block.row_mesh is plan.mesh
view = stacked.layers[2].mlp
assert (view.kernel_specs, view.expert_mesh, view.matmul, view.block_size) == (ref.kernel_specs, plan.mesh, "gmm-interpret", 8)
assert str(block.gate_up.get_value().sharding.spec) == str(P(None, "expert", "fsdp", None))

copying, loop_logits, loop_grads = loss_and_grads(per_layer)
jaxpr, logits, grads = loss_and_grads(stacked)
assert " stack[" in copying and " stack[" not in jaxpr and "pallas_call" in jaxpr
for name in ("gate_up", "down"):  # the stacked expert kernels' gradients formed in their [L, E, ...] shards
    g, p = grads["layers"]["block"]["mlp"][name][...], getattr(block, name).get_value()
    assert g.sharding.is_equivalent_to(p.sharding, 4), (name, g.sharding, p.sharding)
grads = unstack_layer_state(grads)
assert jax.tree.structure(grads) == jax.tree.structure(loop_grads)
names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(loop_grads)]
out = {"logits": np.asarray(logits), "loop_logits": np.asarray(loop_logits), "mask": np.asarray(mask)}
for name, g, r in zip(names, jax.tree.leaves(grads), jax.tree.leaves(loop_grads)):
    out["grad" + name], out["loop_grad" + name] = np.asarray(g), np.asarray(r)
for j, (a, b) in enumerate(zip(cached(stacked), cached(per_layer))):
    out[f"cached{j}"], out[f"loop_cached{j}"] = np.asarray(a), np.asarray(b)
np.savez(sys.argv[1], **out)
print("ok")
"""


@pytest.mark.slow  # about 80 s of CPU (gmm interpreted, two models' grads); the default tier checks
def test_a_stacked_moe_model_on_an_expert_mesh_equals_the_per_layer_model(tmp_path):  # the specs (test_expert_mesh.py)
    from rlbolt.models import tiny_config

    done = run_on_cpu_devices(SCRIPT, str(tmp_path / "out.npz"))
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stderr[-3000:]
    out = dict(np.load(tmp_path / "out.npz"))
    config = tiny_config(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=3,
                         architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, norm_topk_prob=True)  # the script's
    mask = out.pop("mask")[..., None]
    want = np.where(mask, out.pop("loop_logits"), 0.0)
    np.testing.assert_allclose(np.where(mask, out.pop("logits"), 0.0), want, rtol=0,
                               atol=decoder_tolerance(want, config, 12))
    for name in [n for n in out if n.startswith("loop_cached")]:  # the views' forward with a KV cache
        ref = out.pop(name)
        np.testing.assert_allclose(out.pop(name[len("loop_"):]), ref, rtol=0, atol=decoder_tolerance(ref, config, 13))
    names = [n for n in out if n.startswith("loop_grad")]
    assert len(names) == 3 + 9 * 3  # embed, final norm, lm_head + 9 kinds per layer (qk norms, router, experts)
    for name in names:
        ref = out.pop(name)
        got = out.pop(name[len("loop_"):])
        np.testing.assert_allclose(got, ref, rtol=0, atol=3 * decoder_tolerance(ref, config, 12) + 1e-30, err_msg=name)
        assert np.any(got != 0), name
    assert not out
