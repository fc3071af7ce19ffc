"""The GPU route of a recipe, run on CPU with files the test writes: a Hugging Face model folder
(transformers Qwen2, safetensors, a real BPE tokenizer.json with a chat template) and GSM8K rows in
a parquet file, trained through `recipes/grpo_gsm8k.py` with `model.path` and `data.train`."""

import json
import math

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers
from data.test_tokenizers import CHATML, _build_backend
from recipes.test_recipes import _load, _Record

from rlbolt.data import gsm8k_style_rows


def _hf_folder(path):
    backend = _build_backend()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "pad_token": "<pad>",
        "eos_token": "<|im_end|>", "chat_template": CHATML}))
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=backend.get_vocab_size(), hidden_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    return path


def test_grpo_recipe_on_a_local_hf_model_and_parquet_rows(tmp_path):
    (tmp_path / "qwen").mkdir()
    model_dir = _hf_folder(tmp_path / "qwen")
    rows = gsm8k_style_rows(8)
    parquet = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)

    record = _Record()
    overrides = [
        f"model.path={model_dir}", f"data.train={parquet}", "data.builtin_val_rows=0", "data.max_prompt_tokens=96",
        "trainer.max_steps=2", "trainer.val_every_n_steps=null", f"trainer.run_dir={tmp_path / 'run'}",
        "plan.prompts_per_step=2", "plan.num_generations=4", "plan.mini_batch_size=null",
        "rollout.max_new_tokens=8", "algorithm.lr=0.01", "reward.weights={answer: 1.0, digits: 1.0}",
        "callbacks.metrics=[jsonl]", "callbacks.progress=false",
    ]
    state, trainer = _load("grpo").main(overrides, callbacks=[record])

    module = trainer.module
    assert module.model.config.architecture == "Qwen2ForCausalLM" and module.model.config.attention_bias
    assert module.tokenizer.chat_template is not None  # prompts went through the model's own template
    first = module.encoder.text(rows[0])
    assert first.startswith("<s>") and "<|im_start|>user\n" in first and first.endswith("<|im_start|>assistant\n")
    assert state.step == 2 and len(record.metrics) == 2
    for metrics in record.metrics:
        assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "reward/mean", "kl"))
    changed = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, record.initial)
    assert max(jax.tree.leaves(changed)) > 0
