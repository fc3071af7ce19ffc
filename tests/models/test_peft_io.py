"""LoRA out to the formats people serve, checked by the libraries that read them: the merged model
through `transformers`, the adapter folder through `peft` on top of the base folder."""

import json

import jax
import numpy as np
import peft
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from float_tolerance import decoder_tolerance
from models.test_hf_config import build_hf_model, hf_logits, rlbolt_logits

from rlbolt.models.hf_io import load_hf, save_hf
from rlbolt.models.lora import HF_MODULES, LoraConfig, apply_lora, merge_adapters
from rlbolt.models.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_peft_adapter

CASES = [("llama_gqa_untied", ("q", "v")), ("qwen2_bias", ("q", "k", "v", "o", "gate", "up", "down")),
         ("qwen3_qk_norm", ("k", "up", "down")), ("gemma2_softcap_tied", ("q", "v", "gate", "down")),
         ("gemma3_two_bases", ("k", "o", "up")), ("mistral_window", ("q", "v"))]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def adapted(request, tmp_path_factory):
    """(base folder, transformers base model, rlbolt adapted Decoder with non-zero adapters, LoraConfig)."""
    name, targets = request.param
    folder = tmp_path_factory.mktemp(name) / "base"
    hf = build_hf_model(name)
    hf.save_pretrained(folder, safe_serialization=True)
    model, _ = load_hf(folder)
    lora = LoraConfig(rank=4, alpha=12.0, targets=targets)
    adapted = apply_lora(model, lora, rngs=nnx.Rngs(0))
    adapters = nnx.state(adapted, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(adapters))))
    nnx.update(adapted, jax.tree.map(lambda x: 0.3 * jax.random.normal(next(keys), x.shape), adapters))
    return folder, hf, adapted, lora


def _ids(vocab):
    ids = np.random.default_rng(0).integers(0, vocab, (3, 10))
    mask = np.ones(ids.shape, bool)
    mask[1, :3] = False  # left padding
    return ids, mask


def test_merged_export_loads_in_transformers_with_the_lora_logits(adapted, tmp_path):
    folder, hf_base, model, _ = adapted
    out = save_hf(merge_adapters(model), model.config, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids, mask = _ids(model.config.vocab_size)
    ours = rlbolt_logits(model, ids, mask)
    tolerance = decoder_tolerance(ours[mask], model.config, ids.shape[1])
    np.testing.assert_allclose(hf_logits(merged, ids, mask)[mask], ours[mask], atol=tolerance, rtol=0)
    assert np.abs(hf_logits(hf_base, ids, mask)[mask] - ours[mask]).max() > 100 * tolerance  # adapters matter


def test_peft_adapter_loads_on_the_base_folder_with_the_lora_logits(adapted, tmp_path):
    folder, _, model, lora = adapted
    out = save_peft_adapter(model, lora, tmp_path / "adapter", base_model=str(folder))
    config = json.loads((out / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 12.0)
    assert config["target_modules"] == sorted(HF_MODULES[t].split(".")[1] for t in lora.targets)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, out).eval()
    ids, mask = _ids(model.config.vocab_size)
    ours = rlbolt_logits(model, ids, mask)[mask]
    np.testing.assert_allclose(hf_logits(with_adapter, ids, mask)[mask], ours, rtol=0,
                               atol=decoder_tolerance(ours, model.config, ids.shape[1], adapter_rank=lora.rank))


def test_trainable_count_matches_peft_on_the_unfused_model(adapted):
    folder, _, model, lora = adapted
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    reference = peft.get_peft_model(base, peft.LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, target_modules=[HF_MODULES[t].split(".")[1] for t in lora.targets]))
    trainable, _ = reference.get_nb_trainable_parameters()
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.LoRAParam))) == trainable


def test_adapter_tensors_are_transposed_pairs(adapted, tmp_path):
    _, _, model, lora = adapted
    out = save_peft_adapter(model, lora, tmp_path / "adapter")
    tensors = safetensors.numpy.load_file(str(out / ADAPTER_WEIGHTS))
    target = lora.targets[0]
    name = f"base_model.model.model.layers.1.{HF_MODULES[target]}"
    site = {"q": "attn.qkv_proj", "k": "attn.qkv_proj", "v": "attn.qkv_proj", "o": "attn.o_proj",
            "gate": "mlp.gate_up_proj", "up": "mlp.gate_up_proj", "down": "mlp.down_proj"}[target].split(".")
    pair = getattr(getattr(getattr(model.layers[1], site[0]), site[1]).lora, target)
    np.testing.assert_array_equal(tensors[f"{name}.lora_A.weight"], np.asarray(pair.lora_a[...]).T)
    np.testing.assert_array_equal(tensors[f"{name}.lora_B.weight"], np.asarray(pair.lora_b[...]).T)
    assert len(tensors) == 2 * len(lora.targets) * model.config.num_layers
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        save_peft_adapter(model, lora, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no staging folder left behind
