"""`rlbolt fit` with model.lora on a Hugging Face folder, then `rlbolt export` (merged, and --adapter)
read back by transformers and peft, and a resume or export against another base refused in one line."""

import json
import shutil

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
import yaml
from data.test_tokenizers import CHATML, _build_backend
from flax import nnx
from float_tolerance import decoder_tolerance
from models.test_hf_config import hf_logits, rlbolt_logits

from rlbolt.app.cli import main
from rlbolt.app.cli_export import latest_params

LORA = {"rank": 4, "alpha": 8, "targets": ["q", "k", "v", "o", "gate", "up", "down"]}


def _base_folder(path, seed):
    """A Qwen2 folder (q/k/v biases, tied embeddings) with a BPE tokenizer, random weights by seed."""
    path.mkdir()
    backend = _build_backend()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "pad_token": "<pad>",
        "eos_token": "<|im_end|>", "chat_template": CHATML}))
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(vocab_size=backend.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cli")
    base, other = _base_folder(root / "base", 0), _base_folder(root / "other", 1)
    config = root / "lora.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(base), "lora": LORA}, "algorithm": {"lr": 0.05, "beta": 0.04},
        "plan": {"prompts_per_step": 2, "num_generations": 4}, "rollout": {"max_new_tokens": 6},
        "data": {"max_prompt_tokens": 64, "builtin_train_rows": 8},
        "reward": {"weights": {"digits": 1.0, "answer": 1.0}},
        "trainer": {"max_steps": 2, "run_dir": str(root / "run")},
        "callbacks": {"checkpoint_every_n_steps": 1, "metrics": ["jsonl"], "progress": False, "throughput": False},
    }))
    assert main(["fit", str(config)]) == 0
    return root / "run", base, other


def _ids(vocab):
    ids = np.random.default_rng(0).integers(3, vocab, (2, 9))
    return ids, np.ones(ids.shape, bool)


def test_merged_export_loads_in_transformers_with_the_lora_policy_logits(lora_run, tmp_path, capsys):
    run, base, _ = lora_run
    assert main(["export", str(run), str(tmp_path / "merged")]) == 0
    assert "checkpoint step 2" in capsys.readouterr().out
    module, step, _ = latest_params(run)
    assert step == 2 and module.lora is not None
    ids, mask = _ids(module.model.config.vocab_size)
    ours = rlbolt_logits(module.model, ids, mask)  # the adapted model holding the checkpoint's adapters
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    tolerance = decoder_tolerance(ours, module.model.config, ids.shape[1], adapter_rank=4)
    np.testing.assert_allclose(hf_logits(merged, ids, mask), ours, atol=tolerance, rtol=0)
    original = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert np.abs(hf_logits(original, ids, mask) - ours).max() > 100 * tolerance  # two steps moved the policy
    assert (tmp_path / "merged" / "tokenizer.json").is_file()


def test_adapter_export_loads_with_peft_on_the_base_folder(lora_run, tmp_path):
    run, base, _ = lora_run
    assert main(["export", str(run), str(tmp_path / "adapter"), "--adapter"]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8.0, str(base))
    module, _, _ = latest_params(run)
    ids, mask = _ids(module.model.config.vocab_size)
    original = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    served = peft.PeftModel.from_pretrained(original, tmp_path / "adapter").eval()
    ours = rlbolt_logits(module.model, ids, mask)
    np.testing.assert_allclose(hf_logits(served, ids, mask), ours, rtol=0,
                               atol=decoder_tolerance(ours, module.model.config, ids.shape[1], adapter_rank=4))
    adapters = sum(x.size for x in jax.tree.leaves(nnx.state(module.model, nnx.LoRAParam)))
    assert adapters == sum(p.numel() for n, p in served.named_parameters() if "lora_" in n)


def _on_other_base(run, other, tmp_path):
    moved = tmp_path / "run"
    shutil.copytree(run, moved)
    config = yaml.safe_load((moved / "config.yaml").read_text())
    config["model"]["path"] = str(other)
    (moved / "config.yaml").write_text(yaml.safe_dump(config))
    return moved


@pytest.mark.parametrize("command", ["resume", "export"])
def test_another_base_is_refused_in_one_line(lora_run, tmp_path, capsys, command):
    run, base, other = lora_run
    moved = _on_other_base(run, other, tmp_path)
    argv = [command, str(moved)] + ([str(tmp_path / "out")] if command == "export" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"rlbolt {command}: error: checkpoint in ")
    assert f"was trained on the base path={str(base)[:16]}" in err and f"this run loads path={str(other)[:16]}" in err
    assert "fingerprint=" in err and "point model.path at the base the run was trained on" in err
    assert not (tmp_path / "out").exists()


def test_adapter_export_of_a_full_fine_tuning_run_is_refused(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.yaml").write_text(yaml.safe_dump({"model": {"path": None, "lora": None}}))
    assert main(["export", str(tmp_path / "full"), str(tmp_path / "out"), "--adapter"]) == 2
    assert "trained every parameter (no LoRA), so it has no adapter to write; export without --adapter" in \
        capsys.readouterr().err
