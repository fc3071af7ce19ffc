"""rlbolt: a Lightning-style trainer for RL post-training of language models in JAX."""
