"""Chunked token_logps vs a naive full-logits float64 reference; memory and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import decoder_logps_tolerance, decoder_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.rollout import left_pad_positions, token_logps, token_logps_and_entropy
from rollout_jit import forward_logits, token_logps as jitted_token_logps


def _batch(rng, vocab, b, p, c):
    prompt_ids = rng.integers(0, vocab, (b, p)).astype(np.int32)
    prompt_mask = np.zeros((b, p), bool)
    completion_ids = rng.integers(0, vocab, (b, c)).astype(np.int32)
    completion_mask = np.zeros((b, c), bool)
    for row in range(b):
        prompt_mask[row, rng.integers(0, p):] = True  # left padding
        completion_mask[row, : rng.integers(1, c + 1)] = True  # right padding
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _naive_reference(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """Full [B, T, V] logits, then float64 numpy log_softmax and entropy."""
    ids = np.concatenate([prompt_ids, completion_ids], 1)
    mask = np.concatenate([prompt_mask, completion_mask], 1)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    logits = forward_logits(model, jnp.asarray(ids), jnp.asarray(positions, jnp.int32), jnp.asarray(mask))
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    z = np.asarray(logits, np.float64)[:, p - 1: p + c - 1] / temperature
    z = z - z.max(-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    logps = np.take_along_axis(logp_all, completion_ids[..., None], -1)[..., 0]
    entropy = -(np.exp(logp_all) * logp_all).sum(-1)
    return np.where(completion_mask, logps, 0), np.where(completion_mask, entropy, 0)


def test_left_pad_positions():
    mask = jnp.array([[False, False, True, True], [True, True, True, True]])
    np.testing.assert_array_equal(left_pad_positions(mask), [[0, 0, 0, 1], [0, 1, 2, 3]])


@pytest.mark.parametrize("temperature, chunk_size, tied", [(1.0, 4, False), (0.7, 5, True), (1.3, 64, False)])
def test_matches_naive_float64_reference(temperature, chunk_size, tied):
    model = Decoder(tiny_config(tie_word_embeddings=tied), rngs=nnx.Rngs(1))
    graphdef, params = nnx.split(model)
    batch = _batch(np.random.default_rng(0), 256, b=3, p=6, c=13)
    fn = jax.jit(lambda prm, *a: token_logps_and_entropy(graphdef, prm, *a, temperature=temperature,
                                                         chunk_size=chunk_size))
    logps, entropy = fn(params, *batch)
    ref_logps, ref_entropy = _naive_reference(model, *batch, temperature)
    assert logps.shape == (3, 13) and logps.dtype == jnp.float32
    tolerance = decoder_logps_tolerance(model, batch[0].shape[1] + batch[2].shape[1], temperature=temperature)
    assert np.abs(np.asarray(logps) - ref_logps).max() <= tolerance
    assert np.abs(np.asarray(entropy) - ref_entropy).max() <= tolerance * (1 + np.log(model.config.vocab_size))
    only = jitted_token_logps(graphdef, params, *batch, temperature=temperature, chunk_size=chunk_size)
    np.testing.assert_allclose(np.asarray(only), np.asarray(logps), rtol=0, atol=tolerance)
    assert (np.asarray(logps)[~batch[3]] == 0).all()


@pytest.mark.slow  # tests/models/test_lm_head_logps.py checks the chunked gradient against autodiff (default tier)
def test_gradient_matches_unchunked_gradient():
    model = Decoder(tiny_config(), rngs=nnx.Rngs(2))
    graphdef, params = nnx.split(model)
    batch = _batch(np.random.default_rng(1), 256, b=2, p=4, c=9)

    def chunked_loss(prm):
        return token_logps(graphdef, prm, *batch, chunk_size=4).sum()

    def naive_loss(prm):
        m = nnx.merge(graphdef, prm)
        ids = jnp.concatenate([batch[0], batch[2]], 1)
        mask = jnp.concatenate([batch[1], batch[3]], 1)
        logits, _ = m(ids, left_pad_positions(mask), attention_mask=mask)
        logp = jax.nn.log_softmax(logits[:, 3:-1], -1)
        picked = jnp.take_along_axis(logp, batch[2][..., None], -1)[..., 0]
        return jnp.where(batch[3], picked, 0).sum()

    got = jax.grad(chunked_loss)(params)
    want = jax.grad(naive_loss)(params)
    backward = 3 * decoder_tolerance(1.0, model.config, 13)  # relative; each product runs forward and twice back
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=backward * np.abs(np.asarray(w)).max())


def test_never_materializes_full_logits():
    vocab, b, p, c = 16384, 4, 16, 112  # full logits: 33.5 MB; weights and their grads: ~8 MB
    model = Decoder(tiny_config(vocab_size=vocab), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    batch = tuple(jnp.asarray(x) for x in _batch(np.random.default_rng(0), vocab, b, p, c))
    full_logits_bytes = b * (p + c) * vocab * 4

    forward = jax.jit(lambda prm, *a: token_logps(graphdef, prm, *a, chunk_size=16))
    fwd_mem = forward.lower(params, *batch).compile().memory_analysis()
    assert fwd_mem.temp_size_in_bytes < full_logits_bytes / 2, fwd_mem.temp_size_in_bytes

    grad = jax.jit(jax.grad(lambda prm, *a: token_logps(graphdef, prm, *a, chunk_size=16).sum()))
    grad_mem = grad.lower(params, *batch).compile().memory_analysis()
    assert grad_mem.temp_size_in_bytes < full_logits_bytes, grad_mem.temp_size_in_bytes
