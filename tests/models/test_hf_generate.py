"""Greedy generation: rlbolt's NativeSampler on a loaded HF checkpoint equals transformers' generate."""

import jax
import numpy as np
import pytest
import torch
from models.test_hf_config import FAMILIES, build_hf_model

from rlbolt.models.hf_io import load_hf
from rlbolt.rollout import NativeSampler

NEW_TOKENS = 24
PROMPT_LENGTHS = (5, 9, 14)  # different lengths share one batch, so the sampler left-pads
# At HF's init scale (std 0.02) a tiny random model's greedy output collapses to one repeated token,
# which would make "token for token" a weak check; larger weights give varied sequences.
WEIGHT_SCALE = 12.0
SCALE_OVERRIDES = {"qwen3_moe_top1": 30.0}  # one expert per token, tied: 12 still repeats a few tokens


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0)
    return out[0, len(prompt):].tolist()


# Default tier: one model per family and feature; gemma2's untied twin and qwen3-MoE's top-1 twin share
# their siblings' paths (slow tier).
SLOW_GENERATE = {"gemma2_nocap_untied", "qwen3_moe_top1"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_GENERATE else n
                                  for n in sorted(FAMILIES)])
def test_greedy_tokens_match_transformers_generate(tmp_path, name):
    hf_model = build_hf_model(name)
    with torch.no_grad():
        for param_name, param in hf_model.named_parameters():
            if param.ndim >= 2 and "embed_tokens" not in param_name:  # experts are 3-D
                param.mul_(SCALE_OVERRIDES.get(name, WEIGHT_SCALE))
    # No stop token on either side: both must emit exactly NEW_TOKENS tokens.
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model, config = load_hf(tmp_path)

    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, config.vocab_size, size=n).tolist() for n in PROMPT_LENGTHS]
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), len(prompts)))
    sampler = NativeSampler(model, max_new_tokens=NEW_TOKENS, temperature=0.0)
    completions = np.asarray(sampler.generate(prompts, keys).completion_ids)

    assert completions.shape == (len(prompts), NEW_TOKENS)
    assert all(len(set(row.tolist())) >= 5 for row in completions)  # the comparison has teeth
    for prompt, ours in zip(prompts, completions):
        assert ours.tolist() == _hf_greedy(hf_model, prompt)
