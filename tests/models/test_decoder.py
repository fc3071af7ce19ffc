"""Decoder vs an independent float64 numpy forward; cached decode vs the full forward; layout."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.linen import logical_axis_rules

from float_tolerance import EPS32, bf16_tolerance, dot_error_bound
from rlbolt.models import Decoder, ModelConfig, init_cache, tiny_config
from rlbolt.models.rope import rope_inv_freq

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CONFIGS = {
    "llama_gqa": tiny_config(),
    "llama3_scaled_tied": tiny_config(rope_scaling=LLAMA3_SCALING, tie_word_embeddings=True, rope_theta=500000.0),
    "qwen2_bias": tiny_config(attention_bias=True, architecture="Qwen2ForCausalLM", num_kv_heads=1),
    "qwen3_qknorm": tiny_config(qk_norm=True, head_dim=32, architecture="Qwen3ForCausalLM", tie_word_embeddings=True),
}


def _randomized_model(config: ModelConfig, seed: int = 0) -> Decoder:
    """A model whose every parameter (norm scales, biases included) is non-trivial."""
    model = Decoder(config, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)

    def perturb(path, v):
        name = path[-1].key if hasattr(path[-1], "key") else str(path[-1])
        if name == "scale":
            return jnp.asarray(1.0 + 0.3 * rng.standard_normal(v.shape), v.dtype)
        return jnp.asarray(0.15 * rng.standard_normal(v.shape), v.dtype)

    state = jax.tree_util.tree_map_with_path(perturb, state)
    return nnx.merge(graphdef, state)


@functools.partial(jax.jit, static_argnums=0)
def _jit_call(graphdef, state, ids, positions, mask=None):
    """model(ids, positions, attention_mask=mask) as one compiled program (op by op, every primitive
    of every shape is its own compile)."""
    return nnx.merge(graphdef, state)(ids, positions, attention_mask=mask)


def _forward(model, ids, positions, mask=None):
    return _jit_call(*nnx.split(model), ids, positions, mask)


def _flat_params(model: Decoder) -> dict[str, np.ndarray]:
    _, state = nnx.split(model)
    return {".".join(map(str, path)): np.asarray(v[...], np.float64) for path, v in nnx.to_flat_state(state)}


def _ref_inv_freq(cfg: ModelConfig) -> np.ndarray:
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, d, 2) / d)
    if cfg.rope_scaling is None:
        return inv
    s = cfg.rope_scaling
    out = []
    for f in inv:  # Llama 3.1's piecewise rule, written per frequency
        wavelen = 2 * math.pi / f
        if wavelen < s["original_max_position_embeddings"] / s["high_freq_factor"]:
            out.append(f)
        elif wavelen > s["original_max_position_embeddings"] / s["low_freq_factor"]:
            out.append(f / s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append((1 - smooth) * f / s["factor"] + smooth * f)
    return np.array(out)


def _ref_forward(cfg: ModelConfig, p: dict, ids: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Float64 numpy Llama/Qwen forward with separate (unfused) math; returns logits [B, T, V]."""
    eps, nh, nkv, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    b, t = ids.shape

    def rms(x, w):
        return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps) * w

    angles = positions[..., None] * _ref_inv_freq(cfg)  # [B, T, D/2]
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]

    def rope(x):  # [B, T, N, D], halves convention
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    visible = np.tril(np.ones((t, t), bool))[None] & mask[:, None, :]  # [B, T, T]
    x = p["embed.embedding"][ids]
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        h = rms(x, p[pre + "attn_norm.scale"])
        w = p[pre + "attn.qkv_proj.kernel"]
        qkv = h @ w + (p[pre + "attn.qkv_proj.bias"] if cfg.attention_bias else 0.0)
        q = qkv[..., : nh * d].reshape(b, t, nh, d)
        k = qkv[..., nh * d: (nh + nkv) * d].reshape(b, t, nkv, d)
        v = qkv[..., (nh + nkv) * d:].reshape(b, t, nkv, d)
        if cfg.qk_norm:
            q, k = rms(q, p[pre + "attn.q_norm.scale"]), rms(k, p[pre + "attn.k_norm.scale"])
        q, k = rope(q), rope(k)
        k = np.repeat(k, nh // nkv, axis=2)
        v = np.repeat(v, nh // nkv, axis=2)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        scores = np.where(visible[:, None], scores, -1e300)  # finite: keeps pad rows NaN-free
        scores = scores - scores.max(-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, nh * d)
        x = x + attn @ p[pre + "attn.o_proj.kernel"]
        h = rms(x, p[pre + "mlp_norm.scale"])
        gu = h @ p[pre + "mlp.gate_up_proj.kernel"]
        gate, up = gu[..., : cfg.intermediate_size], gu[..., cfg.intermediate_size:]
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p[pre + "mlp.down_proj.kernel"]
    h = rms(x, p["final_norm.scale"])
    head = p["embed.embedding"].T if cfg.tie_word_embeddings else p["lm_head.kernel"]
    return h @ head


def _left_padded_batch(rng, cfg, lengths, t):
    ids = rng.integers(0, cfg.vocab_size, (len(lengths), t)).astype(np.int32)
    mask = np.zeros((len(lengths), t), bool)
    for row, n in enumerate(lengths):
        mask[row, t - n:] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return ids, mask, positions


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_forward_matches_float64_numpy_reference(name):
    cfg = CONFIGS[name]
    model = _randomized_model(cfg)
    ids, mask, positions = _left_padded_batch(np.random.default_rng(1), cfg, [12, 9, 1], 12)
    logits, cache = _forward(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask))
    assert cache is None and logits.dtype == jnp.float32 and logits.shape == (3, 12, cfg.vocab_size)
    ref = _ref_forward(cfg, _flat_params(model), ids, positions.astype(np.float64), mask)
    real = mask  # pad query rows attend to nothing; their outputs are undefined
    assert np.abs(np.asarray(logits)[real] - ref[real]).max() <= 1e-4
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("name", ["llama_gqa", "qwen3_qknorm"])
def test_cached_decode_matches_full_forward(name):
    cfg = CONFIGS[name]
    model = _randomized_model(cfg, seed=3)
    ids, mask, positions = _left_padded_batch(np.random.default_rng(2), cfg, [10, 6], 14)
    prompt_len = 8
    # Completion tokens are all real; only the prompt part is left-padded.
    mask[:, prompt_len:] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    full, _ = _forward(model, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask))

    cache = init_cache(cfg, batch_size=2, max_len=16)
    step = nnx.jit(lambda m, i, p, a, c: m(i, p, attention_mask=a, cache=c))
    first, cache = step(model, ids[:, :prompt_len], positions[:, :prompt_len], mask[:, :prompt_len], cache)
    pieces = [first]
    for t in range(prompt_len, 14):
        logits, cache = step(model, ids[:, t:t + 1], positions[:, t:t + 1], mask[:, t:t + 1], cache)
        pieces.append(logits)
    assert int(cache.index) == 14
    cached = np.concatenate([np.asarray(x) for x in pieces], axis=1)
    assert np.abs(cached[mask] - np.asarray(full)[mask]).max() <= 1e-4


def test_parameter_layout_and_logical_axes():
    cfg = tiny_config(attention_bias=True, qk_norm=True)
    _, state = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))
    flat = {path: v for path, v in nnx.to_flat_state(state)}
    h, d, q, kv, i = cfg.hidden_size, cfg.head_dim, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    expected = {
        ("embed", "embedding"): ((cfg.vocab_size, h), ("vocab", "embed")),
        ("layers", 1, "attn", "qkv_proj", "kernel"): ((h, q + 2 * kv), ("embed", "qkv")),
        ("layers", 1, "attn", "qkv_proj", "bias"): ((q + 2 * kv,), ("qkv",)),
        ("layers", 1, "attn", "q_norm", "scale"): ((d,), ("head_dim",)),
        ("layers", 1, "attn", "o_proj", "kernel"): ((q, h), ("heads", "embed")),
        ("layers", 1, "mlp", "gate_up_proj", "kernel"): ((h, 2 * i), ("embed", "mlp")),
        ("layers", 1, "mlp", "down_proj", "kernel"): ((i, h), ("mlp", "embed")),
        ("final_norm", "scale"): ((h,), ("embed",)),
        ("lm_head", "kernel"): ((h, cfg.vocab_size), ("embed", "vocab")),
    }
    for path, (shape, axes) in expected.items():
        assert flat[path].shape == shape, path
        assert flat[path].get_metadata()["out_sharding"] == axes, path
    assert len(flat) == 3 + cfg.num_layers * 9
    with logical_axis_rules([("embed", None), ("vocab", "tp"), ("qkv", "tp")]):
        specs = nnx.get_partition_spec(state)
    assert tuple(specs["lm_head"]["kernel"].get_value()) == (None, "tp")

    _, tied = nnx.split(Decoder(tiny_config(tie_word_embeddings=True), rngs=nnx.Rngs(0)))
    assert not any(path[0] == "lm_head" for path, _ in nnx.to_flat_state(tied))


def test_bfloat16_params_give_float32_logits_close_to_float32_model():
    cfg16 = tiny_config(param_dtype="bfloat16")
    m16 = Decoder(cfg16, rngs=nnx.Rngs(0))
    g32, _ = nnx.split(Decoder(tiny_config(), rngs=nnx.Rngs(0)))
    _, s16 = nnx.split(m16)
    m32 = nnx.merge(g32, jax.tree.map(lambda a: a.astype(jnp.float32), s16))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 8)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8))
    l16, _ = _forward(m16, ids, pos)
    l32, _ = _forward(m32, ids, pos)
    assert m16.embed.embedding[...].dtype == jnp.bfloat16 and l16.dtype == jnp.float32
    assert np.abs(np.asarray(l16) - np.asarray(l32)).max() < bf16_tolerance(l32, cfg16)


def test_rope_inv_freq_llama3_matches_reference():
    cfg = CONFIGS["llama3_scaled_tied"]
    got = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    # float32 pow and division (NumPy's SIMD kernels: within a few ulps on any CPU) against float64: 8 ulps
    np.testing.assert_allclose(got, _ref_inv_freq(cfg), rtol=8 * EPS32)
    assert not np.allclose(got, rope_inv_freq(cfg.head_dim, cfg.rope_theta, None))


@pytest.mark.parametrize("overrides, field", [
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(head_dim=15), "head_dim"),
    (dict(param_dtype="float16"), "param_dtype"),
    (dict(architecture="GPT2LMHeadModel"), "architecture"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    (dict(rope_scaling={"rope_type": "yarn"}), "rope_scaling"),
    (dict(vocab_size=0), "vocab_size"),
])
def test_validate_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


@pytest.mark.parametrize("tied, cap", [(True, None), (True, 2.5), (False, None)])
def test_next_token_logits_vocabulary_major_when_tied(tied, cap):
    """A decode step's logits: [V, B] (vocab_axis 0) with tied embeddings, [B, V] otherwise; the
    values of the embedding (or lm_head) product and soft-capping, against float64."""
    cfg = tiny_config(tie_word_embeddings=tied, final_logit_softcapping=cap)
    model = Decoder(cfg, rngs=nnx.Rngs(3))
    hidden = jax.random.normal(jax.random.key(4), (5, cfg.hidden_size))
    logits, axis = model.next_token_logits(hidden)
    head = np.asarray(model.embed.embedding[...], np.float64).T if tied else np.asarray(model.lm_head.kernel[...], np.float64)
    ref = np.asarray(hidden, np.float64) @ head
    if cap is not None:
        ref = cap * np.tanh(ref / cap)
    assert (axis, logits.dtype) == ((0 if tied else 1), jnp.float32)
    bound = dot_error_bound(np.asarray(hidden), head) / 2  # float32 product against float64's exact one
    np.testing.assert_allclose(np.asarray(logits), ref.T if tied else ref, rtol=0, atol=bound.max())  # tanh: 1-Lipschitz
