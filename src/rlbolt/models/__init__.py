"""Flax NNX decoder models (Llama 3, Qwen2/2.5, Qwen3) and Hugging Face checkpoint I/O."""

from rlbolt.models.cache import KVCache, init_cache
from rlbolt.models.config import ModelConfig, tiny_config, workload_config
from rlbolt.models.decoder import Decoder
from rlbolt.models.hf_io import config_from_hf, config_to_hf, load_hf, read_hf_config, save_hf
