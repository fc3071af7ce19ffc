"""Causal attention over query chunks (models/attention_chunks.py): the same logits, logps and
gradients as attention in one piece, and less memory: the masked half of the scores is never built.

Reference: the same model with `attention_query_chunk = None` (one piece, what
tests/models/test_hf_parity.py checks against `transformers`). Tolerance: 2e-5 absolute on logits
and logps and 1e-4 relative on gradients (float32: the chunks sum the same terms, a chunk's
softmax sees only keys up to its last row, the rest being exactly masked). Memory: XLA's own
analysis of the compiled gradient (`temp_size_in_bytes`), not a timing.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import EPS32, attention_tolerance, decoder_tolerance, dot_error_bound, log_softmax_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.attention_chunks import CHUNK_GROUPS, DEFAULT_QUERY_CHUNK, causal_query_chunks
from rlbolt.models.decoder import _attend
from rlbolt.rollout import token_logps

CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
              intermediate_size=48, max_position_embeddings=1024)


@functools.cache
def _base():
    return nnx.split(Decoder(tiny_config(**CONFIG), rngs=nnx.Rngs(3)))  # built (eagerly) once per module


def _model(chunk):
    model = nnx.merge(*_base())  # a fresh module around the same weights
    model.attention_query_chunk = chunk
    return nnx.split(model)


def _batch(rows=4, prompt=12, completion=29, group=1, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, prompt + 1, rows // group).repeat(group)  # left-padded prompts of different lengths
    p_mask = np.arange(prompt)[None] >= prompt - lengths[:, None]
    p_ids = np.where(p_mask, rng.integers(1, 64, (rows // group, prompt)).repeat(group, axis=0), 0)
    c_len = rng.integers(1, completion + 1, rows)
    c_len[0] = completion  # one row runs to the end
    c_mask = np.arange(completion)[None] < c_len[:, None]
    c_ids = np.where(c_mask, rng.integers(1, 64, (rows, completion)), 0)
    return tuple(jnp.asarray(x) for x in (p_ids, p_mask, c_ids, c_mask))


def test_chunks_cover_the_queries_and_read_only_keys_up_to_their_last_row():
    seen = []

    def attend(q, keys_t, values, visible):
        seen.append((q.shape[1], keys_t.shape[-1], values.shape[2], visible.shape[1:]))
        return _attend(q, keys_t, values, visible)

    b, t, d = 2, 40, 8
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, 4, d))
    k_t = jax.random.normal(keys[1], (b, 2, d, t))
    v = jax.random.normal(keys[2], (b, 2, t, d))
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    whole = jax.jit(_attend)(q, k_t, v, visible)  # jitted: one compile each, not one per primitive
    got = jax.jit(lambda *a: causal_query_chunks(attend, *a, 16))(q, k_t, v, visible)  # traced once: seen once
    assert seen == [(16, 16, 16, (16, 16)), (16, 32, 32, (16, 32)), (8, 40, 40, (8, 40))]
    np.testing.assert_allclose(got, whole, rtol=0, atol=attention_tolerance(q, k_t, v, t))
    one_piece = jax.eval_shape(lambda *a: causal_query_chunks(attend, *a, None), q, k_t, v, visible)
    assert one_piece is not None and seen[-1][0] == t  # one piece


@pytest.mark.parametrize("t", [43, 163])
def test_many_chunks_run_as_a_few_looped_runs(t):
    """More than CHUNK_GROUPS chunks: CHUNK_GROUPS runs, each one traced body (lax.map) whose chunks
    read the keys up to the run's end, plus the short last chunk; the number of bodies does not
    grow with T (10 and 40 chunks of 4 rows both trace 4 + 1), and the result is attention in one
    piece. Tolerance: per row, from its own scores and keys (`_row_bounds`; the later keys of a run
    are exactly masked, only the summation order differs)."""
    seen = []

    def attend(q, keys_t, values, visible):
        seen.append((q.shape[1], keys_t.shape[-1], visible.shape[1:]))
        return _attend(q, keys_t, values, visible)

    b, d, chunk = 2, 8, 4
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (b, t, 4, d))
    k_t = jax.random.normal(keys[1], (b, 2, d, t))
    v = jax.random.normal(keys[2], (b, 2, t, d))
    visible = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)) & (jnp.arange(t) >= 2)[None, None]
    got = jax.jit(lambda *a: causal_query_chunks(attend, *a, chunk))(q, k_t, v, visible)  # traced once: seen once
    n = t // chunk
    ends = np.cumsum([n // CHUNK_GROUPS + (g < n % CHUNK_GROUPS) for g in range(CHUNK_GROUPS)]) * chunk
    assert seen == [(chunk, int(e), (chunk, int(e))) for e in ends] + [(t % chunk, t, (t % chunk, t))]
    # Rows 0 and 1 see no key (a left-pad row's uniform softmax, masked downstream): left out.
    bound = _row_bounds(q, k_t, v, visible)[:, 2:]
    whole = jax.jit(_attend)(q, k_t, v, visible)
    assert np.all(_row_errors(got, whole, q.shape)[:, 2:] <= bound)
    # Teeth: attention that drops each row's own key (rows 3 on still see another) misses it in most rows.
    wrong = jax.jit(_attend)(q, k_t, v, visible & ~jnp.eye(t, dtype=bool)[None])
    assert np.mean(_row_errors(wrong, whole, q.shape)[:, 3:] > bound[:, 1:]) > 0.9


def _row_bounds(q, k_t, v, visible) -> np.ndarray:
    """[B, T, H]: how far two float32 attentions over one row's visible keys (any order of summation)
    can differ, from this data: each score q . k moves by at most `dot_error_bound` (d terms, the row's
    largest), so each softmax weight by twice that, relatively, plus the n-key denominator sum and the
    n-term weighted sum of values (`sum_error_bound`: n * eps each, weights summing to 1) and a few
    single roundings (exp, the division); all times the row's largest |v|."""
    q64, k64, v64 = (np.abs(np.asarray(a, np.float64)) for a in (q, k_t, v))
    groups = q.shape[2] // k_t.shape[1]
    k_heads = np.repeat(k64, groups, axis=1)  # [B, H, d, T]
    v_heads = np.repeat(v64.max(-1), groups, axis=1)  # [B, H, T]: each key's largest |v|
    sees = np.asarray(visible)[:, None]  # [B, 1, T, T]
    score = dot_error_bound(q64.transpose(0, 2, 1, 3), k_heads)  # [B, H, T, T]
    score = np.where(sees, score, 0.0).max(-1)
    v_max = np.where(sees, v_heads[:, :, None, :], 0.0).max(-1)
    n = sees.sum(-1)
    return ((2 * score + 2 * n * EPS32 + 4 * EPS32) * v_max).transpose(0, 2, 1)


def _row_errors(a, b, shape) -> np.ndarray:
    """[B, T, H]: the largest |a - b| of each row and head (outputs [B, T, H * d])."""
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    return diff.reshape(shape).max(-1)


@pytest.mark.parametrize("group", [1, 4])
def test_chunked_logps_and_gradients_equal_attention_in_one_piece(group):
    batch = _batch(rows=8, group=group)
    results = {}
    for chunk in (None, 8):  # 8: the 29-token completions in 4 chunks, the 12-token prompts in 2
        graphdef, params = _model(chunk)

        def loss(p):
            logps = token_logps(graphdef, p, *batch, group_size=group)
            return jnp.sum(jnp.where(batch[3], logps, 0.0)), logps

        (value, logps), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        results[chunk] = (value, logps, grads)
    (v1, l1, g1), (v8, l8, g8) = results[None], results[8]
    # the network's rounding bound on its logits (max |logits| < 8 for this tiny model, checked
    # by the plain-forward test below), through log_softmax
    config, seq = tiny_config(**CONFIG), batch[0].shape[1] + batch[2].shape[1]
    logit_error = decoder_tolerance(8.0, config, seq)
    np.testing.assert_allclose(np.where(batch[3], l8, 0), np.where(batch[3], l1, 0), rtol=0,
                               atol=log_softmax_tolerance(logit_error, config.vocab_size))
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):  # the same relative bound, on each gradient
        np.testing.assert_allclose(a, b, rtol=0, atol=decoder_tolerance(b, config, seq) + 1e-12)
    assert float(jnp.abs(jax.tree.leaves(g1)[0]).max()) > 0  # not a vacuous comparison


def test_logits_of_the_plain_forward_with_left_padding_equal_one_piece():
    ids = jax.random.randint(jax.random.key(1), (3, 37), 1, 64)
    mask = jnp.arange(37)[None] >= jnp.asarray([0, 5, 20])[:, None]
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    forward = jax.jit(lambda graphdef, params: nnx.merge(graphdef, params)(ids, positions, attention_mask=mask)[0],
                      static_argnums=0)  # one compile per chunking, not one per primitive
    out = {c: forward(*_model(c)) for c in (None, 10)}
    assert np.abs(np.asarray(out[None])).max() < 8.0  # the bound the test above assumes
    np.testing.assert_allclose(np.where(mask[..., None], out[10], 0), np.where(mask[..., None], out[None], 0),
                               rtol=0, atol=decoder_tolerance(out[None], tiny_config(**CONFIG), 37))


def test_the_gradient_needs_at_least_a_softmax_per_layer_less_scratch():
    rows, heads, t = 4, CONFIG["num_heads"], 512
    batch = _batch(rows=rows, prompt=16, completion=t - 16)
    temp = {}
    for chunk in (None, DEFAULT_QUERY_CHUNK // 4):
        graphdef, params = _model(chunk)
        grad = jax.jit(jax.grad(lambda p: jnp.sum(token_logps(graphdef, p, *batch))))
        temp[chunk] = grad.lower(params).compile().memory_analysis().temp_size_in_bytes
    softmax_bytes = rows * heads * t * t * 4  # one layer's [B, heads, T, T] float32 probabilities
    # One piece builds (and keeps for the backward) every layer's whole scores and softmax; the
    # chunks only their lower triangle (measured: 118 MB -> 53 MB here).
    assert temp[None] - temp[DEFAULT_QUERY_CHUNK // 4] > CONFIG["num_layers"] * softmax_bytes, temp
