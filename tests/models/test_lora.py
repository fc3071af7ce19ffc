"""LoRA adapters on the fused decoder kernels, checked against float64 NumPy and hand counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import EPS32, decoder_tolerance, dot_error_bound
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.lora import TARGETS, LoraConfig, apply_lora, lora_param_count, merge_adapters

# hidden 64, 4 query heads and 2 kv heads of 16 (q 64, k 32, v 32 columns of qkv_proj), MLP 96
CONFIG = tiny_config(vocab_size=40, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=96)


@pytest.fixture(scope="module")
def base():
    return Decoder(CONFIG, rngs=nnx.Rngs(0))


def _randomise(model, seed=1, scale=0.2):
    """Non-zero A and B everywhere (B starts at zero, which would hide every bug)."""
    adapters = nnx.state(model, nnx.LoRAParam)
    rng = np.random.default_rng(seed)  # NumPy: eager jax.random compiles its programs for every adapter shape
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(scale * rng.standard_normal(x.shape), x.dtype), adapters))
    return model


@jax.jit(static_argnums=0)
def _forward(graphdef, state, ids, pos):
    return nnx.merge(graphdef, state)(ids, pos)[0]


def _logits(model, ids, pos):  # jitted, and unlike nnx.jit it leaves the model's arrays as they are
    return _forward(*nnx.split(model), ids, pos)


def _ids():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CONFIG.vocab_size, (2, 7)).astype(np.int32)
    return ids, np.broadcast_to(np.arange(7, dtype=np.int32), ids.shape)


@pytest.mark.parametrize("targets, per_layer", [
    # r * (in + out) per target, written out from CONFIG: H=64, q=64, kv=32, I=96, rank 4
    (("q",), 4 * (64 + 64)),
    (("q", "v"), 4 * (64 + 64) + 4 * (64 + 32)),
    (TARGETS, 4 * ((64 + 64) + (64 + 32) + (64 + 32) + (64 + 64) + (64 + 96) + (64 + 96) + (96 + 64))),
])
def test_trainable_count_is_the_lora_formula(base, targets, per_layer):
    adapted = apply_lora(base, LoraConfig(rank=4, alpha=8, targets=targets), rngs=nnx.Rngs(1))
    adapters = nnx.state(adapted, nnx.LoRAParam)
    assert sum(x.size for x in jax.tree.leaves(adapters)) == 2 * per_layer
    assert lora_param_count(CONFIG, LoraConfig(rank=4, targets=targets)) == 2 * per_layer


def test_apply_lora_shares_the_base_and_starts_as_the_base(base):
    adapted = apply_lora(base, LoraConfig(rank=4, alpha=8), rngs=nnx.Rngs(1))
    plain = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(base, nnx.Param))}
    frozen = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(adapted, nnx.Not(nnx.LoRAParam)))}
    assert plain.keys() == frozen.keys() and all(frozen[p] is plain[p] for p in plain)  # the same arrays: no copy
    assert base.layers[0].attn.qkv_proj.lora is None  # the base model is left as it was
    ids, pos = _ids()
    # B = 0: the adapted graph computes the base's math through other fusions (float32 rounding may differ)
    want = np.asarray(_logits(base, ids, pos))
    np.testing.assert_allclose(np.asarray(_logits(adapted, ids, pos)), want, rtol=0,
                               atol=decoder_tolerance(want, CONFIG, 7, adapter_rank=4))


@pytest.mark.parametrize("targets, dense, block", [
    (("q",), "attn.qkv_proj", slice(0, 64)),
    (("v",), "attn.qkv_proj", slice(96, 128)),
    (("up",), "mlp.gate_up_proj", slice(96, 192)),
    (("down",), "mlp.down_proj", slice(0, 64)),
])
def test_a_target_on_a_fused_kernel_changes_only_its_own_columns(base, targets, dense, block):
    lora = LoraConfig(rank=3, alpha=7.5, targets=targets)
    adapted = _randomise(apply_lora(base, lora, rngs=nnx.Rngs(2)))
    block_name, name = dense.split(".")
    layer = adapted.layers[1]
    module = getattr(getattr(layer, block_name), name)
    x = np.random.default_rng(3).standard_normal((5, module.kernel.shape[0])).astype(np.float32)
    got = np.asarray(module(jnp.asarray(x)), np.float64)
    kernel = np.asarray(module.kernel[...], np.float64)
    pair = getattr(module.lora, targets[0])
    a, b = np.asarray(pair.lora_a[...], np.float64), np.asarray(pair.lora_b[...], np.float64)
    want = x.astype(np.float64) @ kernel
    want[:, block] += (alpha_over_r := 7.5 / 3) * (x.astype(np.float64) @ a @ b)
    # float32 against float64: the base product's bound plus the adapter path's (x A: K terms, then B: r terms)
    adapter_bound = (a.shape[0] + a.shape[1]) * EPS32 * (np.abs(x) @ np.abs(a) @ np.abs(b)) * alpha_over_r
    np.testing.assert_allclose(got[:, block], want[:, block], rtol=0,
                               atol=(dot_error_bound(x, kernel)[:, block] + adapter_bound).max())
    outside = np.ones(kernel.shape[1], bool)
    outside[block] = False
    # Outside the block the adapter adds nothing: the plain product, to float32 rounding (XLA may block
    # the fused [5, K] x [K, N] product differently from any other, so bits are not the contract here).
    plain, bound = x.astype(np.float64) @ kernel, dot_error_bound(x, kernel)
    assert np.all(np.abs(got[:, outside] - plain[:, outside]) <= bound[:, outside])
    assert np.abs(got[:, block] - plain[:, block]).max() > 1e3 * bound.max()  # inside, the adapter shows
    assert alpha_over_r == lora.scale


def test_merged_model_computes_the_adapted_model(base):
    adapted = _randomise(apply_lora(base, LoraConfig(rank=4, alpha=16, targets=("q", "k", "o", "gate", "down")),
                                    rngs=nnx.Rngs(3)))
    merged = merge_adapters(adapted)
    assert all(getattr(getattr(l, b), d).lora is None for l in merged.layers
               for b, d in (("attn", "qkv_proj"), ("attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj")))
    assert not jax.tree.leaves(nnx.state(merged, nnx.LoRAParam))
    ids, pos = _ids()
    got, want, before = (np.asarray(_logits(m, ids, pos)) for m in (merged, adapted, base))
    np.testing.assert_allclose(got, want, atol=decoder_tolerance(want, CONFIG, 7, adapter_rank=4), rtol=0)
    assert np.abs(want - before).max() > 0.1  # the adapters matter, so the check above could fail
    # merging wrote new kernels: the adapted model's base is untouched
    assert adapted.layers[0].attn.qkv_proj.kernel.get_value() is base.layers[0].attn.qkv_proj.kernel.get_value()


def test_gradient_reaches_only_the_adapters(base):
    adapted = apply_lora(base, LoraConfig(rank=2, alpha=4, targets=("v", "up")), rngs=nnx.Rngs(4))
    graphdef, adapters, frozen = nnx.split(adapted, nnx.LoRAParam, ...)
    ids, pos = _ids()

    def loss(adapters, frozen):
        logits, _ = nnx.merge(graphdef, frozen, adapters)(ids, pos)
        return jnp.mean(logits ** 2)

    grads = jax.jit(jax.grad(loss))(adapters, frozen)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    # B = 0 at the start, so dL/dA = 0 and dL/dB carries the whole signal
    flat = {p[-2:]: v.get_value() for p, v in nnx.to_flat_state(grads)}
    assert all(float(jnp.abs(v).max()) == 0.0 for k, v in flat.items() if k[1] == "lora_a")
    assert all(float(jnp.abs(v).max()) > 0.0 for k, v in flat.items() if k[1] == "lora_b")


@pytest.mark.parametrize("values, message", [
    ({"rank": 0}, r"model\.lora\.rank=0 must be a positive integer"),
    ({"rank": 2.5}, r"model\.lora\.rank=2\.5"),
    ({"rank": True}, r"model\.lora\.rank=True"),
    ({"alpha": 0}, r"model\.lora\.alpha=0 must be a positive number"),
    ({"alpha": float("nan")}, r"model\.lora\.alpha=nan"),
    ({"alpha": "16"}, r"model\.lora\.alpha='16'"),
    ({"targets": []}, r"model\.lora\.targets=\[\] must be a non-empty list"),
    ({"targets": "q"}, r"model\.lora\.targets='q' must be a non-empty list"),
    ({"targets": ["q_proj"]}, r"unknown name\(s\) \['q_proj'\]; choose from \['q', 'k'"),
    ({"targets": ["q", "q"]}, r"names a projection twice"),
    ({"quantize": "fp8"}, r"model\.lora\.quantize='fp8'; use one of \['int8', 'int4', 'nf4'\]"),
    ({"rnak": 8}, r"unknown key\(s\) \['rnak'\]; allowed keys: \['rank', 'alpha', 'targets', 'quantize', 'rollout'\]"),
    ({"rollout": "fused"}, r"model\.lora\.rollout='fused'; use one of \['merged', 'adapters'\]"),
    ({"quantize": "nf4", "rollout": "merged"}, r"rollout='merged' would dequantise the nf4 base"),
    ([8, 16], r"model\.lora=\[8, 16\] must be a mapping"),
])
def test_lora_config_refuses_bad_values_in_one_line(values, message):
    with pytest.raises(ValueError, match=message) as error:
        LoraConfig.from_mapping(values)
    assert "\n" not in str(error.value)


def test_lora_config_defaults_and_plain_data():
    lora = LoraConfig.from_mapping({"rank": 4, "targets": ["v", "q"]})
    assert (lora.rank, lora.alpha, lora.targets, lora.quantize, lora.scale) == (4, 16.0, ("v", "q"), None, 4.0)
    assert lora.rollout == "merged" and LoraConfig.from_mapping({"quantize": "int8"}).rollout == "adapters"
    assert LoraConfig.from_mapping(lora.to_dict()) == lora
    with pytest.raises(ValueError, match=r"LoraConfig\.rank=-1"):
        LoraConfig(rank=-1)
