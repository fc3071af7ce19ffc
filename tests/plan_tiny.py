"""The tiny run both planner test files plan, and its parameter count by hand."""

# tiny_config with vocab 256: H=64, 4 query heads / 2 KV heads of 16, MLP 128, 2 layers, untied head.
H, V, I, L, QKV = 64, 256, 128, 2, (4 + 2 * 2) * 16
PARAMS = V * H + L * (H * QKV + H * H + H * 2 * I + I * H + 2 * H) + H + H * V  # = 106,816
RUN = {"algorithm": {"name": "grpo", "beta": 0.04},
       "model": {"tiny": {"hidden_size": H, "num_layers": L, "vocab_size": V}, "param_dtype": "bfloat16"},
       "plan": {"prompts_per_step": 2, "num_generations": 4, "train_micro_batch_size": 8},
       "data": {"max_prompt_tokens": 32}, "rollout": {"max_new_tokens": 16}}
