"""What an `LMPolicyModule` is built from: the functions its `setup` calls, and the config helpers.

    build_tokenizer(cfg) / build_encoder(cfg, tokenizer)        -> the tokenizer, the prompt encoder
    build_env_factory(choice)                                   -> the environment factory of episodes, or None
    build_policy(cfg, model, tokenizer, context, temperature)   -> PolicyModel (model.lora: adapters over the base)
    build_reward_runner(cfg, reward, has_env)                   -> the reward and its failure-isolated runner
    build_scorers(cfg, policy, teacher, context)                -> {"ref": ..., "teacher": ...} log-prob scorers
    load_teacher(path, ...)                                     -> the distillation teacher, checked
    build_optimizer(algo) / learning_rate(algo, count)          -> AdamW (warm-up, clipping), its schedule

Each takes what it needs as arguments and refuses bad input in one line naming the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import optax
from flax import nnx

from rlbolt.config import ConfigError, RunConfig, load_config
from rlbolt.config.sections import AlgorithmSection, ModelSection, default_reward_weights
from rlbolt.data.tokenizers import Tokenizer
from rlbolt.distributed.layout import check_placed_role
from rlbolt.distributed.mesh import MeshError
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.models.scan_layers import stack_reason
from rlbolt.models.stacked_layers import stack_layers
from rlbolt.modules import lm_ops
from rlbolt.modules.lora_policy import LoraPolicy
from rlbolt.modules.moe_routing import routing_fields
from rlbolt.modules.policy_model import PolicyModel, jitted_logps
from rlbolt.modules.prompts import PromptEncoder, builtin_tokenizer
from rlbolt.modules.rewarding import build_reward as reward_from_weights
from rlbolt.modules.scorers import ColocatedScorer, LogpsScorer
from rlbolt.models.attention_kernels import resolve_attention
from rlbolt.models.moe import moe_layers
from rlbolt.models.moe_matmul import resolve_moe_matmul
from rlbolt.models.decoder import Decoder
from rlbolt.rewards import RewardFn, RewardRunner, WeightedReward
from rlbolt.packing import packing_spec
from rlbolt.packing.logps import PackedLogps
from rlbolt.setup_context import SetupContext


def build_tokenizer(cfg: RunConfig) -> Tokenizer:
    """The tokenizer `model.tokenizer` (else `model.path`) names, or the built-in one without either.

    Args:
      cfg: the run's config.
    """
    folder = cfg.model.tokenizer or cfg.model.path
    return lm_ops.load_tokenizer(folder) if folder else builtin_tokenizer()


def build_encoder(cfg: RunConfig, tokenizer: Tokenizer) -> PromptEncoder:
    """The prompt encoder (rows -> token ids) of the `data` section.

    Args:
      cfg: the run's config.
      tokenizer: the policy's tokenizer.
    """
    d = cfg.data
    return PromptEncoder(tokenizer, prompt_field=d.prompt_field, max_prompt_tokens=d.max_prompt_tokens,
                         system_prompt=d.system_prompt, use_chat_template=d.use_chat_template,
                         template_kwargs=d.chat_template_kwargs)


def build_env_factory(choice: Any) -> Any:
    """The environment factory `env=` or `rollout.env` names (samples become multi-turn episodes,
    rlbolt.agents), or None without one; a name that does not load is a ConfigError naming rollout.env.

    Args:
      choice: a factory, its 'package.module:Factory' name, or None.
    """
    if choice is None:
        return None
    from rlbolt.agents.environment import load_env_factory

    return load_env_factory(choice)


def learning_rate(algo: AlgorithmSection, count: int) -> float:
    """The learning rate of optimizer update `count` (0-based): linear warm-up, then constant.

    Args:
      algo: the algorithm section (`lr`, `warmup_steps`).
      count: the optimizer update's index.
    """
    return float(optax.linear_schedule(0.0, algo.lr, algo.warmup_steps)(count)) if algo.warmup_steps else algo.lr


def build_optimizer(algo: AlgorithmSection) -> optax.GradientTransformation:
    """AdamW with optional linear warm-up and global-norm clipping.

    Args:
      algo: the algorithm section (`lr`, `warmup_steps`, `weight_decay`, `max_grad_norm`).
    """
    lr = optax.linear_schedule(0.0, algo.lr, algo.warmup_steps) if algo.warmup_steps else algo.lr
    adamw = optax.adamw(lr, weight_decay=algo.weight_decay)
    return optax.chain(optax.clip_by_global_norm(algo.max_grad_norm), adamw) if algo.max_grad_norm > 0 else adamw


def build_policy(cfg: RunConfig, model: Decoder | None, tokenizer: Tokenizer, context: SetupContext,
                 temperature: float, lora: LoraPolicy | None = None) -> PolicyModel:
    """The policy: `model` (or the one `model.path` names) placed on the training mesh, with LoRA's
    adapters over it when `model.lora` is set, and its jitted logps forwards.

    Args:
      cfg: the run's config.
      model: a Decoder given to the module, or None to build `cfg.model`.
      tokenizer: the policy's tokenizer (its vocabulary must fit the model's).
      context: the run's SetupContext (the training role's sharding, the seed).
      temperature: the temperature the logps are taken at (the sampler's).
      lora: the LoraPolicy of an earlier `setup` of the same module (`model` is then its adapted
        model), kept as it is; None: made here when `model.lora` is set.
    """
    sharding = context.sharding_for("train")
    if model is None:
        model = lm_ops.build_model(cfg.model, tokenizer.vocab_size, context.seed, sharding)
    model.remat = cfg.model.remat  # each layer of every training forward (rlbolt.models.remat; LoRA keeps it)
    model.scan_layers = cfg.model.scan_layers  # rlbolt.models.scan_layers
    model.mlp_chunk_positions = cfg.model.mlp_chunk_positions  # rlbolt.models.decoder_layer.over_position_chunks
    model.mlp_block_size = cfg.model.mlp_block_size  # rlbolt.models.mlp_blocks
    # MoE layers stack only when nothing records or replays their routing (per layer: scan_layers.stack_reason).
    routing = routing_fields(cfg.model.router_aux_loss_coef, cfg.rollout.record_routing, cfg.algorithm.router_replay)
    if cfg.model.scan_layers and cfg.model.lora is None and stack_reason(model, routing=routing) is None:
        stack_layers(model)  # stored stacked, before placement: the scan reads them as they lie (stacked_layers)
    # model.attention for the training devices' platform (a described TPU slice when planning on CPU)
    platform = jax.default_backend() if sharding is None else sharding.mesh.devices.flat[0].platform
    try:
        model.attention_kernel = resolve_attention(cfg.model.attention, platform)
        moe_kernel = resolve_moe_matmul(cfg.model.moe_matmul, platform)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for block in moe_layers(model):  # model.moe_matmul (rlbolt.models.moe_matmul), model.expert_block_size (stacked: one block)
        block.matmul = moe_kernel
        block.block_size = cfg.model.expert_block_size  # rlbolt.models.expert_blocks
    if sharding is not None:  # the weights move onto the mesh once (no copy if built there)
        nnx.update(model, sharding.place(nnx.state(model)))
        sharding.shard_activations(model)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's vocab_size is "
            f"{model.config.vocab_size}; use the tokenizer that belongs to model.path"
        )
    if cfg.model.lora is not None and lora is None:
        from rlbolt.models.lora import LoraConfig

        lora = LoraPolicy(model, LoraConfig.from_mapping(cfg.model.lora), rngs=nnx.Rngs(context.seed),
                          path=cfg.model.path)
    policy = PolicyModel(model, lora=lora, sharding=sharding, temperature=temperature,
                         chunk_size=cfg.model.logits_chunk_tokens, record_routing=cfg.rollout.record_routing)
    policy.logps = packed_forward(policy.graphdef, policy.logps, context.plan, sharding, policy.options)
    return policy


def packed_forward(graphdef: nnx.GraphDef, padded: Any, plan: Any, sharding: ShardingPlan | None,
                   options: dict[str, Any]) -> Any:
    """With `plan.packing: on`, the jitted logps forward `padded` over packed rows
    (`rlbolt.packing.logps.PackedLogps`, same call signature); else `padded` itself.

    Args:
      graphdef: the graph the forward runs (the policy's, LoRA's base, the teacher's).
      padded: its padded jitted forward.
      plan: the BatchPlan (`plan.packing`, `plan.packed_row_tokens`, `plan.packed_rows`).
      sharding: the training role's ShardingPlan (one packing block per batch shard), or None.
      options: the forward's temperature and chunk size.
    """
    spec = packing_spec(plan, sharding)
    return padded if spec is None else PackedLogps(graphdef, padded, spec, sharding, **options)


def build_reward_runner(cfg: RunConfig, reward: RewardFn | WeightedReward | None,
                 has_env: bool) -> tuple[RewardFn | WeightedReward, RewardRunner]:
    """The reward (`reward=`, else `reward.weights`' terms) and its failure-isolated runner; an
    `env` term without an environment, or an environment without one, is refused.

    Args:
      cfg: the run's config.
      reward: the reward given to the module, or None.
      has_env: whether samples are episodes (`rollout.env` / `env=`).
    """
    weights = cfg.reward.weights
    if weights is None:  # a config that was not resolved
        weights = default_reward_weights(has_env)
    if weights.get("env") and not has_env and reward is None:
        raise ConfigError("reward.weights has the term env, an episode's environment reward, but the run has no "
                          "environment; set rollout.env='package.module:Factory' (or env= from Python) or drop it")
    if has_env and reward is None and "env" not in weights:
        raise ConfigError(f"the run has an environment but reward.weights={dict(weights)} has no env term, so "
                          "the environment's rewards would not count; add reward.weights.env (e.g. env: 1.0), or "
                          "env: 0 to score the transcripts with the other terms alone")
    if reward is None:
        reward = reward_from_weights(weights, answer_field=cfg.data.answer_field)
    return reward, lm_ops.reward_runner(reward, cfg.reward)


def build_scorers(cfg: RunConfig, policy: PolicyModel, teacher: Decoder | None, tokenizer: Tokenizer,
                  context: SetupContext) -> tuple[dict[str, LogpsScorer], Decoder | None]:
    """The frozen models that score the sampled tokens (modules/scorers.py), and the teacher.

    `"ref"` when `algorithm.beta > 0`: the initial policy, on the training devices (parameters are
    immutable arrays and updates functional, so holding the initial pytree is a frozen copy without
    a copy), on its own (`placement.reference`), or with LoRA the base with the adapters off.
    `"teacher"` with on-policy distillation (`teacher=` or `algorithm.distill_teacher`), on the
    training devices or its own (`placement.teacher`).

    Args:
      cfg: the run's config.
      policy: the PolicyModel (its initial parameters are the reference).
      teacher: a Decoder given to the module, or None to load `algorithm.distill_teacher`.
      tokenizer: the student's tokenizer (a loaded teacher must share it).
      context: the run's SetupContext (the roles' shardings, the plan, the seed).

    Returns:
      (the scorers by column stem, the teacher Decoder or None).
    """
    from rlbolt.modules.reference import PlacedReference

    scorers: dict[str, LogpsScorer] = {}
    options, train = policy.options, policy.sharding
    if teacher is not None or cfg.algorithm.distill_teacher is not None:
        plan = context.sharding_for("teacher")
        apart = plan is not None and plan is not train
        if teacher is None:
            teacher = load_teacher(cfg.algorithm.distill_teacher, cfg.model, tokenizer, context.seed,
                                   plan if apart else train)
        if teacher.config.vocab_size != policy.model.config.vocab_size:
            raise ConfigError(f"algorithm.distill_teacher: the teacher's vocab_size {teacher.config.vocab_size} is "
                              f"not the student's {policy.model.config.vocab_size}; use a teacher with the student's "
                              "tokenizer")
        if apart:  # the teacher's weights and forward only on its devices (placement.teacher)
            check_placed_role(context.plan, plan, "teacher")
            scorers["teacher"] = PlacedReference(teacher, None, plan, **options)
        else:
            graphdef, params = nnx.split(teacher)
            scorers["teacher"] = ColocatedScorer(packed_forward(graphdef, jitted_logps(graphdef, train, **options),
                                                                context.plan, train, options),
                                                 params if train is None else train.place(params), train)
    ref_plan = context.sharding_for("reference")
    apart = ref_plan is not None and ref_plan is not train
    if cfg.algorithm.beta <= 0:
        return scorers, teacher
    if policy.lora is not None:
        if apart:
            raise MeshError("placement.reference has devices of its own, but with model.lora the reference is the "
                            "frozen base with the adapters off, which training holds on its devices; use "
                            "reference: train (or leave it out)")
        lora = policy.lora  # the base with the adapters off: no second copy
        ref = ColocatedScorer(packed_forward(lora.base_graphdef, jitted_logps(lora.base_graphdef, train, **options),
                                             context.plan, train, options), None, train,
                              read_params=lambda: lora.base)
    elif apart:  # the frozen copy lives only on its devices
        ref = PlacedReference(policy.model, train, ref_plan, **options)
    else:
        ref = ColocatedScorer(policy.logps, nnx.state(policy.model, nnx.Param), train)
    return {"ref": ref, **scorers}, teacher


def load_teacher(path: str, model_cfg: ModelSection, tokenizer: Tokenizer, seed: int,
                 sharding: ShardingPlan | None = None) -> Decoder:
    """The Decoder `algorithm.distill_teacher` names (a Hugging Face folder or a .gguf file), read
    straight onto `sharding`'s devices; refused in one line when it is missing or its tokenizer
    gives other ids than the student's `tokenizer`.

    Args:
      path: the teacher's folder or .gguf file.
      model_cfg: the student's ModelSection (param_dtype applies to the teacher too).
      tokenizer: the student's tokenizer.
      seed: unused by a folder's weights; passed to the model builder.
      sharding: the ShardingPlan the weights are read into (None: the default device).
    """
    field = f"algorithm.distill_teacher={path}"
    if not Path(path).exists():
        raise ConfigError(f"{field} does not exist; give a local Hugging Face model folder (config.json, *.safetensors "
                          "and the student's tokenizer files) or a .gguf file")
    try:
        theirs = lm_ops.load_tokenizer(path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{field}: its tokenizer cannot be read ({str(error).splitlines()[0]}); the teacher's "
                          "folder must hold the student's tokenizer files") from None
    probe = "Distil: 12 + 7 = 19? <answer> yes </answer>"
    probe = "".join(ch for ch in probe if _encodes(tokenizer, ch)) or "0"
    if (theirs.vocab_size != tokenizer.vocab_size or theirs.eos_id != tokenizer.eos_id
            or list(theirs.encode(probe)) != list(tokenizer.encode(probe))):
        raise ConfigError(f"{field}: its tokenizer is not the student's ({theirs.vocab_size} vs {tokenizer.vocab_size} "
                          "ids, or other ids for the same text); distillation compares log-probs of the same token "
                          "ids: use a teacher of the student's family")
    return lm_ops.build_model(dataclasses.replace(model_cfg, path=path, lora=None), tokenizer.vocab_size, seed,
                              sharding)


def _encodes(tokenizer, text: str) -> bool:
    try:
        return bool(tokenizer.encode(text))
    except ValueError:  # a character tokenizer without this character
        return False


def _config_for(cls: type, config: RunConfig | Mapping | None, has_env: bool = False) -> RunConfig:
    name = cls.algorithm_name
    if name is None:
        raise TypeError(f"{cls.__name__} is a base class; build one of its algorithms (GRPO, DAPO, ...) or subclass it "
                        "with its own algorithm_name")
    if isinstance(config, RunConfig):
        if config.algorithm.name != name:
            raise ConfigError(
                f"{cls.__name__} got a config with algorithm.name={config.algorithm.name!r}; set "
                f"algorithm.name={name} (or build the module for {config.algorithm.name!r} with rlbolt.app.build)"
            )
        return config
    raw = {k: dict(v) for k, v in (config or {}).items()}
    raw.setdefault("algorithm", {}).setdefault("name", name)
    if has_env and raw.setdefault("reward", {}).get("weights") is None:  # env= from Python: its reward counts
        raw["reward"]["weights"] = default_reward_weights(True)
    return _config_for(cls, load_config(raw))


def replace_section(config: RunConfig, section: str, **values: Any) -> RunConfig:
    """A copy of `config` with some fields of one section changed (no re-resolution)."""
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)})
