"""Fused attention (models/attention_kernels.py, `model.attention`) against the XLA path.

Reference: `rlbolt.models.attention.attend` with the [B, T, T] mask the decoder builds (causal AND
padding AND window), itself checked against transformers (tests/models/test_families.py). The
splash kernel runs on CPU through Pallas' interpret mode (the kernel's own program, interpreted);
the cuDNN path's rotation of left-padded rows runs through `jax.nn.dot_product_attention`'s XLA
backend here (the cuDNN kernel itself: benchmarks/gpu_attention.py on a GPU). Tolerances:
`attention_tolerance` for one attention, `decoder_tolerance` / `log_softmax_tolerance` for the
network, `bf16_tolerance` twice for two bfloat16 evaluations (each within one of the float32 model).
Only real tokens are compared: a padding query sees other padding keys under a kernel and nothing
under XLA; both are masked downstream.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import attention_tolerance, bf16_tolerance, decoder_tolerance, log_softmax_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.attention import attend
from rlbolt.models.attention_kernels import (KernelByKind, KernelCall, cudnn_attention, fused_attention,
                                             layer_kernel_calls, resolve_attention, splash_attention)
from rlbolt.models.cache import init_cache
from rlbolt.models.scan_layers import kernel_kinds
from rlbolt.rollout import token_logps

GEMMA_LIKE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=48, attn_logit_softcapping=5.0, sliding_window=7,
                  layer_types=("sliding_attention", "full_attention"))


def _qkv(b, t, seed=0, n_heads=4, n_kv=2, d=8):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (b, t, n_heads, d)), jax.random.normal(keys[1], (b, t, n_kv, d)),
            jax.random.normal(keys[2], (b, t, n_kv, d)))


@functools.partial(jax.jit, static_argnums=(4, 5, 6))  # one compile per case, not one per primitive
def _reference(q, k, v, segments, scale, cap, window):
    """The XLA path: attend() under causal AND same nonzero segment AND window."""
    t = q.shape[1]
    slots = jnp.arange(t)
    visible = (slots[:, None] >= slots[None])[None] & (segments[:, :, None] == segments[:, None, :])
    if window is not None:
        visible = visible & ((slots[:, None] - slots[None]) < window)[None]
    return attend(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), visible, scale=scale, cap=cap)


def test_model_attention_config_field_takes_one_of_three():
    from rlbolt.config import ConfigError, load_config

    assert load_config(None, []).model.attention == "auto"
    assert load_config(None, ["model.attention=flash"]).model.attention == "flash"
    with pytest.raises(ConfigError, match=r"^model.attention='splash' is not allowed; choose one of \['auto', 'xla', "
                                          r"'flash'\] \(did you mean 'flash'\?\)$"):
        load_config(None, ["model.attention=splash"])


def test_resolve_attention_per_platform_and_bad_values():
    assert [resolve_attention("auto", p) for p in ("cpu", "tpu", "gpu")] == ["xla", "splash", "cudnn"]
    assert [resolve_attention("flash", p) for p in ("tpu", "gpu")] == ["splash", "cudnn"]
    assert resolve_attention("xla", "tpu") == "xla"
    with pytest.raises(ValueError, match=r"model.attention='flash' has no fused kernel on cpu.*'auto' or 'xla'"):
        resolve_attention("flash", "cpu")
    with pytest.raises(ValueError, match=r"model.attention='splash'; use one of \('auto', 'xla', 'flash'\)"):
        resolve_attention("splash", "tpu")


@pytest.mark.parametrize("cap, window", [(None, None), (5.0, 6)])
def test_splash_equals_xla_attention_on_left_padded_and_packed_rows(cap, window):
    """T = 100 (padded to the 128-row block inside), GQA 4/2; row 0 left-padded, row 1 three packed
    samples and trailing padding, row 2 padding only (hostile: no real token). Gemma 2's soft-cap and
    a window shorter than the samples."""
    b, t = 3, 100
    q, k, v = _qkv(b, t)
    segments = np.zeros((b, t), np.int32)
    segments[0, 17:] = 1
    segments[1, :30], segments[1, 30:31], segments[1, 31:90] = 1, 2, 3
    segments = jnp.asarray(segments)
    scale = 8 ** -0.5
    splash = jax.jit(functools.partial(splash_attention, scale=scale, cap=cap, window=window, interpret=True))
    got = splash(q, k, v, segments).reshape(b, t, -1)  # jitted: the interpreted kernel compiles as one program
    want = _reference(q, k, v, segments, scale, cap, window)
    real = np.asarray(segments > 0)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=0,
                               atol=attention_tolerance(q * scale, k, v, t))
    # teeth: the window and the segments change the answer by far more than the tolerance
    unmasked = _reference(q, k, v, jnp.ones_like(segments), scale, cap, None)
    assert np.abs(np.asarray(unmasked)[real] - np.asarray(want)[real]).max() > 0.1


@pytest.mark.parametrize("window", [None, 5])
def test_cudnn_rotation_of_left_padded_rows_equals_xla(window):
    """Rows [pads][real][pads] rotated to start at 0 and attended with their length: row 0 without
    padding, row 1 left and right padding, row 2 one real token, row 3 none (hostile)."""
    b, t = 4, 24
    q, k, v = _qkv(b, t, seed=1)
    starts, ends = np.asarray([0, 7, 23, 0]), np.asarray([24, 19, 24, 0])
    real = (np.arange(t)[None] >= starts[:, None]) & (np.arange(t)[None] < ends[:, None])
    got = jax.jit(functools.partial(cudnn_attention, scale=0.3, window=window, implementation="xla"))(
        q, k, v, jnp.asarray(real))  # jitted: one compile, not one per primitive
    want = _reference(q, k, v, jnp.asarray(real, jnp.int32), 0.3, None, window)
    np.testing.assert_allclose(np.asarray(got).reshape(b, t, -1)[real], np.asarray(want)[real], rtol=0,
                               atol=attention_tolerance(q * 0.3, k, v, t))


def _batch(rows=4, prompt=12, completion=29, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, prompt + 1, rows)
    p_mask = np.arange(prompt)[None] >= prompt - lengths[:, None]
    p_ids = np.where(p_mask, rng.integers(1, 64, (rows, prompt)), 0)
    c_len = rng.integers(1, completion + 1, rows)
    c_len[0] = completion
    c_mask = np.arange(completion)[None] < c_len[:, None]
    c_ids = np.where(c_mask, rng.integers(1, 64, (rows, completion)), 0)
    return tuple(jnp.asarray(a) for a in (p_ids, p_mask, c_ids, c_mask))


def _logps_and_grads(config, kernel, batch, scan=False, group=1):
    model = Decoder(config, rngs=nnx.Rngs(3))
    model.attention_kernel, model.scan_layers = kernel, scan
    graphdef, params = nnx.split(model)

    def loss(p):
        logps = token_logps(graphdef, p, *batch, group_size=group)
        return jnp.sum(jnp.where(batch[3], logps, 0.0)), logps

    (_, logps), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return np.where(batch[3], logps, 0), grads


@pytest.mark.parametrize("overrides", [pytest.param({}, marks=pytest.mark.slow), GEMMA_LIKE], ids=["llama", "gemma2"])
def test_splash_logps_and_gradients_equal_xla(overrides):
    """The training forward (token_logps and its gradient) of a 2-layer model, float32: Llama-like,
    and Gemma-2-like (soft-capped scores, a sliding layer then a full one)."""
    config = tiny_config(**{**GEMMA_LIKE, "attn_logit_softcapping": None, "sliding_window": None,
                            "layer_types": None, **overrides})
    batch = _batch()
    seq = batch[0].shape[1] + batch[2].shape[1]
    (l_x, g_x), (l_s, g_s) = (_logps_and_grads(config, k, batch) for k in ("xla", "splash-interpret"))
    logits_bound = 8.0  # |logits| of this tiny model (tests/models/test_attention_chunks.py checks it)
    np.testing.assert_allclose(l_s, l_x, rtol=0,
                               atol=log_softmax_tolerance(decoder_tolerance(logits_bound, config, seq),
                                                          config.vocab_size))
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_x)):
        np.testing.assert_allclose(a, b, rtol=0, atol=decoder_tolerance(b, config, seq) + 1e-12)
    assert float(jnp.abs(jax.tree.leaves(g_x)[0]).max()) > 0


@pytest.mark.slow  # ~12 s of CPU
def test_prompt_shared_forward_runs_the_kernel_and_equals_xla():
    """The prompt once per group of 2 (shared_prefix.py, the default training and logps path): its
    fused variant against the XLA shared forward, Gemma-2-like layers, logps and gradients."""
    config = tiny_config(**GEMMA_LIKE)
    p_ids, p_mask, c_ids, c_mask = _batch(rows=2, completion=13)
    batch = (jnp.repeat(p_ids, 2, axis=0), jnp.repeat(p_mask, 2, axis=0), jnp.concatenate([c_ids, c_ids[::-1]]),
             jnp.concatenate([c_mask, c_mask[::-1]]))
    seq = batch[0].shape[1] + batch[2].shape[1]
    (l_x, g_x), (l_s, g_s) = (_logps_and_grads(config, k, batch, group=2) for k in ("xla", "splash-interpret"))
    np.testing.assert_allclose(l_s, l_x, rtol=0,
                               atol=log_softmax_tolerance(decoder_tolerance(8.0, config, seq), config.vocab_size))
    for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(g_x)):
        np.testing.assert_allclose(a, b, rtol=0, atol=decoder_tolerance(b, config, seq) + 1e-12)


@pytest.mark.slow
def test_splash_bfloat16_logits_within_two_bf16_bounds_of_xla():
    config = tiny_config(**{**GEMMA_LIKE, "param_dtype": "bfloat16"})
    p_ids, p_mask, c_ids, c_mask = _batch()
    ids, mask = jnp.concatenate([p_ids, c_ids], 1), jnp.concatenate([p_mask, c_mask], 1)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    out = {}
    for kernel in ("xla", "splash-interpret"):
        model = Decoder(config, rngs=nnx.Rngs(3))
        model.attention_kernel = kernel
        out[kernel] = np.asarray(model(ids, positions, attention_mask=mask)[0])
    real = np.asarray(mask)
    np.testing.assert_allclose(out["splash-interpret"][real], out["xla"][real], rtol=0,
                               atol=2 * bf16_tolerance(out["xla"][real], config))


@pytest.mark.slow
def test_prefill_into_a_fresh_cache_runs_the_kernel_and_fills_the_same_cache():
    """The rollout's prefill (a cache of exactly the prompt's slots): same hidden states and cached
    keys/values as XLA; a later decode step reading that cache stays XLA and agrees too."""
    config = tiny_config(**GEMMA_LIKE)
    p_ids, p_mask, _, _ = _batch()
    positions = jnp.maximum(jnp.cumsum(p_mask, axis=1) - 1, 0)
    out = {}
    for kernel in ("xla", "splash-interpret"):
        model = Decoder(config, rngs=nnx.Rngs(3))
        model.attention_kernel = kernel
        hidden, cache = model(p_ids, positions, attention_mask=p_mask, cache=init_cache(config, 4, 12),
                              return_hidden=True)
        out[kernel] = (np.asarray(hidden)[np.asarray(p_mask)], cache)
    atol = decoder_tolerance(8.0, config, 12)
    np.testing.assert_allclose(out["splash-interpret"][0], out["xla"][0], rtol=0, atol=atol)
    real = np.asarray(p_mask)
    slots_second = {"keys": (0, 3, 1, 2), "values": (0, 2, 1, 3)}  # [B, nKV, D, S] / [B, nKV, S, D] -> [B, S, ...]
    for name, axes in slots_second.items():
        for a, b in zip(getattr(out["splash-interpret"][1], name), getattr(out["xla"][1], name)):
            a, b = np.asarray(a).transpose(axes), np.asarray(b).transpose(axes)
            np.testing.assert_allclose(a[real], b[real], rtol=0, atol=atol)
    cache = out["splash-interpret"][1]
    assert int(cache.index) == 12 and np.array_equal(cache.mask, out["xla"][1].mask)


@pytest.mark.slow
def test_scanned_layers_run_the_kernel_too():
    config = tiny_config(**{**GEMMA_LIKE, "attn_logit_softcapping": None, "sliding_window": None, "layer_types": None})
    batch = _batch(rows=2)
    seq = batch[0].shape[1] + batch[2].shape[1]
    (l_x, _), (l_s, _) = (_logps_and_grads(config, k, batch, scan=True) for k in ("xla", "splash-interpret"))
    np.testing.assert_allclose(l_s, l_x, rtol=0,
                               atol=log_softmax_tolerance(decoder_tolerance(8.0, config, seq), config.vocab_size))


GEMMA3_LIKE = dict(GEMMA_LIKE, attn_logit_softcapping=None, num_layers=3, rope_local_theta=1000.0,
                   layer_types=("sliding_attention", "full_attention", "sliding_attention"))


def test_kernel_by_kind_runs_the_layers_own_kernel_under_one_jit():
    """KernelByKind with a traced flag (as the scan carries it): one compiled program, the windowed
    kernel for True and the causal one for False, each against the XLA reference; they differ."""
    b, t, window = 2, 40, 6
    q, k, v = _qkv(b, t, seed=1)
    segments = jnp.asarray(np.where(np.arange(t)[None] >= np.asarray([[0], [9]]), 1, 0), jnp.int32)
    scale = 8 ** -0.5
    full = KernelCall("splash-interpret", segments)
    local = KernelCall("splash-interpret", segments, window)
    run = jax.jit(lambda sliding: fused_attention(KernelByKind(sliding, full, local), q, k, v, scale=scale))
    real = np.asarray(segments > 0)
    for sliding, w in ((True, window), (False, None)):
        want = np.asarray(_reference(q, k, v, segments, scale, None, w)).reshape(b, t, -1)
        np.testing.assert_allclose(np.asarray(run(jnp.asarray(sliding)))[real], want[real], rtol=0,
                                   atol=attention_tolerance(q * scale, k, v, t))
    assert np.abs(np.asarray(run(jnp.asarray(True)) - run(jnp.asarray(False)))[real]).max() > 0.1
    assert run._cache_size() == 1


@pytest.mark.slow  # ~8 s of CPU (the kernels interpreted, a loop and a scan, forward and backward)
@pytest.mark.parametrize("kernel", ["splash-interpret", "xla"])
def test_layers_of_two_kinds_scan_with_a_kernel_each(kernel):
    """Gemma 3's sliding and full layers under splash need two kernels (static masks): the scanned body
    picks the layer's with `lax.cond` (KernelByKind) instead of falling back to the loop. Against the
    loop running the same kernels, logps and every gradient; the scan really ran (one scan, one cond)."""
    config = tiny_config(**GEMMA3_LIKE)
    batch = _batch(rows=2, completion=13)
    seq = batch[0].shape[1] + batch[2].shape[1]
    (l_loop, g_loop), (l_scan, g_scan) = (_logps_and_grads(config, kernel, batch, scan=s) for s in (False, True))
    np.testing.assert_allclose(l_scan, l_loop, rtol=0,
                               atol=log_softmax_tolerance(decoder_tolerance(8.0, config, seq), config.vocab_size))
    for a, b in zip(jax.tree.leaves(g_scan), jax.tree.leaves(g_loop)):
        np.testing.assert_allclose(a, b, rtol=0, atol=3 * decoder_tolerance(b, config, seq) + 1e-12)
    assert float(jnp.abs(jax.tree.leaves(g_loop)[0]).max()) > 0
    counts = {}
    for scan in (False, True):
        model = Decoder(config, rngs=nnx.Rngs(3))
        model.attention_kernel, model.scan_layers = kernel, scan
        ids, mask = jnp.concatenate(batch[:3:2], 1), jnp.concatenate(batch[1::2], 1)
        jaxpr = str(jax.make_jaxpr(lambda i, m: model(i, jnp.cumsum(m, 1), attention_mask=m)[0])(ids, mask))
        counts[scan] = (jaxpr.count(" scan["), jaxpr.count(" cond["))  # Pallas' interpreter has its own
    # The scanned forward: one more scan (the layers) and, under a kernel, one more cond (the kind's kernel).
    assert (counts[True][0] - counts[False][0], counts[True][1] - counts[False][1]) == (1, int(kernel != "xla"))


def test_kernel_kinds_of_the_layers():
    config = tiny_config(**GEMMA3_LIKE)
    full, local = KernelCall("splash", None), KernelCall("splash", None, 7)
    assert kernel_kinds(config, [local, full, local]) == (full, local)
    assert kernel_kinds(config, [None, None, None]) == (None, None)
    assert kernel_kinds(config, [local, full, KernelCall("splash", None, 7)]) is None  # a kind split in two
    assert kernel_kinds(config, [local, None, local]) is None  # fused and XLA in one scan: the loop runs
    assert kernel_kinds(tiny_config(num_layers=2), [full, full]) == (full, full)


def test_cudnn_falls_back_per_reason_and_logs_once(caplog):
    segments = jnp.ones((1, 4), jnp.int32)
    with caplog.at_level(logging.WARNING, logger="rlbolt.models"):
        assert layer_kernel_calls(tiny_config(**GEMMA_LIKE), "cudnn", segments) == [None, None]  # float32
        assert layer_kernel_calls(tiny_config(**GEMMA_LIKE), "cudnn", segments) == [None, None]
        bf16 = tiny_config(**{**GEMMA_LIKE, "param_dtype": "bfloat16"})
        assert layer_kernel_calls(bf16, "cudnn", segments) == [None, None]  # soft-capping
        plain = tiny_config(**{**GEMMA_LIKE, "param_dtype": "bfloat16", "attn_logit_softcapping": None})
        calls = layer_kernel_calls(plain, "cudnn", segments)
        assert layer_kernel_calls(plain, "cudnn", segments, packed=True) == [None, None]
    assert [(c.kernel, c.window) for c in calls] == [("cudnn", 7), ("cudnn", None)]
    assert isinstance(calls[0], KernelCall)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3 and "computes in float32" in messages[0] and "soft-capping" in messages[1]
    assert "packed" in messages[2]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (cuDNN)")
def test_cudnn_decoder_logits_and_gradients_equal_xla_in_bfloat16():
    """On a GPU: a bfloat16 Llama-like decoder (GQA, a sliding layer, left-padded rows) through cuDNN
    against XLA: logits at real tokens within two `bf16_tolerance`s, and the gradient of their sum."""
    config = tiny_config(**{**GEMMA_LIKE, "attn_logit_softcapping": None, "param_dtype": "bfloat16",
                            "num_heads": 8, "head_dim": 64, "hidden_size": 256})
    p_ids, p_mask, c_ids, c_mask = _batch(rows=4, prompt=60, completion=68)
    ids, mask = jnp.concatenate([p_ids, c_ids], 1), jnp.concatenate([p_mask, c_mask], 1)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    out = {}
    for kernel in ("xla", "cudnn"):
        model = Decoder(config, rngs=nnx.Rngs(3))
        model.attention_kernel = kernel
        graphdef, params = nnx.split(model)

        def loss(p):
            logits = nnx.merge(graphdef, p)(ids, positions, attention_mask=mask)[0]
            return jnp.sum(jnp.where(mask[..., None], logits, 0.0)), logits

        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
        out[kernel] = (np.asarray(logits)[np.asarray(mask)], grads)
    np.testing.assert_allclose(out["cudnn"][0], out["xla"][0], rtol=0,
                               atol=2 * bf16_tolerance(out["xla"][0], config))
    for a, b in zip(jax.tree.leaves(out["cudnn"][1]), jax.tree.leaves(out["xla"][1])):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # the backward rounds to bfloat16 at about as many stages again as the forward: twice the forward's bound
        np.testing.assert_allclose(a, b, rtol=0, atol=2 * 2 * bf16_tolerance(b, config))


def test_setup_resolves_model_attention_for_the_training_platform():
    """`LMPolicyModule.setup`: auto on this CPU host runs XLA; flash is refused in one line."""
    from rlbolt.app.build import build_module, build_plan
    from rlbolt.config import ConfigError, load_config
    from rlbolt.setup_context import SetupContext

    cfg = load_config(None, ["model.attention=auto"])
    module = build_module(cfg)
    module.setup(SetupContext(plan=build_plan(cfg)))
    assert module.model.attention_kernel == "xla"
    cfg = load_config(None, ["model.attention=flash"])
    with pytest.raises(ConfigError, match=r"^model.attention='flash' has no fused kernel on cpu .* use 'auto' or 'xla'\.$"):
        build_module(cfg).setup(SetupContext(plan=build_plan(cfg)))
