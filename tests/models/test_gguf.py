"""load_gguf_model against transformers: a GGUF file gives the model of its de-quantised weights.

Each test writes a small GGUF file with the `gguf` package's writer from a tiny random
transformers model, the way llama.cpp's converter lays it out (GGUF names, llama's q/k rows
interleaved per head, no output.weight when tied, rope_freqs for Llama 3.1 scaling), with its
matrices stored in one quantisation type. The reference is the transformers model holding the
file's de-quantised weights, decoded here by independent NumPy code written from the block
formats (ggml's block_q8_0, block_q4_0, block_q4_1, block_q4_K, block_q6_K): both loaders must
give the same logits to float32 rounding. K-quant blocks cannot be produced by the gguf package,
so those files hold random (valid) blocks.
"""

import numpy as np
import pytest
import torch
import transformers
from models.test_hf_config import FAMILIES, MODEL_CLASSES, hf_logits, rlbolt_logits

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from float_tolerance import decoder_tolerance  # noqa: E402

from rlbolt.models.gguf_io import load_gguf_model, read_gguf_config  # noqa: E402
from rlbolt.models.hf_io import load_hf  # noqa: E402

# Rows of 256 values, so every matrix can be stored in any block type (K-quants: 256 per block).
DIMS = dict(vocab_size=96, hidden_size=256, intermediate_size=256, head_dim=64)
ARCH = {"llama_gqa_untied": "llama", "llama32_tied_rope_scaling": "llama", "qwen2_bias": "qwen2",
        "qwen3_qk_norm": "qwen3"}
LAYER_NAMES = {  # Hugging Face name (after model.layers.N.) -> GGUF name (after blk.N.), llama.cpp's tensor map
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}


# ----------------------------------------------------------------------------- block formats, decoded by hand


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)


def decode_blocks(raw: np.ndarray, qtype) -> np.ndarray:
    """[rows, bytes] of one block type -> [rows, values] float32, from ggml's block definitions."""
    rows = raw.shape[0]
    if qtype == Q.F32:
        return raw.view(np.float32).reshape(rows, -1)
    if qtype == Q.F16:
        return raw.view(np.float16).astype(np.float32).reshape(rows, -1)
    if qtype == Q.BF16:  # the high half of a float32
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(rows, -1)
    size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
    blocks = raw.reshape(-1, size)
    out = []
    for b in blocks:
        if qtype == Q.Q8_0:  # d: f16, qs: 32 x int8; x = d * q
            out.append(_f16(b[:2]) * b[2:].view(np.int8).astype(np.float32))
        elif qtype == Q.Q4_0:  # d, qs[16]: x[j] = d * (low nibble - 8), x[j + 16] = d * (high nibble - 8)
            q = b[2:]
            out.append(_f16(b[:2]) * (np.concatenate([q & 15, q >> 4]).astype(np.float32) - 8))
        elif qtype == Q.Q4_1:  # d, m, qs[16]: x = d * nibble + m
            q = b[4:]
            out.append(_f16(b[:2]) * np.concatenate([q & 15, q >> 4]).astype(np.float32) + _f16(b[2:4]))
        elif qtype == Q.Q4_K:
            out.append(_decode_q4_k(b))
        else:
            out.append(_decode_q6_k(b))
    return np.concatenate(out).reshape(rows, -1)


def _decode_q4_k(b: np.ndarray) -> np.ndarray:
    # d, dmin: f16; scales[12]: eight 6-bit (scale, min) pairs; qs[128]: 256 nibbles.
    d, dmin, s, qs = _f16(b[0:2])[0], _f16(b[2:4])[0], b[4:16].astype(np.int64), b[16:144].astype(np.int64)
    y = np.zeros(256, np.float32)
    for j in range(8):
        if j < 4:
            sc, m = s[j] & 63, s[j + 4] & 63
        else:
            sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4)
            m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4)
        chunk = qs[32 * (j // 2): 32 * (j // 2) + 32]
        q = chunk & 15 if j % 2 == 0 else chunk >> 4  # sub-block 2c: low nibbles of chunk c, 2c+1: high
        y[32 * j: 32 * j + 32] = d * sc * q - dmin * m
    return y


def _decode_q6_k(b: np.ndarray) -> np.ndarray:
    # ql[128]: low 4 bits, qh[64]: high 2 bits, scales[16]: int8, d: f16; x = d * scale * (q - 32).
    ql, qh = b[0:128].astype(np.int64), b[128:192].astype(np.int64)
    sc, d = b[192:208].view(np.int8).astype(np.float32), _f16(b[208:210])[0]
    y = np.zeros(256, np.float32)
    for half in range(2):
        lo, hi, s, base = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
        for i in range(32):
            quads = (((lo[i] & 15) | ((hi[i] & 3) << 4)), ((lo[i + 32] & 15) | (((hi[i] >> 2) & 3) << 4)),
                     ((lo[i] >> 4) | (((hi[i] >> 4) & 3) << 4)), ((lo[i + 32] >> 4) | (((hi[i] >> 6) & 3) << 4)))
            for k, q in enumerate(quads):
                y[base + 32 * k + i] = d * s[i // 16 + 2 * k] * (q - 32)
    return y


def random_k_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Valid random K-quant blocks ([rows, bytes]): random bytes with small finite f16 scales."""
    size = {Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    if qtype == Q.Q4_K:  # x = d*sc*q - dmin*m with sc, m < 64 and q < 16: keep |x| around 0.1
        raw[:, 0:2] = np.full(len(raw), 2e-4, np.float16).view(np.uint8).reshape(-1, 2)
        raw[:, 2:4] = rng.uniform(1e-4, 5e-4, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    else:
        raw[:, 208:210] = rng.uniform(1e-4, 3e-4, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


# ----------------------------------------------------------------------------- GGUF files, as llama.cpp writes them


def build_family_model(name: str, seed: int = 0, **overrides):
    """A float32 transformers model of a test_hf_config family at DIMS, norms and biases random."""
    config_class, kwargs = FAMILIES[name]
    torch.manual_seed(seed)
    model = MODEL_CLASSES[config_class](config_class(**{**kwargs, **DIMS, **overrides})).to(torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif param_name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model


def interleave_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: in each head, HF rows (0, D/2, 1, D/2 + 1, ...)."""
    head_dim = weight.shape[0] // heads
    order = np.stack([np.arange(head_dim // 2), np.arange(head_dim // 2) + head_dim // 2], axis=1).reshape(-1)
    index = (np.arange(heads)[:, None] * head_dim + order[None, :]).reshape(-1)
    return weight[index]


def _llama3_rope_factors(config, head_dim: int) -> np.ndarray:
    # Llama 3.1's rule, per frequency: 1 for short wavelengths, `factor` for long, smooth between.
    scaling = config.rope_parameters
    theta = scaling["rope_theta"]
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    old, low, high = (scaling["original_max_position_embeddings"], scaling["low_freq_factor"], scaling["high_freq_factor"])
    smooth = (old / wavelen - low) / (high - low)
    factors = np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, scaling["factor"],
                                                           1.0 / ((1 - smooth) / scaling["factor"] + smooth)))
    return factors.astype(np.float32)


def write_gguf(path, name: str, model, qtype, *, arch: str | None = None, extra_tensors=(), seed: int = 0,
               metadata=None, add_tokenizer=None, drop=()) -> dict[str, np.ndarray]:
    """Writes `model` as a GGUF file with its matrices in `qtype`; returns the HF tensors the file holds.

    Vectors (norms, biases) stay float32, as llama.cpp keeps them. `add_tokenizer(writer)` adds
    tokenizer metadata.
    """
    rng = np.random.default_rng(seed)
    config, family_arch = model.config, ARCH[name]
    arch = arch or family_arch
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    for key, value in (metadata or {}).items():
        writer.add_uint32(key, value)
    if add_tokenizer is not None:
        add_tokenizer(writer)
    expected = {}
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, value in state.items():
        if hf_name in GLOBAL_NAMES:
            gguf_name = GLOBAL_NAMES[hf_name]
        else:
            layer, rest = hf_name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{LAYER_NAMES[rest]}"
        if gguf_name in drop:
            continue
        stored = value
        if family_arch == "llama" and rest_of(hf_name) in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            stored = interleave_rows(value, heads if "q_proj" in hf_name else kv_heads)
        if value.ndim == 1:
            raw, kind = stored.astype(np.float32), Q.F32
        elif qtype in (Q.Q4_K, Q.Q6_K):
            raw, kind = random_k_blocks(*stored.shape, qtype, rng), qtype
        else:
            raw, kind = gguf.quants.quantize(stored.astype(np.float32), qtype), qtype
        writer.add_tensor(gguf_name, raw, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
        decoded = decode_blocks(raw.reshape(stored.shape[0], -1).view(np.uint8), kind).reshape(stored.shape)
        if decoded is not stored and family_arch == "llama" and rest_of(hf_name) in (
                "self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads_here = heads if "q_proj" in hf_name else kv_heads
            decoded = decoded[np.argsort(interleave_rows(np.arange(len(decoded)), heads_here))]
        expected[hf_name] = decoded
    if config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(config, config.head_dim))
    for tensor_name, value in extra_tensors:
        writer.add_tensor(tensor_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def rest_of(hf_name: str) -> str:
    return hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name


def reference_model(name: str, expected: dict[str, np.ndarray]):
    """The transformers model holding the file's de-quantised weights."""
    model = build_family_model(name)
    state = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in expected.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def _ids(vocab_size: int):
    ids = np.random.default_rng(1).integers(0, vocab_size, size=(2, 13))
    mask = np.ones(ids.shape, bool)
    mask[1, :5] = False
    return ids, mask


def _metadata_for(name):
    # the llama3 family case uses a short original context; llama.cpp records it under this key
    return {"llama.rope.scaling.original_context_length": 16} if name == "llama32_tied_rope_scaling" else None


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", sorted(ARCH))  # the families a GGUF file can hold
def test_f32_file_equals_transformers_for_every_family(tmp_path, name):
    """Names, llama's q/k row order, Qwen2 biases, Qwen3 q/k norms, tied embeddings, rope_freqs."""
    model = build_family_model(name)
    expected = write_gguf(tmp_path / "m.gguf", name, model, Q.F32, metadata=_metadata_for(name))
    for key, value in model.state_dict().items():  # F32 stores the weights unchanged
        if key in expected:
            np.testing.assert_array_equal(expected[key], value.numpy())
    ours, config = load_gguf_model(tmp_path / "m.gguf")
    assert config.tie_word_embeddings == model.config.tie_word_embeddings
    assert config.architecture == type(model).__name__
    ids, mask = _ids(config.vocab_size)
    theirs = hf_logits(model, ids, mask)
    np.testing.assert_allclose(rlbolt_logits(ours, ids, mask)[mask], theirs[mask], rtol=0,
                               atol=decoder_tolerance(theirs[mask], config, ids.shape[1]))
    if name == "llama32_tied_rope_scaling":
        assert config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_quantized_file_equals_its_dequantized_weights(tmp_path, qtype):
    """Each block type: the loaded model is the transformers model of the hand-decoded weights,
    and equals `load_hf` of a Hugging Face folder holding them (untied llama: q/k rows and lm_head)."""
    name = "llama_gqa_untied"
    model = build_family_model(name)
    expected = write_gguf(tmp_path / "m.gguf", name, model, qtype)
    reference = reference_model(name, expected)
    original = model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    decoded = expected["model.layers.0.self_attn.q_proj.weight"]
    if qtype not in (Q.Q4_K, Q.Q6_K):  # a real quantisation of the weights: close, and not equal (but F16/BF16)
        assert np.abs(decoded - original).max() <= 0.2 * np.abs(original).max()
    ours, config = load_gguf_model(tmp_path / "m.gguf", param_dtype="float32")
    ids, mask = _ids(config.vocab_size)
    theirs = hf_logits(reference, ids, mask)
    assert np.abs(theirs[mask]).max() > 0.1  # the logits have teeth
    np.testing.assert_allclose(rlbolt_logits(ours, ids, mask)[mask], theirs[mask], rtol=0,
                               atol=decoder_tolerance(theirs[mask], config, ids.shape[1]))
    reference.save_pretrained(tmp_path / "hf", safe_serialization=True)
    from_folder, _ = load_hf(tmp_path / "hf")
    # the same rlbolt program on the same float32 weights (f16/K-quant values are exact in float32): bit equality
    np.testing.assert_array_equal(rlbolt_logits(ours, ids, mask), rlbolt_logits(from_folder, ids, mask))


def test_k_quant_decoders_agree_with_the_gguf_package():
    """The test's own K-quant decoding (from ggml's block layout) equals gguf.quants on random blocks."""
    rng = np.random.default_rng(3)
    for qtype in (Q.Q4_K, Q.Q6_K):
        raw = random_k_blocks(3, 512, qtype, rng)
        ours = decode_blocks(raw, qtype)
        np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype).reshape(3, 512))
        assert np.isfinite(ours).all() and len(np.unique(ours)) > 100


def test_qwen3_q4_k_file_and_bfloat16_default(tmp_path):
    """A tied Qwen3 in Q4_K equals its decoded weights; a BF16 file loads as bfloat16 by default."""
    name = "qwen3_qk_norm"
    model = build_family_model(name)
    expected = write_gguf(tmp_path / "q.gguf", name, model, Q.Q4_K)
    ours, config = load_gguf_model(tmp_path / "q.gguf")
    assert config.param_dtype == "float32" and config.qk_norm and config.tie_word_embeddings
    ids, mask = _ids(config.vocab_size)
    theirs = hf_logits(reference_model(name, expected), ids, mask)
    np.testing.assert_allclose(rlbolt_logits(ours, ids, mask)[mask], theirs[mask], rtol=0,
                               atol=decoder_tolerance(theirs[mask], config, ids.shape[1]))
    write_gguf(tmp_path / "b.gguf", name, model, Q.BF16)
    assert read_gguf_config(tmp_path / "b.gguf").param_dtype == "bfloat16"
    assert read_gguf_config(tmp_path / "b.gguf", param_dtype="float32").param_dtype == "float32"
    bf16, _ = load_gguf_model(tmp_path / "b.gguf")
    kernel = np.asarray(bf16.layers[0].attn.qkv_proj.kernel.get_value())
    assert kernel.dtype.name == "bfloat16"  # BF16 values are exact in bfloat16: the first q row, transposed
    np.testing.assert_array_equal(kernel[:, 0].astype(np.float32),
                                  decode_blocks(gguf.quants.quantize(model.state_dict()[
                                      "model.layers.0.self_attn.q_proj.weight"].numpy()[:1], Q.BF16), Q.BF16)[0])


def test_unsupported_architecture_is_refused_in_one_line(tmp_path):
    write_gguf(tmp_path / "g.gguf", "llama_gqa_untied", build_family_model("llama_gqa_untied"), Q.F32, arch="gemma")
    with pytest.raises(ValueError, match=r"general.architecture='gemma' is not supported") as error:
        load_gguf_model(tmp_path / "g.gguf")
    assert "\n" not in str(error.value)


def test_tensors_the_decoder_lacks_are_refused(tmp_path):
    """An o_proj bias (which rlbolt's decoder does not have) is named, not dropped."""
    model = build_family_model("llama_gqa_untied")
    write_gguf(tmp_path / "b.gguf", "llama_gqa_untied", model, Q.F32,
               extra_tensors=[("blk.0.attn_output.bias", np.ones(256, np.float32))])
    with pytest.raises(ValueError, match=r"blk.0.attn_output.bias have no place"):
        load_gguf_model(tmp_path / "b.gguf")


def test_a_missing_tensor_is_named(tmp_path):
    model = build_family_model("llama_gqa_untied")
    write_gguf(tmp_path / "m.gguf", "llama_gqa_untied", model, Q.F32, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"tensor blk.1.ffn_up.weight is missing") as error:
        load_gguf_model(tmp_path / "m.gguf")
    assert "\n" not in str(error.value)


def test_bad_rope_freqs_and_bad_files_are_refused(tmp_path):
    model = build_family_model("llama_gqa_untied")
    factors = np.linspace(1.0, 3.0, 32).astype(np.float32)  # not Llama 3.1's rule
    write_gguf(tmp_path / "r.gguf", "llama_gqa_untied", model, Q.F32, extra_tensors=[("rope_freqs.weight", factors)])
    with pytest.raises(ValueError, match="rope_freqs.weight does not follow Llama 3.1"):
        read_gguf_config(tmp_path / "r.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf_model(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 11)
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        load_gguf_model(tmp_path / "junk.gguf")
    full = (tmp_path / "r.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(full[: len(full) // 2])
    with pytest.raises(ValueError, match="is not a readable GGUF file"):
        load_gguf_model(tmp_path / "cut.gguf")


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen2_bias", "qwen3_qk_norm"])
def test_same_logits_as_transformers_reading_the_same_file(tmp_path, name):
    """transformers' own GGUF loader (`gguf_file=`: its name map, q/k un-permutation and
    de-quantiser) is an independent reading of the file. (Its Qwen3 config ignores
    attention.key_length and takes head_dim 128, so the Qwen3 case has heads of 128.)"""
    overrides = dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128) if name == "qwen3_qk_norm" else {}
    model = build_family_model(name, **overrides)
    write_gguf(tmp_path / "m.gguf", name, model, Q.Q8_0)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).eval()
    ours, config = load_gguf_model(tmp_path / "m.gguf")
    ids, mask = _ids(config.vocab_size)
    want = hf_logits(theirs, ids, mask)[mask]
    np.testing.assert_allclose(rlbolt_logits(ours, ids, mask)[mask], want, atol=decoder_tolerance(want, config, ids.shape[1]),
                               rtol=0)


_SHARDED_CHECK = """
import sys, jax, numpy as np
from flax import nnx
from rlbolt.distributed import MeshSpec, ShardingPlan
from rlbolt.models.gguf_io import load_gguf_model
plan = ShardingPlan(MeshSpec(fsdp=2, tp=2).build())
plain, _ = load_gguf_model(sys.argv[1])
sharded, _ = load_gguf_model(sys.argv[1], sharding=plan)
a, b = jax.tree.leaves(nnx.state(plain)), jax.tree.leaves(nnx.state(sharded))
assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
wanted = jax.tree.leaves(plan.param_shardings(nnx.state(sharded)))
assert all(x.sharding == s for x, s in zip(b, wanted))
assert sum(not x.sharding.is_fully_replicated for x in b) >= 8
print("SHARDED_OK")
"""


@pytest.mark.slow
def test_sharded_load_places_each_tensor_as_planned(tmp_path):
    """A GGUF file read straight into a 2 x 2 (fsdp x tp) mesh's shardings equals the plain read."""
    import os
    import subprocess
    import sys

    write_gguf(tmp_path / "m.gguf", "qwen2_bias", build_family_model("qwen2_bias"), Q.Q8_0)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", _SHARDED_CHECK, str(tmp_path / "m.gguf")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert "SHARDED_OK" in result.stdout, result.stderr[-3000:]
