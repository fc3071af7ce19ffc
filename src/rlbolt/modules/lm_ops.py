"""The few calls the LM modules make into models, rollout and rewards, in one place."""

from __future__ import annotations


import jax
from flax import nnx

from rlbolt.config.sections import ModelSection
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.models import Decoder, tiny_config
from rlbolt.rewards import RewardRunner


def load_tokenizer(folder: str):
    """A Hugging Face tokenizer folder, or a `.gguf` file's own tokenizer -> `HFTokenizer`."""
    from rlbolt.data.tokenizers import HFTokenizer
    from rlbolt.models.gguf_io import is_gguf_path

    if is_gguf_path(folder):
        from rlbolt.data.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(folder)

    return HFTokenizer.from_folder(folder)


def build_model(model_cfg: ModelSection, vocab_size: int, seed: int, sharding: ShardingPlan | None = None) -> Decoder:
    """`model.path` -> `load_hf` (a `.gguf` file: `load_gguf_model`); None -> a tiny random Decoder
    whose vocabulary fits the tokenizer.

    Args:
      model_cfg: the config's ModelSection.
      vocab_size: the tokenizer's vocabulary size (the tiny model's default vocab_size).
      seed: initialisation seed of the tiny model.
      sharding: a `rlbolt.distributed.ShardingPlan`: the weights are created (or read) straight
        into their shardings, never whole on one device. None: the default device.
    """
    if model_cfg.path:
        from rlbolt.models.gguf_io import is_gguf_path, load_gguf_model
        from rlbolt.models.hf_io import load_hf

        if is_gguf_path(model_cfg.path):
            return load_gguf_model(model_cfg.path, param_dtype=model_cfg.param_dtype, sharding=sharding)[0]

        model, _ = load_hf(model_cfg.path, param_dtype=model_cfg.param_dtype, sharding=sharding)
        return model
    overrides = {"param_dtype": model_cfg.param_dtype, **model_cfg.tiny}
    overrides.setdefault("vocab_size", vocab_size)  # every sampled id must decode
    config = tiny_config(**overrides)
    create = lambda: Decoder(config, rngs=nnx.Rngs(seed))  # noqa: E731
    if sharding is None or sharding.mesh.size == 1 or _param_bytes(create) < SHARDED_INIT_BYTES:
        return create()  # small: built on the default device in no time (the Trainer then places it)
    return sharding.build_module(create)


def model_config_only(model_cfg, vocab_size: int):
    """The ModelConfig of `model.path` from its config.json (or a .gguf file's header) alone, no
    weight file opened; without a path, the tiny model's (`model.tiny`, vocabulary `vocab_size`).

    Raises:
      FileNotFoundError: the folder or its config.json is missing.
      ValueError: an unsupported architecture or a malformed config.json.
    """
    if not model_cfg.path:
        return tiny_config(**{"param_dtype": model_cfg.param_dtype, "vocab_size": vocab_size, **model_cfg.tiny})
    import json
    from pathlib import Path

    from rlbolt.models.gguf_io import is_gguf_path, read_gguf_config
    from rlbolt.models.hf_config import CONFIG_FILE, config_from_hf

    if is_gguf_path(model_cfg.path):
        return read_gguf_config(model_cfg.path, param_dtype=model_cfg.param_dtype)
    path = Path(model_cfg.path) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"model.path={model_cfg.path} has no {CONFIG_FILE}; give a Hugging Face model folder "
                                "(planning reads only its config.json)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    return config_from_hf(raw, path, param_dtype=model_cfg.param_dtype)


def abstract_model(config, seed: int = 0) -> Decoder:
    """A Decoder of `config` whose variables are ShapeDtypeStructs (`nnx.eval_shape`): its shapes,
    dtypes and logical axes, and no memory on any device (what `rlbolt plan` builds the run from)."""
    return nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(seed)))


SHARDED_INIT_BYTES = 1 << 30  # larger random models are initialised shard by shard (compiling that takes seconds)


def _param_bytes(create) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(nnx.eval_shape(create))))


def reward_runner(reward, reward_cfg) -> RewardRunner:
    """A failure-isolated RewardRunner configured from the Reward section."""
    return RewardRunner(reward, timeout_s=reward_cfg.timeout_s, penalty=reward_cfg.penalty,
                        max_workers=reward_cfg.max_workers, executor=reward_cfg.executor,
                        max_failed_batches=reward_cfg.max_failed_batches)
