"""A GRPO run per model family on CPU, from a tiny random Hugging Face folder the test writes
(transformers config -> save_pretrained, a real BPE tokenizer with a chat template): Llama, Qwen2,
Qwen3, Mistral, Gemma 2, Gemma 3 and Qwen3-MoE (the last with the load-balancing loss, recorded
routing and router replay on, through the producer's dock). Each run must train: finite losses,
parameters that moved, rewards for every sample, and sampled ids that decode to the text the
rewards scored."""

import json
import math

import jax
import numpy as np
import pytest
import torch
from data.test_tokenizers import CHATML, _build_backend
from models.test_hf_config import FAMILIES, MODEL_CLASSES

from rlbolt.callback import Callback
from rlbolt.data import gsm8k_style_rows
from rlbolt.modules import GRPO
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

# family -> the FAMILIES entry (test_hf_config.py) whose config it trains
RUNS = {"llama": "llama_gqa_untied", "qwen2": "qwen2_bias", "qwen3": "qwen3_qk_norm", "mistral": "mistral_window",
        "gemma2": "gemma2_softcap_tied", "gemma3": "gemma3_two_bases", "qwen3_moe": "qwen3_moe_top2"}
DEFAULT_TIER = ("qwen3_moe",)  # about a minute each on 2 CPU cores: the others run in the slow tier


def _hf_folder(path, name):
    """A transformers model of family `name` with the tokenizer's vocabulary, and the tokenizer."""
    backend = _build_backend()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "pad_token": "<pad>",
        "eos_token": "<|im_end|>", "chat_template": CHATML}))
    config_class, kwargs = FAMILIES[name]
    torch.manual_seed(0)
    config = config_class(**{**kwargs, "vocab_size": backend.get_vocab_size(), "max_position_embeddings": 256})
    MODEL_CLASSES[config_class](config).save_pretrained(str(path), safe_serialization=True)
    return path


class _Record(Callback):
    def __init__(self):
        self.metrics, self.batches, self.initial = [], [], None

    def on_fit_start(self, trainer, state):
        self.initial = jax.tree.map(np.asarray, state.params)

    def on_rollout_end(self, trainer, produced):
        self.batches.append(produced.batch)

    def on_step_end(self, trainer, info):
        self.metrics.append(dict(info.metrics))


@pytest.mark.parametrize("family", [f if f in DEFAULT_TIER else pytest.param(f, marks=pytest.mark.slow)
                                    for f in RUNS])
def test_grpo_trains_each_family_from_a_hugging_face_folder(tmp_path, family):
    folder = _hf_folder(tmp_path, RUNS[family])
    moe = family == "qwen3_moe"
    config = {"model": {"path": str(folder), "router_aux_loss_coef": 0.01 if moe else 0.0},
              "data": {"max_prompt_tokens": 96},
              "rollout": {"max_new_tokens": 8, "record_routing": moe},
              "algorithm": {"lr": 1e-2, "router_replay": moe},
              "reward": {"weights": {"answer": 1.0, "digits": 1.0}}}
    module = GRPO(config)
    record = _Record()
    trainer = Trainer(BatchPlan(prompts_per_step=2, num_generations=4), max_steps=2, callbacks=[record],
                      run_dir=str(tmp_path / "run"))
    state = trainer.fit(module, gsm8k_style_rows(8))

    arch = json.loads((folder / "config.json").read_text())["architectures"][0]
    assert module.model.config.architecture == arch
    assert state.step == 2 and len(record.metrics) == 2
    for metrics in record.metrics:
        assert all(math.isfinite(metrics[k]) for k in ("loss", "grad_norm", "reward/mean"))
    changed = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, record.initial)
    assert max(jax.tree.leaves(changed)) > 0
    for batch in record.batches:
        assert np.isfinite(np.asarray(batch["rewards"])).all() and len(batch["rewards"]) == 8
        ids, mask = np.asarray(batch["completion_ids"]), np.asarray(batch["completion_mask"], bool)
        assert mask.any(axis=1).all()
        for row, row_mask, text in zip(ids, mask, batch["completion_text"]):
            assert module.tokenizer.decode([int(t) for t in row[row_mask]]) == text
    if moe:  # the experts of the rollout reached training through the dock; the balance term was added
        assert all(metrics["moe/aux_loss"] > 0 for metrics in record.metrics)
        routing = np.asarray(record.batches[0]["completion_routing"])
        assert routing.shape == (8, 8, 2, 2) and routing.max() < 4
        layers = [layer.mlp for layer in module.model.layers]
        assert sum(hasattr(mlp, "router_kernel") for mlp in layers) == 2  # layer 1 is dense (mlp_only_layers)
