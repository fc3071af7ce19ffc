"""LMPolicyModule: the shared base of the ready LM algorithms (GRPO and friends).

It is built from three objects, which `setup` makes (policy_setup.py) and the hooks call:

    self.policy    PolicyModel (policy_model.py): the graph and the views of its parameters, plain or
                   LoRA: init/frozen/join, the logps and training forwards, rollout params, HF export
    self.scorers   {"ref": ..., "teacher": ...}: frozen models behind one `.logps(batch)`, on the
                   training devices or their own (scorers.py, reference.py); each fills `<name>_logps`
    self.rollout   PolicyRollout (policy_rollout.py): prompts -> completions or episodes over one
                   engine handle

and owns what is the same across algorithms: old logps (a forward when needed) and the scorers'
columns in `compute_logps`; rewards in `on_advantage`; the loss skeleton in `training_step`
(policy loss + KL + entropy, aggregated with mini-batch totals); and greedy accuracy / pass@k in
`validation_step`. An algorithm subclass overrides the small pieces that differ, each one method:

    compute_rewards(batch) -> [N]          rewards (+ shaping)          host, on_advantage
    filter_groups(batch) -> Batch          drop samples (DAPO)          host, on_advantage
    compute_advantages(batch) -> [N]|[N,C] advantages                   host, on_advantage
    policy_loss(logps, batch) -> ([N,C], info)   per-token loss         jitted, training_step
    forward(params, batch) -> (logps, entropy, aux)   the policy forward jitted, training_step
    extra_loss(aux, batch) -> (loss, metrics)  more terms (PPO value)   jitted, training_step

Metrics from `training_step` are normalised by the mini-batch totals (`mini_batch_num_tokens`,
`mini_batch_num_samples`), because the Trainer sums them over a mini batch's micro batches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlbolt.algorithms import LossAggregation, aggregate_loss, grpo_advantages, kl_penalty
from rlbolt.algorithms.objectives import OBJECTIVES, objective_selections
from rlbolt.agents.environment import EnvFactory
from rlbolt.batch import Batch
from rlbolt.config import RunConfig, config_to_dict
from rlbolt.data.tokenizers import Tokenizer
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.models.decoder import Decoder
from rlbolt.module import ModuleCard, RLModule
from rlbolt.modules.moe_routing import ROUTING_COLUMNS, check_router_settings, micro_batch_load_balancing
from rlbolt.modules.old_logps import correction_columns, needs_old_forward, policy_old_logps
from rlbolt.modules.policy_model import PolicyModel, token_inputs
from rlbolt.modules.policy_plan import held_memory, refuse_ungrouped
from rlbolt.modules.policy_rewards import batch_rewards, distill_advantages
from rlbolt.modules.policy_rollout import PolicyRollout
from rlbolt.modules.policy_setup import _config_for, build_encoder, build_env_factory, build_optimizer, build_policy
from rlbolt.modules.policy_setup import build_reward_runner, build_scorers, build_tokenizer, learning_rate
from rlbolt.modules.policy_setup import replace_section  # noqa: F401 (re-export)
from rlbolt.modules.policy_validation import validation_metrics
from rlbolt.modules.prompt_sharing import require_shared_layout, stage_group_size
from rlbolt.modules.scorers import LogpsScorer, idle_copies
from rlbolt.rewards import RewardFn, WeightedReward
from rlbolt.rollout.engine import RolloutEngine
from rlbolt.setup_context import SetupContext


class LMPolicyModule(RLModule):
    """A language-model policy trained with a group-based policy-gradient algorithm.

    Args:
      config: a resolved `RunConfig`, a `{section: {key: value}}` dict, or None for defaults.
        Its `algorithm.name` must match the class (a dict without one gets the class's name).
      model: an `rlbolt.models.Decoder` to train instead of building one from `config.model`.
      tokenizer: a tokenizer instead of the one `config.model` names.
      reward: a `RewardFn` or `WeightedReward` instead of `config.reward.weights`.
      engine: the rollout engine instead of `config.rollout.engine`: a name ("native", "vllm"), a
        factory `(model, EngineSpec) -> RolloutEngine`, or a RolloutEngine instance. The module
        calls it only through the protocol (`rlbolt.rollout.engines`).
      teacher: a Decoder to distil from instead of `algorithm.distill_teacher` (on-policy
        distillation: it scores the student's sampled tokens; same tokenizer as the student).
      env: an environment factory `Factory(row) -> Environment` (or its 'package.module:Factory'
        name) instead of `config.rollout.env`: each sample becomes a multi-turn episode
        (`rlbolt.agents.run_episodes`), trained token-in/token-out with environment ids masked out.
        A dict config that leaves `reward.weights` unset then scores with `{env: 1.0}`.
    """

    kl_in_loss = True  # False: the KL is folded into the reward instead (REINFORCE++, RLOO, PPO)

    def __init__(self, config: RunConfig | Mapping | None = None, *, model: Decoder | None = None,
                 tokenizer: Tokenizer | None = None, reward: RewardFn | WeightedReward | None = None,
                 engine: str | Callable[..., RolloutEngine] | RolloutEngine | None = None,
                 env: EnvFactory | str | None = None, teacher: Decoder | None = None):
        self.config = _config_for(type(self), config, has_env=env is not None)
        self.algo, self.rollout_cfg = self.config.algorithm, self.config.rollout
        self.hparams = {k: v for k, v in config_to_dict(self.config).items() if k in ("algorithm", "rollout", "reward")}
        self.tokenizer, self.reward = tokenizer, reward
        self._given = {"model": model, "teacher": teacher}  # what setup builds from, beside the config
        self._engine_choice = engine if engine is not None else self.config.rollout.engine
        self._env_choice = env if env is not None else self.rollout_cfg.env
        self.policy: PolicyModel | None = None  # the three parts (setup)
        self.scorers: dict[str, LogpsScorer] = {}
        self.rollout: PolicyRollout | None = None
        self.train_group_size = 1  # G when the training forward runs each group's prompt once (setup)
        self.routes_in_training = False  # the training forward returns its MoE routing (setup)

    # -- set-up ---------------------------------------------------------------------------------------
    def setup(self, context: SetupContext) -> None:
        """Builds the tokenizer, the policy (placed on the training mesh; LoRA with model.lora), the
        prompt encoder, the reward runner, the scorers (reference, teacher) and the rollout. Called
        once by `fit`; called directly (a test, `rlbolt export`), it records `context` as `self.context`."""
        self.context = context
        cfg = self.config
        self.tokenizer = self.tokenizer if self.tokenizer is not None else build_tokenizer(cfg)
        model = self.policy.model if self.policy is not None else self._given["model"]  # a second setup keeps it
        self.policy = build_policy(cfg, model, self.tokenizer, context, self._train_temperature, lora=self.lora)
        check_router_settings(self.model.config.num_experts, cfg.model.router_aux_loss_coef,
                              self.rollout_cfg.record_routing, self.algo.router_replay, self._own_forward())
        # The training forward returns its routing when a router term needs it (`forward`).
        self.routes_in_training = self.model.config.num_experts > 0 and (
            cfg.model.router_aux_loss_coef > 0 or self.algo.router_replay)
        self.encoder = build_encoder(cfg, self.tokenizer)
        self.reward, self.reward_runner = build_reward_runner(cfg, self.reward, self._env_choice is not None)
        env_factory = build_env_factory(self._env_choice)  # samples are multi-turn episodes (rlbolt.agents)
        self.scorers, self._given["teacher"] = build_scorers(cfg, self.policy, self._given["teacher"], self.tokenizer,
                                                             context)
        # Each group's prompt runs once where a stage's micro batches hold whole groups and the
        # mesh has one batch shard (prompt_sharing.py).
        self.train_group_size = self.group_size_for(context.plan.train_micro_batch_size, context.plan)
        self.rollout = PolicyRollout(
            cfg, self.tokenizer, self.encoder, self.policy, prepare=lambda p: self.policy_params(self.full_params(p)),
            engine=self._engine_choice, rollout_sharding=context.sharding_for("rollout"),
            completion_width=self.completion_width, env_factory=env_factory, log=self.log)

    def _own_forward(self) -> str | None:
        """The class's name when it replaces the shared policy forward (PPO's trunk), else None."""
        return None if type(self).forward.__qualname__ == "LMPolicyModule.forward" else type(self).__name__

    # -- what users and callbacks read (delegating to the parts) ------------------------------------
    @property
    def model(self) -> Decoder | None:
        """The policy Decoder (LoRA: the adapted one over the frozen base); before `setup`, the one given."""
        return self.policy.model if self.policy is not None else self._given["model"]

    @property
    def lora(self):
        """The LoraPolicy of a `model.lora` run, else None."""
        return self.policy.lora if self.policy is not None else None

    @property
    def graphdef(self):
        """The policy model's GraphDef."""
        return self.policy.graphdef

    @property
    def sharding(self) -> ShardingPlan | None:
        """The training role's ShardingPlan (None: one device, or before `setup`)."""
        return self.policy.sharding if self.policy is not None else None

    @property
    def teacher(self) -> Decoder | None:
        """The distillation teacher (`teacher=`, or after `setup` the one `algorithm.distill_teacher` names)."""
        return self._given["teacher"]

    @property
    def ref_params(self) -> Any:
        """The frozen reference copy (None without one: beta = 0, or LoRA's base with the adapters off).
        Settable: `CPUOffload` keeps it in host memory between logps stages."""
        ref = self.scorers.get("ref")
        return None if ref is None else ref.params

    @ref_params.setter
    def ref_params(self, value: Any) -> None:
        if self.ref_params is None:
            raise AttributeError(f"{type(self).__name__}.ref_params: this module holds no reference copy to "
                                 "replace (algorithm.beta = 0, before setup, or model.lora, whose reference is the "
                                 "frozen base)")
        self.scorers["ref"].params = value

    @property
    def completion_width(self) -> int:
        """C of the completion columns: `rollout.max_new_tokens`, or with episodes the ids after the
        prompt of a whole episode (`rollout.max_total_tokens`, default max_turns * max_new_tokens)."""
        r = self.rollout_cfg
        if self._env_choice is None:
            return r.max_new_tokens
        return r.max_total_tokens or r.max_turns * r.max_new_tokens

    # -- plan and optimizer -----------------------------------------------------------------------
    def check_plan(self, plan) -> None:
        """Refuses `num_generations=1` when this algorithm's advantages are group-relative (probed
        through `compute_advantages`: policy_plan.refuse_ungrouped)."""
        refuse_ungrouped(self.compute_advantages, type(self).__name__, plan.num_generations)

    def lr_schedule(self, count: int) -> float:
        """The learning rate of optimizer update `count` (0-based): linear warm-up, then constant.
        LearningRateMonitor reads it; configure_optimizers uses the same function."""
        return learning_rate(self.algo, count)

    def configure_optimizers(self) -> optax.GradientTransformation:
        """AdamW with optional linear warm-up and global-norm clipping (config.algorithm)."""
        return build_optimizer(self.algo)

    def policy_params(self, params: Any) -> Any:
        """The language model's parameters inside the trainable pytree (PPO nests them)."""
        return params

    # -- the parameter hooks: where LoRA's split shows (the PolicyModel answers) ----------------------
    def init_params(self, rng: jax.Array) -> Any:
        """The trainable pytree: the model's parameters, or only the LoRA adapters (model.lora)."""
        return self.policy.init_params()

    def frozen_params(self) -> Any:
        """With LoRA, the base (trained never, differentiated never); else None."""
        return self.policy.frozen()

    def with_frozen(self, params: Any, frozen: Any) -> Any:
        """With LoRA, the adapters joined with the base into the adapted model's State."""
        return self.policy.join(params, frozen)

    def frozen_identity(self) -> dict | None:
        """With LoRA: the base's folder, a fingerprint of its weights and its quantisation."""
        return self.policy.identity()

    def full_params(self, params: Any) -> Any:
        """`params` as the producer-side hooks get them (the trainable pytree) joined with the
        frozen base: what the forward passes run on. Identity without LoRA."""
        return self.with_frozen(params, self.frozen_params())

    def hf_model(self, params: Any) -> Decoder:
        """The policy as a plain Decoder holding `params` (LoRA adapters merged into the base),
        ready for `rlbolt.models.hf_io.save_hf`."""
        return self.policy.hf_model(self.policy_params(params))

    def memory_plan(self, sharding: ShardingPlan) -> dict[str, int]:
        """The frozen reference model (when beta > 0) or LoRA's frozen base, the teacher, and the
        sampler's KV cache for one rollout micro batch (longest prompt + max_new_tokens slots), per
        device; a scorer on devices of its own is not on the training devices this plan describes."""
        return held_memory(self.scorers, self.lora, self.model.config, self.context.plan.rollout_micro_batch_size,
                           self.encoder.width + self.completion_width - 1, sharding)

    # -- rollout ----------------------------------------------------------------------------------------
    def on_rollout(self, params: Any, batch: Batch) -> Batch:
        """Tokenises the prompt rows, samples one completion per sample with its `sample_keys`
        (or runs one episode per sample with an environment), and adds prompt/completion ids and
        masks ([N, P], [N, C]), `sampler_logps` [N, C] and `completion_text` (object [N])."""
        return batch.with_columns(self.rollout.sample(params, batch))

    def card(self) -> ModuleCard:
        """The policy's description (`rlbolt.module.ModuleCard`), read from the module's public attributes."""
        from rlbolt.models.hf_io import tokenizer_source

        return ModuleCard(model=self.model, model_config=self.model.config, policy_params=self.policy_params,
                          hf_model=self.hf_model, tokenizer=self.tokenizer, lr_schedule=self.lr_schedule,
                          tokenizer_folder=tokenizer_source(self.config.model.tokenizer, self.config.model.path),
                          hparams=self.hparams, idle_copies=idle_copies(self.scorers))

    # -- logps --------------------------------------------------------------------------------------
    def logps_group_size(self, batch: Batch) -> int:
        """The group size a logps forward over `batch` shares prompts over (1: unshared); the
        batch's layout is checked first (prompt_sharing.py)."""
        size = self.group_size_for(batch.num_samples, self.context.plan)
        require_shared_layout(batch["prompt_ids"], batch["prompt_mask"], size, "on_rollout")
        return size

    def group_size_for(self, micro_batch_size: int, plan: Any) -> int:
        """The group size a forward over `micro_batch_size` rows of `plan` shares prompts over (1:
        unshared): the rollout's, logps' and update's stages (and `rlbolt plan`'s executables) agree."""
        # mesh.context > 1 counts as more shards: the ring splits the unshared forward's rows (context_parallel.py)
        shards = 1 if self.sharding is None else self.sharding.batch_shards * self.sharding.mesh.shape.get("context", 1)
        return stage_group_size(self.config.model.share_prompt, micro_batch_size, plan.num_generations, shards)

    @property
    def _train_temperature(self) -> float:
        # The ratio must compare like with like: logps under the distribution the sampler drew from.
        t = self.rollout_cfg.temperature
        return t if t > 0 else 1.0

    def compute_logps(self, params: Any, batch: Batch) -> Batch:
        """Adds `old_logps` (a forward pass when `needs_old_forward` says so; else the sampler's), each
        scorer's `<name>_logps` (`ref_logps` when beta > 0, `teacher_logps` when distilling), and
        `importance_weights` [N, C] float32 and `keep_mask` [N, C] bool when `algorithm.rollout_correction`
        corrects the engine's logps toward the trainer's (`rlbolt.algorithms.rollout_correction`:
        weights 0 and keep False on dropped tokens; its metrics are logged)."""
        measure = self.rollout_cfg.record_routing and not self.algo.router_replay  # recorded, not replayed
        forward_old = needs_old_forward(self.context.plan.num_iterations, self.algo, "teacher" in self.scorers, measure)
        group = self.logps_group_size(batch) if forward_old or self.scorers else 1
        old = batch["sampler_logps"]
        if forward_old:  # the policy's logps, replaying or measuring recorded routing (old_logps.py)
            old = policy_old_logps(self.policy, self.policy_params(self.full_params(params)), self.sharding, batch,
                                   group, replay=self.algo.router_replay, measure=measure, log=self.log)
        cols: dict[str, Any] = {"old_logps": np.asarray(old, np.float32)}
        if self.algo.rollout_correction != "none":
            cols.update(correction_columns(cols["old_logps"], batch, self.algo, self.log))
        for name, scorer in self.scorers.items():  # a placed scorer's forward runs unshared on its own mesh
            cols[f"{name}_logps"] = scorer.logps(batch, group)
        return batch.with_columns(cols)

    # -- rewards and advantages ------------------------------------------------------------------------
    def on_reward(self, batch: Batch) -> Batch:
        """Adds `rewards` [N] (`compute_rewards`), per reward micro batch: each sample is scored
        on its own, so scoring runs while later samples are still generated."""
        return batch.with_columns(rewards=np.asarray(self.compute_rewards(batch), np.float32))

    def on_advantage(self, batch: Batch) -> Batch:
        """Rewards [N] (from `on_reward`, or computed here when called directly) -> `filter_groups`
        -> advantages, on the whole global batch."""
        if "rewards" not in batch:
            batch = self.on_reward(batch)
        batch = self.filter_groups(batch)
        if batch.num_samples == 0:
            return batch.with_columns(advantages=np.zeros((0,), np.float32))
        # The training forward trusts the `a a b b` layout: refuse a batch that broke it.
        require_shared_layout(batch["prompt_ids"], batch["prompt_mask"], self.train_group_size, "on_advantage")
        out = self.compute_advantages(batch)
        cols = dict(out) if isinstance(out, Mapping) else {"advantages": out}
        if "teacher" in self.scorers:  # on-policy distillation: the teacher's per-token reverse KL
            cols["advantages"] = distill_advantages(batch, cols["advantages"], self.algo, self.log)
        return batch.with_columns({k: np.asarray(v, np.float32) for k, v in cols.items()})

    def compute_rewards(self, batch: Batch) -> np.ndarray:
        """Scores each completion with the reward runner (failure-isolated) and adds DAPO's
        overlong penalty when `algorithm.overlong_cache_length` > 0. Returns [N] float32."""
        share = self.sharding.share if self.sharding is not None else None  # each process scores its rows
        return batch_rewards(self.reward_runner, batch, share, self.algo, self.rollout_cfg.max_new_tokens, self.log)

    def filter_groups(self, batch: Batch) -> Batch:
        """Which samples to keep (whole groups). Default: all."""
        return batch

    def compute_advantages(self, batch: Batch) -> Any:
        """GRPO: rewards z-scored within their group (arXiv 2402.03300 Sec. 4.1.2).

        Returns:
          [N] or [N, C] advantages, or a dict of columns holding "advantages" (and e.g. "returns").
        """
        return grpo_advantages(jnp.asarray(batch["rewards"]), jnp.asarray(batch["group_ids"]))

    # -- training (jitted) -------------------------------------------------------------------------------
    def policy_loss(self, logps: jax.Array, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The per-token policy loss [N, C] that `algorithm.policy_loss` names (`rlbolt.algorithms.objectives`:
        PPO-clip with clip-higher and dual-clip by default; GSPO, CISPO, SAPO, GMPO, Clip-Cov, KL-Cov)."""
        return OBJECTIVES[self.algo.policy_loss](logps, batch, self.algo)

    def aggregate(self, per_token: jax.Array, batch: Batch) -> jax.Array:
        """`aggregate_loss` in the configured mode with the mini-batch totals."""
        return aggregate_loss(per_token, batch["completion_mask"], LossAggregation(self.algo.loss_aggregation),
                              num_tokens_total=batch["mini_batch_num_tokens"][0],
                              num_samples_total=batch["mini_batch_num_samples"][0],
                              max_completion_length=self.completion_width)

    def token_mean(self, values: jax.Array, batch: Batch) -> jax.Array:
        """sum(values * mask) / mini-batch tokens: a metric that sums to the mini-batch mean."""
        mask = batch["completion_mask"]
        return jnp.sum(jnp.where(mask, values.astype(jnp.float32), 0.0)) / jnp.maximum(batch["mini_batch_num_tokens"][0], 1.0)

    def forward(self, params: Any, batch: Batch) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """One policy forward: (logps [N, C], entropy [N, C], aux) where aux feeds `extra_loss`."""
        # Mixture of experts with a router term: the forward also returns its routing (moe_routing.py).
        routing = tuple(batch[k] for k in ROUTING_COLUMNS) if self.routes_in_training and self.algo.router_replay else None
        if not self.routes_in_training and "pack_rows" in batch:  # plan.packing: the packed rows (rlbolt.packing)
            return *self.policy.packed_forward(self.policy_params(params), batch, self.context.plan.packed_row_tokens), {}
        return self.policy.forward(self.policy_params(params), token_inputs(batch), group_size=self.train_group_size,
                                   routed=self.routes_in_training, routing=routing)

    def training_step(self, params: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """policy loss + beta * KL (when in the loss) - entropy_coef * entropy + extra_loss."""
        a = self.algo
        logps, entropy, aux = self.forward(params, batch)
        per_token, info = self.policy_loss(logps, batch)
        loss = self.aggregate(per_token, batch)
        metrics = {"loss/policy": loss, "entropy": self.token_mean(entropy, batch),
                   "clip_frac": self.token_mean(info["clipped"], batch), "ratio/mean": self.token_mean(info["ratio"], batch)}
        for rule in objective_selections():  # Clip-Cov / KL-Cov: the share of tokens the covariance rule picked
            if rule in info:
                metrics["cov/selected_frac"] = self.token_mean(info[rule], batch)
        if a.beta > 0 and "ref_logps" in batch:
            kl = kl_penalty(logps, batch["ref_logps"], a.kl_kind, a.kl_clamp, mask=batch["completion_mask"])
            metrics["kl"] = self.token_mean(kl, batch)
            if self.kl_in_loss:
                metrics["loss/kl"] = a.beta * self.aggregate(kl, batch)
                loss = loss + metrics["loss/kl"]
        if a.entropy_coef:
            metrics["loss/entropy"] = -a.entropy_coef * self.aggregate(entropy, batch)
            loss = loss + metrics["loss/entropy"]
        router = aux.pop("router", None)
        if router is not None and self.config.model.router_aux_loss_coef > 0:  # weighted by its token share
            share = self.token_mean(jnp.ones(batch["completion_mask"].shape), batch)  # this micro batch's tokens
            metrics["moe/aux_loss"] = micro_batch_load_balancing(router, batch, self.train_group_size, share)
            loss = loss + self.config.model.router_aux_loss_coef * metrics["moe/aux_loss"]
        extra, extra_metrics = self.extra_loss(aux, batch)
        return loss + extra, {**metrics, **extra_metrics}

    def extra_loss(self, aux: dict[str, jax.Array], batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """More loss terms from `forward`'s aux outputs (PPO's value loss); default none."""
        return jnp.zeros((), jnp.float32), {}

    # -- validation ----------------------------------------------------------------------------------
    def validation_step(self, params: Any, batch: Batch, *, num_samples: int | None = None) -> dict[str, float]:
        """Greedy accuracy, and pass@k over k samples per prompt (`num_samples`, which
        `Evaluation(num_samples=k)` passes; None: `rollout.val_num_samples`)."""
        return validation_metrics(self.rollout, self.encoder, params, batch, answer_field=self.config.data.answer_field,
                                  k=num_samples or self.rollout_cfg.val_num_samples,
                                  temperature=self.rollout_cfg.val_temperature)
