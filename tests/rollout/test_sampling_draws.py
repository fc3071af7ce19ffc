"""The draw itself (`rlbolt.rollout.sampling`): inverse-CDF sampling from two uniforms per row.

Checked against float64 references computed here: the frequencies of many draws against the
softmax (and its top-k / top-p renormalisation), the token a given pair of uniforms must pick
by hand, and the logps against a float64 log-softmax. Hostile rows: a vocabulary that is not a
multiple of the block, -inf and float32-max logits, one row, a vocabulary smaller than a block.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from float_tolerance import EPS32, log_softmax_tolerance
from rlbolt.rollout.sampling import SamplingParams, _inverse_cdf, sample_tokens, step_uniforms


def _softmax64(logits):
    x = np.asarray(logits, np.float64)
    x = x - x[np.isfinite(x)].max()
    p = np.where(np.isfinite(x), np.exp(x), 0.0)
    return p / p.sum()


def _draw(logits_row, n, sp, seed=0):
    """n draws of one row (n rows of the same logits, each with its own key)."""
    keys = jax.random.key_data(jax.random.split(jax.random.key(seed), n))
    uniforms = step_uniforms(keys, sp)(3)
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n, len(logits_row)))
    tokens, logps = jax.jit(sample_tokens, static_argnums=2)(logits, uniforms, sp)
    return np.asarray(tokens), np.asarray(logps)


def _assert_frequencies(tokens, probs):
    """Every token's count within 5 standard deviations (+1) of n * p; zero-probability tokens never."""
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs))
    expected = n * probs
    bound = 5 * np.sqrt(expected * (1 - probs)) + 1
    worst = int(np.argmax(np.abs(counts - expected) - bound))
    assert (np.abs(counts - expected) <= bound).all(), (worst, counts[worst], expected[worst])
    assert counts[probs == 0].sum() == 0


def _logits(vocab, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2.0, vocab).astype(np.float32)
    logits[rng.choice(vocab, 5, replace=False)] += 6.0  # a few likely tokens, a long tail
    return logits


def _draw_tolerance(logits, temperature):
    """A float32 log_softmax of logits / temperature against float64: the division's rounding (one ulp of
    the largest scaled logit) and log_softmax_tolerance's log-sum-exp over the vocabulary."""
    logits = np.asarray(logits)
    largest = float(np.abs(logits[np.isfinite(logits)]).max())  # -inf entries add exact zeros to the sum
    return log_softmax_tolerance(EPS32 * largest / temperature, logits.shape[-1])


@pytest.mark.parametrize("vocab", [600, 7])  # 600: two blocks of 512, the second padded; 7: under one block
def test_draws_follow_the_softmax(vocab):
    logits = _logits(vocab, seed=vocab)
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    tokens, logps = _draw(logits, 40_000, sp)
    _assert_frequencies(tokens, _softmax64(logits))
    np.testing.assert_allclose(logps, np.log(_softmax64(logits))[tokens], rtol=0, atol=_draw_tolerance(logits, 1.0))


# The combined case (temperature, top-k and top-p at once) stays in the default tier; each filter
# alone (40,000 draws apiece) is in the slow tier.
@pytest.mark.parametrize("sp", [
    pytest.param(SamplingParams(4, temperature=0.7), marks=pytest.mark.slow, id="temperature"),
    pytest.param(SamplingParams(4, temperature=1.3, top_k=20), marks=pytest.mark.slow, id="top_k"),
    pytest.param(SamplingParams(4, temperature=1.0, top_p=0.8), marks=pytest.mark.slow, id="top_p"),
    pytest.param(SamplingParams(4, temperature=0.9, top_k=50, top_p=0.6), id="all"),
])
def test_temperature_top_k_and_top_p_renormalise_the_kept_tokens(sp):
    logits = _logits(600, seed=1)
    scaled = logits.astype(np.float64) / sp.temperature
    probs = _softmax64(scaled)
    kept = np.ones(len(logits), bool)
    if sp.top_k:
        kept &= scaled >= np.sort(scaled)[-sp.top_k]
    if sp.top_p < 1:
        order = np.argsort(-np.where(kept, scaled, -np.inf))
        renorm = np.where(kept, probs, 0) / np.where(kept, probs, 0).sum()
        before = np.cumsum(renorm[order]) - renorm[order]
        kept_p = np.zeros(len(logits), bool)
        kept_p[order[before < sp.top_p]] = True
        kept &= kept_p
    target = np.where(kept, probs, 0)
    tokens, logps = _draw(logits, 40_000, sp, seed=7)
    _assert_frequencies(tokens, target / target.sum())
    # logps stay those of the softmax of logits / temperature, before filtering
    np.testing.assert_allclose(logps, np.log(probs)[tokens], rtol=0, atol=_draw_tolerance(logits, sp.temperature))


def test_given_uniforms_pick_the_token_by_hand():
    # Row masses 0, 1, 0, 3 (+ zero padding to a block): u in [0, 1/4) -> token 1, [1/4, 1) -> token 3;
    # never a zero-mass token, not even for u = 0 or the largest float32 below 1.
    weights = jnp.asarray([[0.0, 1.0, 0.0, 3.0]] * 5, jnp.float32)
    below_one = np.nextafter(np.float32(1), np.float32(0))
    u = jnp.asarray([[0.0, 0.0], [0.0, 0.2499], [0.0, 0.25], [0.0, 0.9], [below_one, below_one]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(_inverse_cdf(weights, u)), [1, 1, 3, 3, 3])


def test_two_levels_pick_the_block_by_its_mass_then_the_token_inside_it():
    # 3 blocks of 512: block 0 holds mass 1 on token 7, block 1 nothing, block 2 mass 3 spread evenly.
    w = np.zeros((1, 3 * 512), np.float32)
    w[0, 7] = 1.0
    w[0, 1024:] = 3.0 / 512
    pick = lambda u0, u1: int(_inverse_cdf(jnp.asarray(w), jnp.asarray([[u0, u1]], jnp.float32))[0])  # noqa: E731
    assert pick(0.2, 0.99) == 7  # u0 < 1/4: block 0, whose only mass is token 7
    assert pick(0.3, 0.0) == 1024  # block 2 (block 1 has no mass), its first token
    assert pick(0.3, 0.5) == 1024 + 256  # u1 = 1/2 of block 2's even mass
    assert pick(0.99, 1 - 2 ** -24) == 3 * 512 - 1


def test_a_block_of_masses_below_float32_resolution_is_drawn_evenly_inside():
    # 512 tokens of mass 2**-40 each: once their block is drawn, the second uniform alone picks
    # among them, at the block's own scale (row 0). The limit is the block level: next to a token
    # of mass 1 (row 1) their block's 2**-31 is below float32's resolution of the total and is
    # never drawn, an error of 2**-31 in probability.
    w = np.zeros((2, 1024), np.float32)
    w[:, 512:] = 2.0 ** -40
    w[1, 0] = 1.0
    for k in (0, 100, 511):
        u = jnp.asarray([[0.5, k / 512 + 1e-4], [np.nextafter(np.float32(1), np.float32(0)), k / 512 + 1e-4]], jnp.float32)
        np.testing.assert_array_equal(np.asarray(_inverse_cdf(jnp.asarray(w), u)), [512 + k, 0])


def test_hostile_logits_minus_inf_and_float32_max():
    big = np.finfo(np.float32).max
    logits = np.array([-np.inf, big, -np.inf, big, 0.0, -np.inf], np.float32)
    sp = SamplingParams(4, temperature=1.0)
    tokens, logps = _draw(logits, 4_000, sp)
    assert set(np.unique(tokens)) <= {1, 3}
    assert 1_700 < (tokens == 1).sum() < 2_300  # two equal maxima share the draws
    np.testing.assert_allclose(logps, np.log(0.5), rtol=0, atol=8 * EPS32)  # exp(0) + exp(0) + zeros: a few ulps


def test_greedy_picks_the_first_maximum_and_its_log_softmax():
    logits = jnp.asarray([[0.0, 3.0, 3.0, -1.0], [-np.inf, 1.0, 2.0, 2.0]], jnp.float32)
    tokens, logps = sample_tokens(logits, None, SamplingParams(4, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(tokens), [1, 2])
    ref = [np.log(_softmax64(row)[t]) for row, t in zip(np.asarray(logits), [1, 2])]
    np.testing.assert_allclose(np.asarray(logps), ref, rtol=0, atol=_draw_tolerance(logits, 1.0))


def test_a_row_draws_from_its_own_key_and_step_only():
    sp = SamplingParams(6, temperature=1.0)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 4)))
    at = step_uniforms(keys, sp)
    one = step_uniforms(keys[2:3], sp)
    for step in range(6):
        np.testing.assert_array_equal(np.asarray(at(step))[2], np.asarray(one(step))[0])
        np.testing.assert_array_equal(np.asarray(at(step, jnp.asarray([2, 0]))), np.asarray(at(step))[[2, 0]])
    assert not np.array_equal(np.asarray(at(1)), np.asarray(at(2)))
    assert step_uniforms(keys, SamplingParams(6, temperature=0.0))(1) is None


@pytest.mark.parametrize("sp", [SamplingParams(4, temperature=1.0), SamplingParams(4, temperature=0.7),
                                SamplingParams(4, temperature=0.0), SamplingParams(4, temperature=1.0, top_k=5),
                                SamplingParams(4, temperature=1.3, top_p=0.8)],
                         ids=["t1", "t0.7", "greedy", "top_k", "top_p"])
@pytest.mark.parametrize("vocab", [1_100, 7])  # 1,100: three blocks, the last one padded
def test_vocabulary_major_logits_draw_the_same_tokens_and_logps(sp, vocab):
    """`vocab_axis=0` ([V, B], what tied embeddings give in the decode) is the same draw as [B, V]."""
    rng = np.random.default_rng(vocab)
    logits = rng.normal(0, 3.0, (5, vocab)).astype(np.float32)
    logits[0, 3] = -np.inf  # a token that can never be drawn
    logits[1, :] = -np.inf
    logits[1, vocab - 1] = 0.0  # a row with one possible token, in the last (padded) block
    keys = jax.random.key_data(jax.random.split(jax.random.key(1), 5))
    uniforms = step_uniforms(keys, sp)(2)
    both = jax.jit(lambda x, u, sp: (sample_tokens(x, u, sp), sample_tokens(x.T, u, sp, vocab_axis=0)),
                   static_argnums=2)  # one program for the two layouts
    rows, cols = both(jnp.asarray(logits), uniforms, sp)
    np.testing.assert_array_equal(np.asarray(cols[0]), np.asarray(rows[0]))
    tolerance = _draw_tolerance(logits, sp.temperature or 1.0)
    # sums in another order
    np.testing.assert_allclose(np.asarray(cols[1]), np.asarray(rows[1]), rtol=0, atol=tolerance)
    assert int(cols[0][1]) == vocab - 1 and (np.asarray(cols[0]) != 3).all()
    ref = [np.log(_softmax64(row / (sp.temperature or 1.0))[t]) for row, t in zip(logits, np.asarray(cols[0]))]
    np.testing.assert_allclose(np.asarray(cols[1]), ref, rtol=0, atol=tolerance)


def test_vocabulary_major_draws_follow_the_softmax():
    logits = _logits(600, seed=5)
    sp = SamplingParams(max_new_tokens=4, temperature=1.0)
    n = 40_000
    keys = jax.random.key_data(jax.random.split(jax.random.key(2), n))
    columns = jnp.broadcast_to(jnp.asarray(logits)[:, None], (600, n))
    tokens, _ = jax.jit(sample_tokens, static_argnums=2, static_argnames="vocab_axis")(
        columns, step_uniforms(keys, sp)(0), sp, vocab_axis=0)
    _assert_frequencies(np.asarray(tokens), _softmax64(logits))


def test_bad_vocab_axis_is_refused_naming_it():
    greedy = SamplingParams(4, temperature=0.0)
    logits = jnp.asarray([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    assert np.asarray(sample_tokens(logits, None, greedy, vocab_axis=-1)[0]).tolist() == [1, 0]
    for axis, shape in ((2, (2, 3)), (0, (2, 3, 4))):
        with pytest.raises(ValueError, match="vocab_axis 0 or 1"):
            sample_tokens(jnp.zeros(shape), None, greedy, vocab_axis=axis)
