"""The prompt once per group (models/shared_prefix.py) against the unshared forward over
`prompt | completion`: hidden states, gradients, and the two-part attention on its own.

Tolerance: float32 rounding. The two paths run the same products in a different order (the
prompt's products once per group, the softmax merged from two parts), so values agree to a few
ulps of their magnitude: 2e-6 on hidden states of size ~1, 1e-5 relative on gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import attention_tolerance, decoder_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.decoder import _attend
from rlbolt.models.shared_prefix import attend_with_prefix, grouped_completion_hidden
from rlbolt.models.logps import completion_hidden

CONFIGS = {
    "llama_gqa": tiny_config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                             intermediate_size=48),
    "qwen3_qknorm_bias_tied": tiny_config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                                          head_dim=16, intermediate_size=48, qk_norm=True, attention_bias=True,
                                          tie_word_embeddings=True),
}


def _grouped_batch(rng, vocab, prompt_lengths, group, p, c, min_completion=1):
    """Prompts of the given lengths (left-padded to p), each repeated `group` times, with
    completions of random lengths (right-padded to c); padding slots hold random ids."""
    u = len(prompt_lengths)
    prompt_ids = rng.integers(0, vocab, (u, p)).astype(np.int32)
    prompt_mask = np.zeros((u, p), bool)
    for i, length in enumerate(prompt_lengths):
        prompt_mask[i, p - length:] = True
    prompt_ids, prompt_mask = np.repeat(prompt_ids, group, 0), np.repeat(prompt_mask, group, 0)
    completion_ids = rng.integers(0, vocab, (u * group, c)).astype(np.int32)
    completion_mask = np.zeros((u * group, c), bool)
    for row in range(u * group):
        completion_mask[row, : rng.integers(min_completion, c + 1)] = True
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def _both(model, batch, group):
    graphdef, params = nnx.split(model)
    unshared = jax.jit(lambda prm, *a: completion_hidden(graphdef, prm, *a)[0])(params, *batch)
    shared = jax.jit(lambda prm, *a: grouped_completion_hidden(nnx.merge(graphdef, prm), *a, group))(params, *batch)
    return np.asarray(unshared), np.asarray(shared)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hidden_states_match_the_unshared_forward(name):
    model = Decoder(CONFIGS[name], rngs=nnx.Rngs(3))
    # Three prompts of different lengths in one batch: one fills the bucket, one is a single token.
    batch = _grouped_batch(np.random.default_rng(0), 64, (9, 4, 1), group=3, p=9, c=7)
    unshared, shared = _both(model, batch, group=3)
    assert shared.shape == unshared.shape == (9, 7, 32)
    # Every position, the masked ones too (they see the same keys either way).
    assert np.abs(shared - unshared).max() <= 2e-6


def test_groups_of_one_and_a_one_token_completion():
    model = Decoder(CONFIGS["llama_gqa"], rngs=nnx.Rngs(4))
    batch = _grouped_batch(np.random.default_rng(1), 64, (5, 2), group=1, p=6, c=1)
    unshared, shared = _both(model, batch, group=1)
    assert np.abs(shared - unshared).max() <= 2e-6  # C = 1: only the prompt's last state is needed


def test_group_size_must_divide_the_batch():
    model = Decoder(CONFIGS["llama_gqa"], rngs=nnx.Rngs(4))
    batch = _grouped_batch(np.random.default_rng(1), 64, (5, 2), group=3, p=6, c=4)
    with pytest.raises(ValueError, match="group_size=4 must divide the batch of 6 rows"):
        grouped_completion_hidden(model, *batch, 4)


def test_gradients_match_the_unshared_forward():
    """The gradient through a shared prompt position is the sum over its group's samples."""
    model = Decoder(CONFIGS["qwen3_qknorm_bias_tied"], rngs=nnx.Rngs(5))
    graphdef, params = nnx.split(model)
    batch = _grouped_batch(np.random.default_rng(2), 64, (8, 3), group=4, p=8, c=6)
    weights = jnp.asarray(np.random.default_rng(3).standard_normal((8, 6, 32)), jnp.float32) * batch[3][..., None]

    def loss(prm, group):
        if group == 1:
            hidden = completion_hidden(graphdef, prm, *batch)[0]
        else:
            hidden = grouped_completion_hidden(nnx.merge(graphdef, prm), *batch, group)
        return jnp.sum(jnp.sin(hidden) * weights), hidden  # only real completion positions carry a gradient

    ((l1, hidden), g1), ((l4, _), g4) = (jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, g)
                                         for g in (1, 4))
    # prompt sharing regroups the network's products: the hidden states' rounding bound, summed with the weights
    seq = batch[0].shape[1] + batch[2].shape[1]
    config = model.config
    assert abs(float(l1) - float(l4)) <= decoder_tolerance(hidden, config, seq) * float(jnp.abs(weights).sum())
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g4)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a).max() > 0, path  # every parameter gets a gradient, so the check means something
        np.testing.assert_allclose(b, a, rtol=0, atol=decoder_tolerance(a, config, seq),
                                   err_msg=str(path))


@pytest.mark.parametrize("t", [1, 3])
def test_two_part_attention_equals_attention_over_the_concatenation(t):
    """attend_with_prefix == _attend over [prefix repeated per row | own keys], decode and prefill forms."""
    rng = np.random.default_rng(6)
    u, g, nkv, hpk, d, p, s = 2, 3, 2, 2, 8, 5, 4
    b = u * g
    q = jnp.asarray(rng.standard_normal((b, t, nkv * hpk, d)), jnp.float32)
    pk, pv = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((u, nkv, d, p), (u, nkv, p, d)))
    ok, ov = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in ((b, nkv, d, s), (b, nkv, s, d)))
    pmask = jnp.asarray(np.arange(p)[None] >= np.array([[2], [0]]))  # group 0 left-padded by 2
    own_visible = jnp.asarray(rng.random((b, t, s)) < 0.6)
    got = jax.jit(attend_with_prefix)(q, pk, pv, pmask, ok, ov, own_visible)  # one compile, not one per primitive
    keys = jnp.concatenate([jnp.repeat(pk, g, 0), ok], axis=-1)
    values = jnp.concatenate([jnp.repeat(pv, g, 0), ov], axis=-2)
    visible = jnp.concatenate([jnp.broadcast_to(jnp.repeat(pmask, g, 0)[:, None], (b, t, p)), own_visible], -1)
    want = jax.jit(_attend)(q, keys, values, visible)
    assert got.shape == (b, t, nkv * hpk * d)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=attention_tolerance(q, ok, ov, p + s))
