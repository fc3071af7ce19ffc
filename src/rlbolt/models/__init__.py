"""Flax NNX decoder models (Llama 3, Qwen2/2.5, Qwen3) and Hugging Face checkpoint I/O."""
