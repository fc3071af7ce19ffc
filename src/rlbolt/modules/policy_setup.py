"""PolicySetup: what an `LMPolicyModule` is built from, and the views of its parameters.

`setup` builds the parts from the config: the tokenizer, the model placed on the training mesh,
LoRA's frozen base and adapters (model.lora), the prompt encoder, the reward runner, the frozen
reference (on the training devices or its own), and the jitted logps forwards. `memory_plan`
counts what those parts hold beyond the trainable state. The parameter hooks (`init_params`,
`frozen_params`, `with_frozen`, `full_params`, `hf_model`) are where LoRA's split into trainable
adapters and a frozen base shows; without LoRA they are the plain model's parameters.

`PolicySetup` is a mixin of `LMPolicyModule` (policy.py) and relies on what that class defines:
`config`, `algo`, `rollout_cfg` and the slots set in its `__init__`, and
`_group_size`, `_train_temperature` and `policy_params`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from rlbolt.config import ConfigError, RunConfig, load_config
from rlbolt.config.sections import ModelSection, default_reward_weights
from rlbolt.data.tokenizers import Tokenizer
from rlbolt.distributed.layout import check_placed_role
from rlbolt.distributed.mesh import MeshError
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.modules import lm_ops
from rlbolt.modules.lora_policy import LoraHooks
from rlbolt.modules.moe_routing import check_router_settings, logps_and_mismatch
from rlbolt.modules.prompts import PromptEncoder, builtin_tokenizer
from rlbolt.models.attention_kernels import resolve_attention
from rlbolt.models.decoder import Decoder
from rlbolt.modules.rewarding import build_reward
from rlbolt.packing import packing_spec
from rlbolt.packing.logps import PackedLogps
from rlbolt.rollout.logps import token_logps
from rlbolt.setup_context import SetupContext


class PolicySetup(LoraHooks):
    """The set-up and parameter hooks of `LMPolicyModule` (a mixin; see the module docstring)."""

    def setup(self, context: SetupContext) -> None:
        """Builds the tokenizer, the model placed on the training mesh, LoRA (model.lora), the prompt
        encoder, the reward runner, the frozen reference and the jitted logps forwards. Called once by
        `fit`; called directly (a test, `rlbolt export`), it records `context` as `self.context`."""
        self.context = context
        cfg = self.config
        if self.tokenizer is None:
            folder = cfg.model.tokenizer or cfg.model.path
            self.tokenizer = lm_ops.load_tokenizer(folder) if folder else builtin_tokenizer()
        self.sharding = context.sharding_for("train")
        if self.model is None:
            self.model = lm_ops.build_model(cfg.model, self.tokenizer.vocab_size, context.seed, self.sharding)
        self.model.remat = cfg.model.remat  # each layer of every training forward (rlbolt.models.remat; LoRA keeps it)
        self.model.scan_layers = cfg.model.scan_layers  # rlbolt.models.scan_layers
        # model.attention for the training devices' platform (a described TPU slice when planning on CPU)
        platform = jax.default_backend() if self.sharding is None else self.sharding.mesh.devices.flat[0].platform
        try:
            self.model.attention_kernel = resolve_attention(cfg.model.attention, platform)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if self.sharding is not None:  # the weights move onto the mesh once (no copy if built there)
            nnx.update(self.model, self.sharding.place(nnx.state(self.model)))
            self.sharding.shard_activations(self.model)
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.tokenizer.vocab_size} ids but the model's vocab_size is "
                f"{self.model.config.vocab_size}; use the tokenizer that belongs to model.path"
            )
        if cfg.model.lora is not None and self.lora is None:
            from rlbolt.models.lora import LoraConfig
            from rlbolt.modules.lora_policy import LoraPolicy

            self.lora = LoraPolicy(self.model, LoraConfig.from_mapping(cfg.model.lora), rngs=nnx.Rngs(context.seed),
                                   path=cfg.model.path)
            self.model = self.lora.policy_model  # the float base is no longer held here (QLoRA frees it)
        check_router_settings(self.model.config.num_experts, cfg.model.router_aux_loss_coef,
                              self.rollout_cfg.record_routing, self.algo.router_replay, self._own_forward())
        # The training forward returns its routing when a router term needs it (policy.py `forward`).
        self.routes_in_training = self.model.config.num_experts > 0 and (
            cfg.model.router_aux_loss_coef > 0 or self.algo.router_replay)
        self.graphdef, _ = nnx.split(self.model)
        self.encoder = PromptEncoder(
            self.tokenizer, prompt_field=cfg.data.prompt_field, max_prompt_tokens=cfg.data.max_prompt_tokens,
            system_prompt=cfg.data.system_prompt, use_chat_template=cfg.data.use_chat_template,
            template_kwargs=cfg.data.chat_template_kwargs)
        weights = cfg.reward.weights
        if weights is None:  # a config that was not resolved
            weights = default_reward_weights(self._env_choice is not None)
        if weights.get("env") and self._env_choice is None and self.reward is None:
            raise ConfigError("reward.weights has the term env, an episode's environment reward, but the run has no "
                              "environment; set rollout.env='package.module:Factory' (or env= from Python) or drop it")
        if self._env_choice is not None and self.reward is None and "env" not in weights:
            raise ConfigError(f"the run has an environment but reward.weights={dict(weights)} has no env term, so "
                              "the environment's rewards would not count; add reward.weights.env (e.g. env: 1.0), or "
                              "env: 0 to score the transcripts with the other terms alone")
        if self.reward is None:
            self.reward = build_reward(weights, answer_field=cfg.data.answer_field)
        self.reward_runner = lm_ops.reward_runner(self.reward, cfg.reward)
        if self._env_choice is not None:  # samples are multi-turn episodes (rlbolt.agents)
            from rlbolt.agents.environment import load_env_factory
            from rlbolt.agents.failures import EnvErrorMonitor

            self.env_factory = load_env_factory(self._env_choice)  # ConfigError naming rollout.env
            self.env_errors = EnvErrorMonitor(self.rollout_cfg.env_max_failed_batches)
        self._setup_teacher(cfg, context)
        ref_plan = context.sharding_for("reference")
        apart = ref_plan is not None and ref_plan is not self.sharding
        if apart and self.lora is not None and self.algo.beta > 0:
            raise MeshError("placement.reference has devices of its own, but with model.lora the reference is the "
                            "frozen base with the adapters off, which training holds on its devices; use "
                            "reference: train (or leave it out)")
        if self.algo.beta > 0 and self.lora is None and apart:  # the frozen copy lives only on its devices
            from rlbolt.modules.reference import PlacedReference

            self.reference = PlacedReference(self.model, self.sharding, ref_plan, **self._logps_options)
            self.ref_params = self.reference.params
        elif self.algo.beta > 0 and self.lora is None:
            # Parameters are immutable arrays and updates are functional, so holding the initial
            # pytree is a frozen copy without a copy.
            self.ref_params = nnx.state(self.model, nnx.Param)
        # Each group's prompt runs once where a stage's micro batches hold whole groups and the
        # mesh has one batch shard (prompt_sharing.py).
        self.train_group_size = self._group_size(context.plan.train_micro_batch_size, context.plan)
        rows = {} if self.sharding is None else {"out_shardings": self.sharding.batch_sharding()}
        # compute_logps -> this jitted forward -> rlbolt.rollout.logps
        self._logps = jax.jit(functools.partial(token_logps, self.graphdef, **self._logps_options),
                              static_argnames="group_size", **rows)
        if self.rollout_cfg.record_routing:  # the logps forward that also measures the routing mismatch
            self._logps_and_mismatch = jax.jit(functools.partial(
                logps_and_mismatch, self.graphdef, **self._logps_options), static_argnames="group_size",
                **({} if self.sharding is None else {"out_shardings": (self.sharding.batch_sharding(),
                                                                       self.sharding.replicated, self.sharding.replicated)}))
        if self.lora is not None:  # the reference is the base with the adapters off: no second copy
            self._ref_logps = jax.jit(functools.partial(token_logps, self.lora.base_graphdef, **self._logps_options),
                                      static_argnames="group_size", **rows)
        self._pack_logps_forwards(context.plan)

    def _pack_logps_forwards(self, plan) -> None:
        """plan.packing: the jitted logps forwards on the training devices run over packed rows
        (`rlbolt.packing.logps`; the policy's, LoRA's reference and the teacher's)."""
        spec = packing_spec(plan, self.sharding)
        if spec is None:
            return
        teacher = None if getattr(self, "_teacher_logps", None) is None else nnx.graphdef(self.teacher)
        for name, graphdef in (("_logps", self.graphdef), ("_ref_logps", getattr(self.lora, "base_graphdef", None)),
                               ("_teacher_logps", teacher)):
            padded = getattr(self, name, None)
            if padded is not None and graphdef is not None and not isinstance(padded, PackedLogps):
                setattr(self, name, PackedLogps(graphdef, padded, spec, self.sharding, **self._logps_options))

    def _own_forward(self) -> str | None:
        """The class's name when it replaces the shared policy forward (PPO's trunk), else None."""
        return None if type(self).forward.__qualname__ == "LMPolicyModule.forward" else type(self).__name__

    @property
    def _logps_options(self) -> dict[str, Any]:
        """What every logps forward is taken with: the sampler's temperature and the output
        projection's chunk (`model.logits_chunk_tokens`)."""
        return {"temperature": self._train_temperature, "chunk_size": self.config.model.logits_chunk_tokens}

    def _setup_teacher(self, cfg, context: SetupContext) -> None:
        """On-policy distillation: the teacher (`teacher=` or `algorithm.distill_teacher`) and its logps
        forward, on the training devices or on its own (`placement.teacher`: `self.teacher_forward`, a
        `PlacedReference`); a missing folder, another tokenizer or another vocabulary is refused."""
        if self.teacher is None and cfg.algorithm.distill_teacher is None:
            return
        field = "algorithm.distill_teacher"
        plan = context.sharding_for("teacher")
        apart = plan is not None and plan is not self.sharding
        if self.teacher is None:
            self.teacher = load_teacher(cfg.algorithm.distill_teacher, cfg.model, self.tokenizer, context.seed,
                                        plan if apart else self.sharding)
        if self.teacher.config.vocab_size != self.model.config.vocab_size:
            raise ConfigError(f"{field}: the teacher's vocab_size {self.teacher.config.vocab_size} is not the "
                              f"student's {self.model.config.vocab_size}; use a teacher with the student's tokenizer")
        if apart:  # the teacher's weights and forward only on its devices (placement.teacher)
            from rlbolt.modules.reference import PlacedReference

            check_placed_role(context.plan, plan, "teacher")
            self.teacher_forward = PlacedReference(self.teacher, None, plan, **self._logps_options)
            self.teacher_params = self.teacher_forward.params
            return
        teacher_graphdef, self.teacher_params = nnx.split(self.teacher)
        if self.sharding is not None:
            self.teacher_params = self.sharding.place(self.teacher_params)
        rows = {} if self.sharding is None else {"out_shardings": self.sharding.batch_sharding()}
        self._teacher_logps = jax.jit(functools.partial(token_logps, teacher_graphdef, **self._logps_options),
                                      static_argnames="group_size", **rows)

    def memory_plan(self, sharding) -> dict[str, int]:
        """The frozen reference model (when beta > 0) or LoRA's frozen base, and the sampler's KV
        cache for one rollout micro batch (longest prompt + max_new_tokens slots), per device."""
        from rlbolt.distributed import kv_cache_bytes, per_device_bytes

        # A reference on devices of its own is not on the training devices this plan describes.
        on_train = self.ref_params is not None and self.reference is None
        out = {"reference": per_device_bytes(self.ref_params)} if on_train else {}
        if self.lora is not None:
            out["frozen base"] = per_device_bytes(self.lora.base)
        if self.teacher_params is not None and self.teacher_forward is None:  # else on devices of its own
            out["teacher"] = per_device_bytes(self.teacher_params)
        rows = self.context.plan.rollout_micro_batch_size
        rows = 1 << max(0, (rows - 1).bit_length())  # the sampler pads a call to a power of two
        # An upper bound: with the prompt shared the prompt slots are held once per group.
        out["kv cache"] = kv_cache_bytes(self.model.config, rows, self.encoder.width + self.completion_width - 1,
                                         sharding)
        return out

    def init_params(self, rng: jax.Array) -> Any:
        """The trainable pytree: the model's parameters, or only the LoRA adapters (model.lora)."""
        return self.lora.adapters if self.lora is not None else super().init_params(rng)

    def full_params(self, params: Any) -> Any:
        """`params` as the producer-side hooks get them (the trainable pytree) joined with the
        frozen base: what the forward passes run on. Identity without LoRA."""
        return self.with_frozen(params, self.frozen_params())

    def hf_model(self, params: Any):
        """The policy as a plain Decoder holding `params` (LoRA adapters merged into the base),
        ready for `rlbolt.models.hf_io.save_hf`."""
        policy = self.policy_params(params)
        if self.lora is not None:
            return self.lora.merged_model(policy)
        graphdef, _, rest = nnx.split(self.model, nnx.Param, ...)
        return nnx.merge(graphdef, policy, rest)


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
