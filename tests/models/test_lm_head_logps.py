"""The fused, token-chunked lm_head + log-softmax (`rlbolt.models.lm_head_logps`) against float64
NumPy, against ordinary autodiff of the unchunked expression, on a data x tp mesh, and in memory:
the compiled programs hold no [B, T, V] float32 buffer."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import EPS32, decoder_tolerance, dot_error_bound, log_softmax_tolerance

from rlbolt.config import ConfigError, load_config
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.lm_head_logps import DEFAULT_LOGITS_CHUNK_TOKENS, lm_head_logps
from rlbolt.models.lora import LoraConfig
from rlbolt.rollout import left_pad_positions, token_logps_and_entropy

B, C, H, V = 3, 11, 8, 37


def _inputs(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(B, C, H)).astype(np.float32)
    weight = (scale * rng.normal(size=(H, V))).astype(np.float32)
    targets = rng.integers(0, V, (B, C)).astype(np.int32)
    targets[0, 0], targets[1, 1] = 0, V - 1  # the first and last id of the vocabulary
    g_logps = rng.normal(size=(B, C)).astype(np.float32)  # cotangents: a loss that weighs every token
    g_entropy = rng.normal(size=(B, C)).astype(np.float32)
    return hidden, weight, targets, g_logps, g_entropy


def _float64_reference(hidden, weight, targets, g_logps, g_entropy, temperature, softcap):
    """(logps, entropy, d loss / d hidden, d loss / d weight) in float64 NumPy, for
    loss = sum(g_logps * logps) + sum(g_entropy * entropy), derived by hand (module docstring)."""
    h, w = hidden.astype(np.float64), weight.astype(np.float64)
    z = h @ w
    s = z if softcap is None else softcap * np.tanh(z / softcap)
    y = s / temperature
    y_max = y.max(-1, keepdims=True)
    logp_all = y - y_max - np.log(np.exp(y - y_max).sum(-1, keepdims=True))
    p = np.exp(logp_all)
    logps = np.take_along_axis(logp_all, targets[..., None], -1)[..., 0]
    entropy = -(p * logp_all).sum(-1)
    onehot = np.eye(V)[targets]
    grad_y = g_logps[..., None] * (onehot - p) - g_entropy[..., None] * p * (logp_all + entropy[..., None])
    grad_z = grad_y / temperature * (1.0 if softcap is None else 1.0 - (s / softcap) ** 2)
    return logps, entropy, grad_z @ w.T, np.einsum("bch,bcv->hv", h, grad_z)


def _logps_tolerances(hidden, weight, temperature=1.0, against_exact=True):
    """(log-prob, entropy) tolerances: the lm_head product's rounding (`dot_error_bound`, halved against
    float64's exact product) through the temperature and log_softmax; the soft-cap is 1-Lipschitz; an
    entropy moves by at most (1 + log V) times its log-probs' error."""
    logit_error = dot_error_bound(hidden, weight).max() / (2 if against_exact else 1) / temperature
    logps = log_softmax_tolerance(logit_error, weight.shape[-1])
    return logps, logps * (1 + np.log(weight.shape[-1]))


def _loss(chunk, targets, g_logps, g_entropy, temperature, softcap, with_entropy=True):
    def loss(hidden, weight):
        logps, entropy = lm_head_logps(hidden, weight, targets, temperature=temperature, softcap=softcap,
                                       chunk_tokens=chunk, with_entropy=with_entropy)
        return jnp.sum(g_logps * logps) + jnp.sum(g_entropy * entropy), (logps, entropy)
    return loss


# 1 and 2 hold fewer tokens than rows (one position per chunk); 7 is 2 positions of 3 rows, which do
# not divide 11; 33 is the whole batch; 1,000 is more than it holds; 0 / None: unchunked.
@pytest.mark.parametrize("chunk", [1, 2, 7, 33, 1000, 0, None])
@pytest.mark.parametrize("temperature, softcap", [(1.0, None), (0.7, 2.5)])
def test_logps_entropy_and_gradients_match_float64_by_hand(chunk, temperature, softcap):
    hidden, weight, targets, g_logps, g_entropy = _inputs(scale=1.5)  # |logits| ~ 4: the soft-cap bends them
    loss = _loss(chunk, targets, g_logps, g_entropy, temperature, softcap)
    (_, (logps, entropy)), (g_hidden, g_weight) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(hidden, weight)
    want_logps, want_entropy, want_g_hidden, want_g_weight = _float64_reference(
        hidden, weight, targets, g_logps, g_entropy, temperature, softcap)
    assert logps.dtype == entropy.dtype == jnp.float32 and logps.shape == (B, C)
    logps_tol, entropy_tol = _logps_tolerances(hidden, weight, temperature)
    np.testing.assert_allclose(np.asarray(logps), want_logps, rtol=0, atol=logps_tol)
    np.testing.assert_allclose(np.asarray(entropy), want_entropy, rtol=0, atol=entropy_tol)
    # float32 against float64 by hand: the gradients are products of V = 37 (g_hidden) or B * C = 33
    # (g_weight) terms of |values| <= ~10; 1e-4 relative is ~800 float32 ulps, K * eps = 4.4e-6 of margin 20
    np.testing.assert_allclose(np.asarray(g_hidden), want_g_hidden, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(g_weight), want_g_weight, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("with_entropy", [True, False])
def test_gradients_equal_autodiff_of_the_unchunked_expression(with_entropy):
    hidden, weight, targets, g_logps, g_entropy = _inputs(seed=1, scale=2.0)
    grads = {chunk: jax.jit(jax.grad(lambda h, w, c=chunk: _loss(c, targets, g_logps, g_entropy, 0.8, 3.0,
                                                                 with_entropy)(h, w)[0], (0, 1)))(hidden, weight)
             for chunk in (0, 5)}  # jitted: one compile each, not one per primitive
    for got, want in zip(grads[5], grads[0]):  # two float32 programs: each entry sums <= V or B * C = 37 terms
        want = np.asarray(want)  # of size <= ~|want|, so 37 * eps * max|want| (4.4e-6 relative) covers any order
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=4 * 37 * EPS32 * np.abs(want).max())
    _, entropy = jax.jit(lambda h, w: lm_head_logps(h, w, targets, chunk_tokens=5, with_entropy=with_entropy))(
        hidden, weight)
    assert (np.asarray(entropy) == 0).all() != with_entropy


def test_bfloat16_parameters_give_the_unchunked_result_and_keep_their_dtype():
    hidden, weight, targets, g_logps, g_entropy = _inputs(seed=2)
    hidden, weight = jnp.asarray(hidden, jnp.bfloat16), jnp.asarray(weight, jnp.bfloat16)
    out = {chunk: jax.jit(jax.value_and_grad(_loss(chunk, targets, g_logps, g_entropy, 1.0, None), (0, 1),
                                             has_aux=True))(hidden, weight) for chunk in (0, 4)}
    (_, (logps, entropy)), (g_hidden, g_weight) = out[4]
    (_, (want_logps, want_entropy)), (want_g_hidden, want_g_weight) = out[0]
    assert logps.dtype == jnp.float32 and g_hidden.dtype == g_weight.dtype == jnp.bfloat16
    # Same bfloat16 products upcast to float32: only the float32 reductions' order differs.
    logps_tol, entropy_tol = _logps_tolerances(np.asarray(hidden, np.float32), np.asarray(weight, np.float32),
                                               against_exact=False)
    np.testing.assert_allclose(np.asarray(logps), np.asarray(want_logps), rtol=0, atol=logps_tol)
    np.testing.assert_allclose(np.asarray(entropy), np.asarray(want_entropy), rtol=0, atol=entropy_tol)
    # The weight's gradient is summed over chunks in float32 and rounded once: within bfloat16's 2^-8.
    for got, want in ((g_hidden, want_g_hidden), (g_weight, want_g_weight)):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_extreme_logits_stay_finite():
    hidden, weight, targets, g_logps, g_entropy = _inputs(seed=3, scale=300.0)  # logits ~ 1e3: a one-hot softmax
    (_, (logps, entropy)), grads = jax.jit(jax.value_and_grad(_loss(4, targets, g_logps, g_entropy, 1.0, None),
                                                              (0, 1), has_aux=True))(hidden, weight)
    assert all(np.isfinite(np.asarray(x)).all() for x in (logps, entropy, *grads))
    assert np.asarray(logps).min() < -100  # some target is far from the argmax: a large, finite log-prob
    want = _float64_reference(hidden, weight, targets, g_logps, g_entropy, 1.0, None)[0]
    np.testing.assert_allclose(np.asarray(logps), want, rtol=0, atol=_logps_tolerances(hidden, weight)[0])


@pytest.mark.parametrize("bad", [-1, True, 2.5, "64"])
def test_bad_chunk_sizes_are_refused_in_one_line(bad):
    hidden, weight, targets, *_ = _inputs()
    with pytest.raises(ValueError, match=r"chunk_tokens=.* must be a whole number of tokens >= 1 .* 0 / null") as error:
        lm_head_logps(hidden, weight, targets, chunk_tokens=bad)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
        lm_head_logps(hidden, weight, targets, temperature=0.0)


def test_the_config_field_checks_its_values():
    assert load_config({}).model.logits_chunk_tokens == DEFAULT_LOGITS_CHUNK_TOKENS
    assert load_config({"model": {"logits_chunk_tokens": None}}).model.logits_chunk_tokens is None
    assert load_config({"model": {"logits_chunk_tokens": 0}}).model.logits_chunk_tokens == 0
    for bad, reason in ((-1, ">= 0"), (2.5, "expected int"), ("many", "expected int")):
        with pytest.raises(ConfigError, match=rf"model.logits_chunk_tokens=.*{reason}"):
            load_config({"model": {"logits_chunk_tokens": bad}})


def test_lora_on_the_lm_head_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"targets has unknown name\(s\) \['lm_head'\]; choose from"):
        LoraConfig(targets=("q", "lm_head"))


def _naive_model_logps(model, prompt_ids, prompt_mask, completion_ids, temperature):
    """The model's own [B, T, V] logits (its lm_head or tied table, its soft-cap), log_softmax in float64."""
    ids = np.concatenate([prompt_ids, completion_ids], 1)
    mask = np.concatenate([prompt_mask, np.ones_like(completion_ids, bool)], 1)
    forward = jax.jit(lambda graphdef, params, i, m: nnx.merge(graphdef, params)(i, left_pad_positions(m),
                                                                                attention_mask=m)[0],
                      static_argnums=0)  # one compile, not one per primitive
    logits = forward(*nnx.split(model), jnp.asarray(ids), jnp.asarray(mask))
    p = prompt_ids.shape[1]
    y = np.asarray(logits, np.float64)[:, p - 1:-1] / temperature
    y = y - y.max(-1, keepdims=True)
    logp_all = y - np.log(np.exp(y).sum(-1, keepdims=True))
    logps = np.take_along_axis(logp_all, completion_ids[..., None], -1)[..., 0]
    return logps, -(np.exp(logp_all) * logp_all).sum(-1), np.abs(np.asarray(logits)).max() / temperature


@pytest.mark.parametrize("tied, softcap", [(True, None), (False, 1.5),
                                           pytest.param(True, 1.5, marks=pytest.mark.slow)])  # both features above
def test_a_decoder_through_token_logps_matches_its_own_logits(tied, softcap):
    """Tied and untied output projections, with and without Gemma 2's final soft-cap."""
    model = Decoder(tiny_config(vocab_size=61, tie_word_embeddings=tied, final_logit_softcapping=softcap),
                    rngs=nnx.Rngs(4))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(5)
    prompt_ids, completion_ids = rng.integers(0, 61, (2, 5)).astype(np.int32), rng.integers(0, 61, (2, 7)).astype(np.int32)
    prompt_mask = np.array([[False, True, True, True, True], [True] * 5])
    completion_mask = np.ones((2, 7), bool)
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask)

    def loss(prm, chunk):
        logps, entropy = token_logps_and_entropy(graphdef, prm, *batch, temperature=0.9, chunk_size=chunk)
        return jnp.sum(logps * jnp.arange(7.0)) + jnp.sum(entropy), (logps, entropy)

    out = {chunk: jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)(params, chunk) for chunk in (0, 3)}
    want_logps, want_entropy, scale = _naive_model_logps(model, prompt_ids, prompt_mask, completion_ids, 0.9)
    # two float32 evaluations of the network (token_logps' fused graph against the plain forward)
    logps_tol = log_softmax_tolerance(decoder_tolerance(scale, model.config, 12), 61)
    np.testing.assert_allclose(np.asarray(out[3][0][1][0]), want_logps, rtol=0, atol=logps_tol)
    np.testing.assert_allclose(np.asarray(out[3][0][1][1]), want_entropy, rtol=0, atol=logps_tol * (1 + np.log(61)))
    paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(out[0][1])]
    assert any("embed" in str(p) for p in paths) and any("lm_head" in str(p) for p in paths) != tied
    for path, got, want in zip(paths, jax.tree.leaves(out[3][1]), jax.tree.leaves(out[0][1])):
        want = np.asarray(want)
        # chunked against unchunked gradients of the same network: its rounding bound, relative to the gradient
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, err_msg=str(path),
                                   atol=decoder_tolerance(want, model.config, 12) + 1e-12)


def _largest_vocab_buffer(hlo: str, vocab: int) -> int:
    """Elements of the largest float32 array in `hlo` with a dimension of size `vocab`."""
    sizes = [int(np.prod([int(d) for d in dims.split(",")]))
             for dims in re.findall(r"f32\[([\d,]+)\]", hlo) if str(vocab) in dims.split(",")]
    return max(sizes, default=0)


def test_no_batch_by_time_by_vocab_buffer_is_compiled():
    b, c, h, vocab, chunk = 4, 512, 32, 8192, 256
    shapes = (jax.ShapeDtypeStruct((b, c, h), jnp.float32), jax.ShapeDtypeStruct((h, vocab), jnp.float32))
    rng = np.random.default_rng(0)
    targets, g = jnp.asarray(rng.integers(0, vocab, (b, c))), jnp.asarray(rng.normal(size=(b, c)), jnp.float32)
    full = b * c * vocab  # elements of [B, C, V]

    def compiled(chunk_tokens, grad):
        loss = lambda hh, w: jnp.sum(g * sum(lm_head_logps(hh, w, targets, chunk_tokens=chunk_tokens,  # noqa: E731
                                                           with_entropy=True)))
        return jax.jit(jax.grad(loss, (0, 1)) if grad else loss).lower(*shapes).compile()

    for grad in (False, True):
        off, on = compiled(0, grad), compiled(chunk, grad)
        # The measure can fail: unchunked, the logits are a [B, C, V] buffer (the gradient keeps several).
        assert _largest_vocab_buffer(off.as_text(), vocab) >= full
        assert off.memory_analysis().temp_size_in_bytes >= 4 * full
        # Chunked: nothing larger than one chunk of logits, and at most a few chunks at once.
        assert _largest_vocab_buffer(on.as_text(), vocab) <= chunk * vocab
        assert on.memory_analysis().temp_size_in_bytes <= 3 * 4 * chunk * vocab + 4 * 4 * h * vocab


MESH_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from rlbolt.models.lm_head_logps import lm_head_logps
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "tp"))
rng = np.random.default_rng(0)
h = jnp.asarray(rng.normal(size=(8, 13, 16)), jnp.float32)
w = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32)
t = jnp.asarray(rng.integers(0, 64, (8, 13)), jnp.int32)
g = jnp.asarray(rng.normal(size=(8, 13)), jnp.float32)
def loss(h, w, chunk):
    lp, en = lm_head_logps(h, w, t, chunk_tokens=chunk, with_entropy=True, softcap=3.0, temperature=0.8)
    return jnp.sum(lp * g) + jnp.sum(en)
grad = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)  # jitted: not op by op
want = grad(h, w, 0)
hs = jax.device_put(h, NamedSharding(mesh, P("data", None, None)))
ws = jax.device_put(w, NamedSharding(mesh, P(None, "tp")))
for chunk in (1, 24):
    got = grad(hs, ws, chunk)
    assert got[0].sharding.spec == P("data", None, None) and got[1].sharding.spec == P(None, "tp")
    assert max(float(jnp.abs(a - b).max()) for a, b in zip(got, want)) < 1e-4
print("ok")
"""


def test_rows_sharded_over_data_and_the_vocabulary_over_tp_give_the_one_device_gradients():
    """8 CPU devices (a fresh process: the device count is fixed when JAX starts)."""
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", MESH_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_frozen_weight_gets_no_gradient_product():
    """Under LoRA the lm_head (or tied table) is frozen: the backward must not form any block of its [H, V] gradient."""
    hidden, weight, targets, g_logps, g_entropy = _inputs(seed=4)
    only_hidden = jax.make_jaxpr(jax.grad(lambda h: _loss(5, targets, g_logps, g_entropy, 1.0, None)(h, weight)[0]))
    both = jax.make_jaxpr(jax.grad(lambda h, w: _loss(5, targets, g_logps, g_entropy, 1.0, None)(h, w)[0], (0, 1)))

    def products(jaxpr):  # the shapes every matrix product makes, inner jaxprs (the scans) included
        out = []
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                out += [tuple(v.aval.shape) for v in eqn.outvars]
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    out += products(inner)
        return out

    weight_grads = lambda jaxpr: [s for s in products(jaxpr) if len(s) == 2 and s[0] == H]  # noqa: E731
    assert weight_grads(both(hidden, weight).jaxpr)  # the measure can fail: [H, block] products of dW
    assert not weight_grads(only_hidden(hidden).jaxpr)


def test_vocabulary_blocks_with_padding_give_the_unchunked_gradients():
    """V = 300 over 128-column blocks: the backward's blocks are strided (columns j, j + 3, ...) over a
    vocabulary padded to 384; the padding columns must add nothing (targets at 0 and V - 1 included)."""
    from rlbolt.models.lm_head_logps import block_columns

    rng = np.random.default_rng(6)
    b, c, h, v = 2, 40, 8, 300
    hidden = rng.normal(size=(b, c, h)).astype(np.float32)
    weight = rng.normal(size=(h, v)).astype(np.float32)
    targets = rng.integers(0, v, (b, c)).astype(np.int32)
    targets[0, 0], targets[1, 1] = 0, v - 1
    g_logps, g_entropy = rng.normal(size=(b, c)).astype(np.float32), rng.normal(size=(b, c)).astype(np.float32)
    assert block_columns(v, b * c, 16) == 128  # three blocks, the last with 84 padding columns: the case tested
    grads = {chunk: jax.jit(jax.grad(lambda hh, w, chunk=chunk: _loss(chunk, targets, g_logps, g_entropy, 0.9,
                                                                      2.0)(hh, w)[0], (0, 1)))(hidden, weight)
             for chunk in (0, 16)}  # jitted: one compile each, not one per primitive
    for got, want in zip(grads[16], grads[0]):  # two float32 programs: each entry sums <= V = 300 or B * C = 80
        want = np.asarray(want)  # terms of size <= ~|want|, so 300 * eps * max|want| covers any order
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=4 * 300 * EPS32 * np.abs(want).max())
