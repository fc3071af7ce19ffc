"""FLOP count of one GRPO step for a decoder config (the formula the benchmark reports).

Per token, a forward pass costs 2 x (matmul parameters) FLOPs: the q/k/v/o and MLP kernels of
every layer plus the lm_head (the embedding lookup is a gather, no FLOPs). Causal attention adds
2 x 2 x layers x heads x head_dim x (keys attended) per token (QK^T and the weighted sum of V).
The update is a forward plus a backward pass: 3x the forward (6 x params per token).

    rollout: forward over prompt + generated tokens (prefill + decode)
    ref:     one forward over prompt + completion (the reference logps)
    update:  3 x forward over prompt + completion (the policy logps and their gradient)

With the prompt shared (model.share_prompt) each group's prompt tokens count once.
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


def shared_forward_flops(cfg, sequences: int, prompt_len: int, new_tokens: int, group: int) -> float:
    """One forward over `sequences` sequences whose prompts run once per group of `group`.

    The prompts' tokens (S / G x P) and every completion's tokens (S x C) pass the dense layers;
    prompt tokens attend causally within their prompt, completion token j to P + j + 1 keys.
    group=1 equals `forward_flops(cfg, sequences, prompt_len + new_tokens)`.
    """
    p, c, units = prompt_len, new_tokens, sequences / group
    dense = 2 * matmul_params(cfg) * (units * p + sequences * c)
    keys = units * p * (p + 1) / 2 + sequences * (c * p + c * (c + 1) / 2)
    return dense + 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * keys


def step_flops(cfg, sequences: int, prompt_len: int, new_tokens: int, group: int = 1) -> dict[str, float]:
    """FLOPs of one step; `group` G > 1 counts each group's prompt once (model.share_prompt)."""
    forward = shared_forward_flops(cfg, sequences, prompt_len, new_tokens, group)
    rollout, ref, update = forward, forward, 3 * forward
    return {"rollout": rollout, "ref": ref, "update": update, "total": rollout + ref + update}


def duplicate_prompt_share(sequences: int, prompt_len: int, new_tokens: int, group: int) -> float:
    """The share of an unshared forward's tokens that are repeats of a prompt already run."""
    return (sequences - sequences / group) * prompt_len / (sequences * (prompt_len + new_tokens))


def decode_bytes(cfg, sequences: int, prompt_len: int, new_tokens: int) -> float:
    """Bytes the decode loop must read: the weights once per step, plus the filled KV cache."""
    itemsize = 2 if cfg.param_dtype == "bfloat16" else 4
    weights = matmul_params(cfg) * itemsize  # the output projection included; embedding lookups are tiny
    steps = new_tokens - 1
    # keys + values of every layer for the tokens written so far: prompt + step (average over steps)
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize
    mean_filled = prompt_len + steps / 2
    return steps * (weights + sequences * kv_per_token * mean_filled)
