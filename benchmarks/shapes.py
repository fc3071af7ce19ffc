"""The real-shaped benchmark model and prompts: SmolLM2-135M's architecture, chat-shaped prompts.

Shared by `grpo_step.py --preset smollm2` and `rollout_engines.py`, so both time the same model.
Random weights (seed 0): the cost of a step does not depend on what the weights are.
"""

from __future__ import annotations

# SmolLM2's ChatML ids: <|im_start|> 1, <|im_end|> 2, "system" 9690, "user" 4093,
# "assistant" 520, "\n" 198. The benchmark's IntTokenizer keeps 0 (pad) and 1 (eos) for itself,
# so <|im_start|> is written as 3 here; which ids a prompt holds changes no cost.
_IM_START, _IM_END, _NEWLINE = 3, 2, 198
_SYSTEM, _USER, _ASSISTANT = 9690, 4093, 520
_SYSTEM_TEXT = 9  # "You are a helpful AI assistant named SmolLM, ..." is ~9-20 tokens; 9 keeps 48 in all


def smollm2_135m_config(**overrides):
    """The SmolLM2-135M shapes (its config.json) as an rlbolt ModelConfig (float32 unless overridden).

    30 layers, width 576, 9 query / 3 key-value heads of 64, SwiGLU 1536, vocabulary 49,152,
    tied embeddings, RoPE theta 1e5.
    """
    from rlbolt.models.config import ModelConfig

    fields = dict(vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                  intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                  max_position_embeddings=2048, param_dtype="float32", architecture="LlamaForCausalLM")
    fields.update(overrides)
    return ModelConfig(**fields).validate()


def chat_prompt_ids(rng, vocab_size: int, length: int) -> list[int]:
    """One prompt of exactly `length` ids laid out as a ChatML system + user turn and the assistant header.

    `<|im_start|>system\\n{9 ids}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n`,
    the content ids drawn from `rng` in [3, vocab_size) so that the frame takes the rest.

    Args:
      rng: a numpy Generator.
      vocab_size: V; the frame's ids must fit (V > 9690).
      length: prompt tokens in all; at least 23 (13 frame ids, 9 of system text, one of content).

    Returns:
      `length` ints.
    """
    frame = 13 + _SYSTEM_TEXT  # 13 frame ids around the system text and the content
    if length < frame + 1:
        raise ValueError(f"chat_prompt_ids length={length} must be at least {frame + 1} (the ChatML frame and one content id)")
    content = lambda n: [int(t) for t in rng.integers(3, vocab_size, n)]  # noqa: E731
    ids = ([_IM_START, _SYSTEM, _NEWLINE] + content(_SYSTEM_TEXT) + [_IM_END, _NEWLINE]
           + [_IM_START, _USER, _NEWLINE] + content(length - frame) + [_IM_END, _NEWLINE]
           + [_IM_START, _ASSISTANT, _NEWLINE])
    return ids
