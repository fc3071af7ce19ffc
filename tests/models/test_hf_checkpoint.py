"""load_hf / save_hf against transformers: same logits both ways, sharding, atomic writes, clear errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import transformers
from flax import nnx
from float_tolerance import decoder_tolerance
from models.test_hf_config import FAMILIES, MODEL_CLASSES, build_hf_model, hf_logits, rlbolt_logits
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models as tokenizer_models

from rlbolt.data.tokenizers import HFTokenizer
from rlbolt.models.decoder import Decoder
from rlbolt.models.hf_io import config_from_hf, load_hf, save_hf

NAMES = sorted(FAMILIES)


def _ids_and_mask(vocab_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, size=(3, 11))
    mask = np.ones(ids.shape, bool)
    mask[1, :4] = False  # left padding of 4 and 7 tokens
    mask[2, :7] = False
    return ids, mask


def _assert_same_logits(ours, theirs, config, mask=None):
    seq_len = ours.shape[-2]
    if mask is not None:  # padded positions are undefined in both implementations
        ours, theirs = ours[mask], theirs[mask]
    np.testing.assert_allclose(ours, theirs, atol=decoder_tolerance(theirs, config, seq_len), rtol=0)


@pytest.fixture(scope="module", params=NAMES)
def hf_folder(request, tmp_path_factory):
    """(family name, transformers model, folder it was saved to with save_pretrained)."""
    model = build_hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return request.param, model, folder


def test_load_hf_matches_transformers_logits(hf_folder):
    name, hf_model, folder = hf_folder
    model, config = load_hf(folder)
    assert config.architecture == MODEL_CLASSES[FAMILIES[name][0]].__name__
    ids, mask = _ids_and_mask(config.vocab_size)
    _assert_same_logits(rlbolt_logits(model, ids), hf_logits(hf_model, ids), config)
    _assert_same_logits(rlbolt_logits(model, ids, mask), hf_logits(hf_model, ids, mask), config, mask)


def test_load_hf_casts_to_bfloat16(hf_folder):
    _, _, folder = hf_folder
    model, config = load_hf(folder, param_dtype="bfloat16")
    reference, _ = load_hf(folder)  # float32, checked against transformers above
    assert config.param_dtype == "bfloat16"
    for ours, theirs in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reference))):
        assert ours.dtype == np.dtype("bfloat16")
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs).astype(ours.dtype))


def _random_rlbolt_model(name: str, tmp_path, seed: int = 3) -> tuple[Decoder, object]:
    """An rlbolt model whose every parameter (norm scales and biases too) is random."""
    config_class, kwargs = FAMILIES[name]
    config_class(**kwargs).save_pretrained(tmp_path)
    config = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    model = Decoder(config, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    rng = np.random.default_rng(seed)  # NumPy noise: eager jax.random compiles its programs for every shape
    for path, variable in nnx.to_flat_state(state):
        value = np.asarray(variable.get_value())
        noise = 0.1 * rng.standard_normal(value.shape)
        new = noise + (1.0 if path[-1] == "scale" else 0.0) + (value if value.ndim == 2 else 0.0)
        variable.set_value(jnp.asarray(new, value.dtype))
    nnx.update(model, state)
    return model, config


def _transformers_load(folder):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True, dtype=torch_float32())
    return model.eval(), info


def torch_float32():
    import torch

    return torch.float32


# Each family once; two of them sharded (20 kB shards: several files plus an index).
@pytest.mark.parametrize("name, max_shard_bytes", [
    ("llama_gqa_untied", None), ("llama32_tied_rope_scaling", 20_000), ("qwen2_bias", None),
    ("qwen3_qk_norm", 20_000), ("mistral_window", None), ("gemma2_softcap_tied", 20_000),
    ("gemma2_nocap_untied", None), ("gemma3_two_bases", None), ("qwen3_moe_top2", 20_000), ("qwen3_moe_top1", None)])
def test_save_hf_loads_in_transformers(tmp_path, name, max_shard_bytes):
    model, config = _random_rlbolt_model(name, tmp_path / "cfg")
    out = save_hf(model, config, tmp_path / "out", max_shard_bytes=max_shard_bytes)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    if max_shard_bytes is None:
        assert shards == ["model.safetensors"]
    else:
        assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
        assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    hf_model, info = _transformers_load(out)
    assert type(hf_model).__name__ == config.architecture
    problems = {key: value for key, value in info.items() if value and key != "error_msgs"}
    assert not problems and not info.get("error_msgs")
    ids, mask = _ids_and_mask(config.vocab_size, seed=1)
    _assert_same_logits(hf_logits(hf_model, ids), rlbolt_logits(model, ids), config)
    _assert_same_logits(hf_logits(hf_model, ids, mask), rlbolt_logits(model, ids, mask), config, mask)
    reloaded, reloaded_config = load_hf(out)  # and our own loader reads the (sharded) folder back
    assert reloaded_config == config
    for ours, theirs in zip(jax.tree.leaves(nnx.state(reloaded)), jax.tree.leaves(nnx.state(model))):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def test_save_hf_bfloat16_round_trip(tmp_path):
    model, config = load_hf(_saved_hf(tmp_path / "src", "qwen2_bias"), param_dtype="bfloat16")
    save_hf(model, config, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    reloaded, reloaded_config = load_hf(tmp_path / "out")
    assert reloaded_config.param_dtype == "bfloat16"
    for ours, theirs in zip(jax.tree.leaves(nnx.state(reloaded)), jax.tree.leaves(nnx.state(model))):
        assert ours.dtype == np.dtype("bfloat16")
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def _saved_hf(folder, name="llama_gqa_untied"):
    build_hf_model(name).save_pretrained(folder, safe_serialization=True)
    return folder


def _write_tokenizer(folder):
    folder.mkdir(parents=True)
    backend = RustTokenizer(tokenizer_models.WordLevel({"<pad>": 0, "</s>": 1, "hi": 2}, unk_token="<pad>"))
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    return folder


def test_save_hf_copies_tokenizer_and_replaces_atomically(tmp_path):
    model, config = load_hf(_saved_hf(tmp_path / "src"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from an older export")
    save_hf(model, config, out, tokenizer_folder=_write_tokenizer(tmp_path / "tok"))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert HFTokenizer.from_folder(out).encode("hi") == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src", "tok"]  # no temp folders left


def test_failed_save_leaves_existing_folder_untouched(tmp_path):
    model, config = load_hf(_saved_hf(tmp_path / "src"))
    save_hf(model, config, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    (tmp_path / "no_tokenizer").mkdir()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        save_hf(model, config, tmp_path / "out", tokenizer_folder=tmp_path / "no_tokenizer")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no_tokenizer", "out", "src"]
    with pytest.raises(FileExistsError, match="overwrite"):
        save_hf(model, config, tmp_path / "out", overwrite=False)


# ----------------------------------------------------------------------------- errors


def _error(folder, error_type=ValueError) -> str:
    with pytest.raises(error_type) as error:
        load_hf(folder)
    return str(error.value)


def test_truncated_safetensors_names_the_file(tmp_path):
    folder = _saved_hf(tmp_path / "m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    message = _error(folder)
    assert str(weights) in message and "truncated or corrupt" in message


def test_unknown_architecture_names_config_json(tmp_path):
    folder = _saved_hf(tmp_path / "m")
    hf = json.loads((folder / "config.json").read_text())
    hf["architectures"] = ["PhiForCausalLM"]
    (folder / "config.json").write_text(json.dumps(hf))
    message = _error(folder)
    assert str(folder / "config.json") in message and "PhiForCausalLM" in message
    assert "LlamaForCausalLM" in message


def test_missing_tensor_names_tensor_and_file(tmp_path):
    folder = _saved_hf(tmp_path / "m")
    weights = folder / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(weights))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.numpy.save_file(tensors, str(weights), metadata={"format": "pt"})
    message = _error(folder)
    assert "model.layers.1.mlp.up_proj.weight" in message and "model.safetensors" in message


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    folder = _saved_hf(tmp_path / "m")
    hf = json.loads((folder / "config.json").read_text())
    hf["intermediate_size"] = 64
    (folder / "config.json").write_text(json.dumps(hf))
    message = _error(folder)
    # down_proj is [H, I] in HF: 32 x 48 on disk, 32 x 64 according to the edited config
    assert "model.layers.0.mlp.down_proj.weight" in message and "(32, 48)" in message and "(32, 64)" in message
    assert str(folder / "model.safetensors") in message and str(folder / "config.json") in message


def test_missing_config_and_missing_weights(tmp_path):
    (tmp_path / "empty").mkdir()
    assert "config.json" in _error(tmp_path / "empty", FileNotFoundError)
    folder = _saved_hf(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    assert "model.safetensors" in _error(folder, FileNotFoundError)


def test_index_referencing_missing_shard(tmp_path):
    model, config = load_hf(_saved_hf(tmp_path / "src"))
    out = save_hf(model, config, tmp_path / "out", max_shard_bytes=20_000)
    (out / "model-00002-of-" f"{len(list(out.glob('model-*'))):05d}.safetensors").unlink()
    message = _error(out, FileNotFoundError)
    assert "model.safetensors.index.json" in message and "model-00002-of-" in message


def test_read_hf_config_checks_the_folder_without_loading_weights(tmp_path):
    from rlbolt.models import read_hf_config

    folder = _saved_hf(tmp_path / "m")
    _, loaded_config = load_hf(folder)
    assert read_hf_config(folder) == loaded_config
    (folder / "model.safetensors").rename(folder / "elsewhere.bin")
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        read_hf_config(folder)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_hf_config(tmp_path / "nope")
