"""The dense MLP over position chunks (`model.mlp_chunk_positions`,
rlbolt.models.decoder_layer.over_position_chunks): the same logps and gradients as all positions
at once, on the unshared and the prompt-shared forward, with and without remat, and no extra
products under remat (the compiled flops).

Tolerance: `decoder_tolerance` (tests/float_tolerance.py): a chunk's products are the same
products in another fusion, so XLA may round differently; gradients take 3x that bound of their
own magnitude (the backward's reductions mirror the forward's), as tests/models/test_scan_layers.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import decoder_tolerance
from rlbolt.config import ConfigError, load_config
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.decoder_layer import over_position_chunks
from rlbolt.models.logps import token_logps

P, C = 6, 11  # prompt and completion tokens: 17 positions, 3 chunks of 7 with 4 padding positions


def _batch(vocab: int, group: int):
    k = jax.random.split(jax.random.key(3), 2)
    prompt = jnp.repeat(jax.random.randint(k[0], (2, P), 1, vocab), group, axis=0)
    prompt_mask = jnp.repeat(jnp.asarray([[False] * 2 + [True] * (P - 2), [True] * P]), group, axis=0)
    completion = jax.random.randint(k[1], (2 * group, C), 1, vocab)
    completion_mask = jnp.arange(C)[None] < jnp.asarray([C, 4, C, 1][: 2 * group])[:, None]
    return prompt, prompt_mask, completion, completion_mask


def _logps_and_grads(model, chunk, group, remat):
    model.mlp_chunk_positions, model.remat = chunk, remat
    graphdef, params = nnx.split(model)
    batch = _batch(model.config.vocab_size, group)

    def loss(p):
        logps = token_logps(graphdef, p, *batch, group_size=group)
        return jnp.sum(jnp.where(batch[3], logps * jnp.linspace(-1.0, 2.0, C), 0.0)), logps

    (_, logps), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.where(batch[3], logps, 0.0), grads


@pytest.mark.parametrize("group, remat", [(1, "full"), pytest.param(2, "none", marks=pytest.mark.slow)])
def test_chunked_mlp_gives_the_logps_and_gradients_of_one_piece(group, remat):
    """Group 1: the unshared forward; group 2: the prompt-shared one (its rows are one [1, tokens]
    row, so the chunks cut across samples). 7 positions per chunk of 17 (and of 2 x 6 + 4 x 11)."""
    model = Decoder(tiny_config(), rngs=nnx.Rngs(0))
    ref_logps, ref_grads = _logps_and_grads(model, 0, group, remat)
    logps, grads = _logps_and_grads(model, 7, group, remat)
    config, seq = model.config, P + C
    bound = decoder_tolerance(8.0, config, seq)
    np.testing.assert_allclose(logps, ref_logps, rtol=0, atol=bound)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, ref, rtol=0, atol=3 * decoder_tolerance(np.asarray(ref), config, seq) + 1e-30)
    mlp_grad = ref_grads["layers"][0]["mlp"]["gate_up_proj"]["kernel"][...]
    assert np.abs(np.asarray(mlp_grad)).max() > 100 * bound  # the comparison has teeth


def test_chunks_under_remat_add_no_products():
    """Under remat full the layer's recompute skips the chunked MLP (the chunks' own checkpoints
    recompute it), so the gradient runs the gate|up product twice per layer (the forward and one
    recompute), in chunks as in one piece; without that skip it would run three times. Counted in
    the gradient's jaxpr: XLA's cost analysis counts a loop body once, so its flops cannot say."""
    model = Decoder(tiny_config(intermediate_size=256), rngs=nnx.Rngs(0))
    model.remat = "full"
    _, params = nnx.split(model)
    ids = jax.random.randint(jax.random.key(1), (2, 16), 0, model.config.vocab_size)

    def gate_up_products(chunk):
        model.mlp_chunk_positions = chunk
        graphdef, _ = nnx.split(model)
        loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(ids, jnp.arange(16)[None].repeat(2, 0))[0][..., 1])  # noqa: E731
        rows = 2 * (chunk or 16)  # the product's [rows, 2I] output
        return len(re.findall(rf":f32\[{rows},512\] = dot_general", str(jax.make_jaxpr(jax.grad(loss))(params))))

    assert gate_up_products(0) == gate_up_products(8) == 2 * model.config.num_layers


def test_over_position_chunks_against_numpy_and_hostile_sizes():
    """A position-wise function in chunks equals float64 NumPy; a chunk of 1, one as long as T and
    longer, and 0 (off) all give it."""
    x = jax.random.normal(jax.random.key(2), (3, 10, 4))
    w = jax.random.normal(jax.random.key(3), (4, 6))
    fn = lambda a: jnp.tanh(a @ w)  # noqa: E731
    want = np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    for chunk in (1, 3, 10, 64, 0, None):
        got = over_position_chunks(fn, x, chunk)
        assert got.shape == (3, 10, 6)
        np.testing.assert_allclose(got, want, rtol=0, atol=4 * 4 * np.finfo(np.float32).eps * np.abs(want).max() + 1e-7)


def test_a_bad_chunk_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"model.mlp_chunk_positions=-1 must be >= 0"):
        load_config({"model": {"mlp_chunk_positions": -1}})
    assert load_config({}).model.mlp_chunk_positions == 2048
