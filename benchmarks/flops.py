"""FLOP count of one GRPO step for a decoder config (the formula the benchmark reports).

Per token, a forward pass costs 2 x (matmul parameters) FLOPs: the q/k/v/o and MLP kernels of
every layer plus the lm_head (the embedding lookup is a gather, no FLOPs). Causal attention adds
2 x 2 x layers x heads x head_dim x (keys attended) per token (QK^T and the weighted sum of V).
The update is a forward plus a backward pass: 3x the forward (6 x params per token).

    rollout: forward over prompt + generated tokens (prefill + decode)
    ref:     one forward over prompt + completion (the reference logps)
    update:  3 x forward over prompt + completion (the policy logps and their gradient)
"""

from __future__ import annotations


def matmul_params(cfg) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * d + cfg.num_heads * d * h
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + h * cfg.vocab_size


def forward_flops(cfg, sequences: int, length: int) -> float:
    """One causal forward over `sequences` sequences of `length` tokens."""
    dense = 2 * matmul_params(cfg) * length
    # token t attends to t + 1 keys: sum_{t<length} (t + 1) = length (length + 1) / 2
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * (length + 1) / 2
    return sequences * (dense + attention)


def step_flops(cfg, sequences: int, prompt_len: int, new_tokens: int) -> dict[str, float]:
    total_len = prompt_len + new_tokens
    rollout = forward_flops(cfg, sequences, total_len)
    ref = forward_flops(cfg, sequences, total_len)
    update = 3 * forward_flops(cfg, sequences, total_len)
    return {"rollout": rollout, "ref": ref, "update": update, "total": rollout + ref + update}


def decode_bytes(cfg, sequences: int, prompt_len: int, new_tokens: int) -> float:
    """Bytes the decode loop must read: the weights once per step, plus the filled KV cache."""
    itemsize = 2 if cfg.param_dtype == "bfloat16" else 4
    weights = matmul_params(cfg) * itemsize  # the output projection included; embedding lookups are tiny
    steps = new_tokens - 1
    # keys + values of every layer for the tokens written so far: prompt + step (average over steps)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    mean_filled = prompt_len + steps / 2
    return steps * (weights + sequences * kv_per_token * mean_filled)
