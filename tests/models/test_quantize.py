"""QLoRA's quantised base through qwix: what is stored, what it computes, and its dequantised twin."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from float_tolerance import decoder_tolerance, log_softmax_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.lora import LoraConfig, apply_lora, merge_adapters
from rlbolt.models.quantize import dequantize_model, quantize_base
from rlbolt.rollout import NativeSampler, token_logps

CONFIG = tiny_config(vocab_size=48, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                     intermediate_size=128)
PROJECTIONS = ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@jax.jit(static_argnums=0)
def _forward(graphdef, state, ids, pos):
    return nnx.merge(graphdef, state)(ids, pos)[0]


# the training forward jitted as the trainer runs it (op by op, every primitive of every shape compiles)
_token_logps = jax.jit(token_logps, static_argnums=0, static_argnames=("group_size",))


def _logits(model):
    ids = (jnp.arange(14).reshape(2, 7) * 5) % CONFIG.vocab_size
    return np.asarray(_forward(*nnx.split(model), ids, jnp.broadcast_to(jnp.arange(7), ids.shape)))


@pytest.fixture(scope="module")
def adapted():
    model = Decoder(CONFIG, rngs=nnx.Rngs(0))
    adapted = apply_lora(model, LoraConfig(rank=4, alpha=8, targets=("q", "down")), rngs=nnx.Rngs(1))
    adapters = nnx.state(adapted, nnx.LoRAParam)
    rng = np.random.default_rng(0)  # NumPy: eager jax.random compiles its programs for every adapter shape
    nnx.update(adapted, jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype), adapters))
    return model, adapted


def _dense(model, layer, path):
    block, name = path.split(".")
    return getattr(getattr(model.layers[layer], block), name)


@pytest.fixture(scope="module")
def quantized(adapted):
    return {qtype: quantize_base(adapted[1], qtype) for qtype in ("int8", "nf4")}


@pytest.fixture(scope="module")
def dequantized(quantized):
    """Each quantised model's plain Decoder twin, built once for the tests that read it."""
    return {qtype: dequantize_model(model) for qtype, model in quantized.items()}


@pytest.mark.parametrize("qtype, stored, max_error", [("int8", np.int8, 0.01), ("nf4", ml_dtypes.uint4, 0.3)])
def test_projection_kernels_are_stored_quantised_and_the_rest_is_shared(adapted, quantized, qtype, stored, max_error):
    model, lora_model = adapted
    quantized = quantized[qtype]
    for path in PROJECTIONS:
        qvalue = _dense(quantized, 0, path).kernel.array.qvalue.get_value()
        assert qvalue.dtype == stored and qvalue.shape == _dense(model, 0, path).kernel.shape
    # embeddings, norms and the adapters are the same arrays, not quantised copies
    assert quantized.embed.embedding.get_value() is model.embed.embedding.get_value()
    assert quantized.layers[1].mlp.down_proj.lora.down.lora_b.get_value() is \
        lora_model.layers[1].mlp.down_proj.lora.down.lora_b.get_value()
    # the quantised policy stays close to the float one (by the quantisation error, not exactly)
    error = np.abs(_logits(quantized) - _logits(lora_model)).max()
    assert 0 < error < max_error


def test_dequantized_model_computes_the_quantised_one(quantized, dequantized):
    quantized, plain = quantized["nf4"], dequantized["nf4"]
    assert type(plain) is Decoder and isinstance(_dense(plain, 1, "attn.o_proj").kernel, nnx.Param)
    # the same math through qwix's interception against a plain Decoder: two float32 graphs
    want = _logits(quantized)
    np.testing.assert_allclose(_logits(plain), want, atol=decoder_tolerance(want, CONFIG, 7), rtol=0)
    # the dequantised kernel is what the 4-bit values and their block scales encode, so the merged
    # export of a QLoRA policy is that policy
    np.testing.assert_allclose(_logits(merge_adapters(plain)), want, atol=decoder_tolerance(want, CONFIG, 7), rtol=0)


@pytest.mark.parametrize("qtype", ["int8", "nf4"])
def test_prompt_shared_passes_run_the_quantised_kernels(quantized, dequantized, qtype):
    """The prompt-shared training forward and the sampler's decode step call the layers outside
    `__call__`: they must go through the same qwix interception (they once handed the quantised
    kernels to a plain matmul: a TypeError in every QLoRA rollout). Reference: the dequantised twin,
    a plain Decoder, unshared (independent of the interception)."""
    quantized, plain = quantized[qtype], dequantized[qtype]
    rng = np.random.default_rng(0)
    prompts = [p for p in (rng.integers(1, CONFIG.vocab_size, n).tolist() for n in (5, 3)) for _ in range(2)]
    out = NativeSampler(quantized, max_new_tokens=6, temperature=1.0, prompt_buckets=(8,)).generate(
        prompts, np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 4)), np.uint32))
    batch = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    reference = _token_logps(*nnx.split(plain), *batch)
    shared = _token_logps(*nnx.split(quantized), *batch, group_size=2)
    # log-probs of two float32 graphs of the network (logits of this tiny model stay below 8)
    tolerance = log_softmax_tolerance(decoder_tolerance(8.0, CONFIG, batch[0].shape[1] + batch[2].shape[1]),
                                      CONFIG.vocab_size)
    np.testing.assert_allclose(shared, reference, atol=tolerance, rtol=0)
    np.testing.assert_allclose(out.logps, reference, atol=tolerance, rtol=0)  # what the sampler computed while decoding


def test_gradient_flows_to_the_adapters_through_the_quantised_base(quantized):
    graphdef, adapters, frozen = nnx.split(quantized["int8"], nnx.LoRAParam, ...)
    ids = jnp.arange(6)[None] % CONFIG.vocab_size
    loss = lambda a, f: jnp.mean(nnx.merge(graphdef, f, a)(ids, jnp.arange(6)[None])[0] ** 2)
    grads = jax.jit(jax.grad(loss))(adapters, frozen)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_four_bit_blocks_need_widths_divisible_by_64():
    narrow = nnx.eval_shape(lambda: Decoder(tiny_config(vocab_size=16, hidden_size=32, num_heads=2, num_kv_heads=1,
                                                        head_dim=16, intermediate_size=64), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"quantize='nf4' uses blocks of 64 inputs, but \{'hidden_size': 32"):
        quantize_base(narrow, "nf4")
