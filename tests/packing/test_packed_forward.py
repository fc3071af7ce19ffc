"""The device side of plan.packing against independent references.

- The decoder over a packed row (segment ids, positions restarting per sample) gives each sample
  the logits it gets alone in a row of its own: attention never crosses samples, sliding windows
  included.
- `packed_sequence_logps` equals the padded `sequence_logps` (logps, entropies and the gradient of
  a weighted sum), with two blocks, a row budget of its own, unequal prompts, an empty completion and
  one of a single token, for each way of running the output projection (over every packed token, the
  gathered N x C states, or `pack_sources`' predictors only, with a row of padding only too).

Tolerances: the network's float32 bound (tests/float_tolerance.py), the two evaluations summing the
same products in other orders; gradients to three times it (each product runs forward and twice
backward), relative to the largest entry.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from float_tolerance import decoder_logps_tolerance, decoder_tolerance

from rlbolt.models import Decoder, tiny_config
from rlbolt.models.cache import init_cache
from rlbolt.packing import PackingSpec, pack_columns, pack_sources, packed_sequence_logps, sample_lengths
from rlbolt.models.logps import sequence_logps

SMALL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
             intermediate_size=64)


@pytest.mark.parametrize("window", [None, 3])
def test_packed_row_equals_each_sample_alone(window):
    extra = {} if window is None else {"sliding_window": window, "layer_types": ("sliding_attention", "full_attention")}
    model = Decoder(tiny_config(**SMALL, **extra), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    lengths = [5, 3, 6]
    samples = [rng.integers(1, 64, n).astype(np.int32) for n in lengths]
    row = np.zeros((1, 16), np.int32)
    segments, positions = np.zeros((1, 16), np.int32), np.zeros((1, 16), np.int32)
    start = 0
    for k, s in enumerate(samples):
        row[0, start:start + len(s)], segments[0, start:start + len(s)] = s, k + 1
        positions[0, start:start + len(s)] = np.arange(len(s))
        start += len(s)
    graphdef, params = nnx.split(model)

    @jax.jit
    def logits(ids, positions, segments=None):
        return nnx.merge(graphdef, params)(ids, positions, segment_ids=segments)[0]

    packed = logits(jnp.asarray(row), jnp.asarray(positions), jnp.asarray(segments))
    # Each sample alone at the start of a row of its own, the three rows in one batch (one compile, not one per
    # length): the causal mask keeps a row's trailing filler out of the sample's positions.
    alone_ids = np.zeros((len(samples), max(lengths)), np.int32)
    for k, s in enumerate(samples):
        alone_ids[k, :len(s)] = s
    alone = np.asarray(logits(jnp.asarray(alone_ids), jnp.broadcast_to(jnp.arange(max(lengths), dtype=jnp.int32),
                                                                       alone_ids.shape)))
    start = 0
    for k, s in enumerate(samples):
        tolerance = decoder_tolerance(alone[k, :len(s)], model.config, 16)
        np.testing.assert_allclose(np.asarray(packed[0, start:start + len(s)]), alone[k, :len(s)], rtol=0,
                                   atol=tolerance)
        start += len(s)


def test_segment_ids_refuse_a_cache():
    model = Decoder(tiny_config(**SMALL), rngs=nnx.Rngs(0))
    cache = init_cache(model.config, 1, 8)
    with pytest.raises(ValueError, match="cache-free forwards over packed rows; pass cache=None"):
        model(jnp.ones((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32), cache=cache,
              segment_ids=jnp.ones((1, 2), jnp.int32))


def _batch(rng, n=8, p=6, c=7):
    prompt_len, completion_len = rng.integers(1, p + 1, n), rng.integers(0, c + 1, n)
    completion_len[2] = 0  # an empty completion
    completion_len[5] = 1  # a single completion token
    pm = np.arange(p)[None] >= p - prompt_len[:, None]
    cm = np.arange(c)[None] < completion_len[:, None]
    return (rng.integers(1, 64, (n, p)).astype(np.int32) * pm, pm, rng.integers(1, 64, (n, c)).astype(np.int32) * cm,
            cm)


# (prompt width, completion width, row tokens, projection, padding rows): the output projection over
# every packed token (fewer than rows x completion slots), over the gathered N x C predicting states
# (long prompts), and over `pack_sources` (the completion tokens' predictors only: the update's path),
# with long prompts and short completions, and with plan.packed_rows one more than needed (a row of
# padding only in each block).
@pytest.mark.parametrize("p, c, row_tokens, projection, spare", [(6, 7, 14, "packed", 0), (12, 3, None, "gathered", 0),
                                                                  (6, 7, 14, "sources", 0),
                                                                  (12, 3, None, "sources", 1)])
def test_packed_logps_entropy_and_gradient_equal_the_padded_path(p, c, row_tokens, projection, spare):
    model = Decoder(tiny_config(**SMALL), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    pi, pm, ci, cm = _batch(np.random.default_rng(1), p=p, c=c)
    lengths = sample_lengths(pm, cm)
    spec = PackingSpec(row_tokens=row_tokens, blocks=2)
    if spare:
        needed = pack_columns(lengths, 8, spec, p + c)["pack_rows"].shape[1]
        spec = PackingSpec(row_tokens=row_tokens, blocks=2, rows=needed + 1)
    cols = pack_columns(lengths, 8, spec, p + c)
    rows = cols["pack_rows"].shape[1] * 2
    assert rows - 2 * spare < 8  # fewer rows than samples (before the spare ones)
    if projection != "sources":  # without sources the shapes pick the way
        assert (rows * (row_tokens or p + c) <= 8 * c) == (projection == "packed")
    assert not spare or cols["pack_rows"][:4].any(0).sum() < rows // 2  # a row no sample sits in
    sources = pack_sources(pm, cm, cols, 8, spec, p + c) if projection == "sources" else None
    if sources is not None and not spare:  # (fixed rows: as many slots as the fewer of the other two, data-free)
        assert sources.size < min(rows * (row_tokens or p + c), 8 * c)  # fewer states than either other way
    weights = jnp.asarray(np.random.default_rng(2).normal(size=cm.shape), jnp.float32)

    def padded(params):
        logps, entropy = sequence_logps(graphdef, params, pi, pm, ci, cm, temperature=0.7, with_entropy=True)
        return jnp.sum(logps * weights), (logps, entropy)

    def packed(params):
        logps, entropy = packed_sequence_logps(graphdef, params, pi, pm, ci, cm, cols["pack_rows"], cols["pack_starts"],
                                               sources, row_tokens=row_tokens, blocks=2, temperature=0.7,
                                               with_entropy=True)
        return jnp.sum(logps * weights), (logps, entropy)

    (_, (lu, eu)), gu = jax.jit(jax.value_and_grad(padded, has_aux=True))(params)
    (_, (lp, ep)), gp = jax.jit(jax.value_and_grad(packed, has_aux=True))(params)
    seq = pm.shape[1] + cm.shape[1]
    tolerance = decoder_logps_tolerance(model, seq, temperature=0.7)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(lu), rtol=0, atol=tolerance)
    np.testing.assert_allclose(np.asarray(ep), np.asarray(eu), rtol=0, atol=tolerance)
    assert np.all(np.asarray(lp)[~cm] == 0) and np.abs(np.asarray(lu)).max() > 1
    relative = 3 * decoder_tolerance(1.0, model.config, seq)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(gu))
    for x, y in zip(jax.tree.leaves(gp), jax.tree.leaves(gu)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=relative * scale)
