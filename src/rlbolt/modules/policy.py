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

from rlbolt.algorithms import LossAggregation, aggregate_loss, kl_penalty, overlong_penalty
from rlbolt.algorithms import grpo_advantages, reverse_kl_advantages, rollout_correction
from rlbolt.agents.environment import EnvFactory
from rlbolt.batch import Batch
from rlbolt.config import RunConfig, config_to_dict
from rlbolt.data.tokenizers import Tokenizer
from rlbolt.models.decoder import Decoder
from rlbolt.module import ModuleCard, RLModule
from rlbolt.plan import PlanError
from rlbolt.modules import lm_ops
from rlbolt.modules.moe_routing import ROUTING_COLUMNS, check_router_settings, completion_load_balancing
from rlbolt.modules.policy_model import PolicyModel, local_rows, rows_on_mesh, token_inputs
from rlbolt.modules.policy_rollout import PolicyRollout, row_fields as _row_fields
from rlbolt.modules.policy_setup import _config_for, build_policy, build_reward_runner, build_scorers
from rlbolt.modules.policy_setup import replace_section  # noqa: F401 (re-export)
from rlbolt.modules.prompt_sharing import require_shared_layout, stage_group_size
from rlbolt.modules.prompts import PromptEncoder, builtin_tokenizer, rows_of
from rlbolt.algorithms.objectives import OBJECTIVES, objective_selections
from rlbolt.modules.rewarding import answer_score, score_shared
from rlbolt.modules.scorers import LogpsScorer
from rlbolt.packing import packed_sequence_logps
from rlbolt.distributed.sharding import ShardingPlan, host_value
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
        if self.tokenizer is None:
            folder = cfg.model.tokenizer or cfg.model.path
            self.tokenizer = lm_ops.load_tokenizer(folder) if folder else builtin_tokenizer()
        model = self.policy.model if self.policy is not None else self._given["model"]  # a second setup keeps it
        self.policy = build_policy(cfg, model, self.tokenizer, context, self._train_temperature, lora=self.lora)
        check_router_settings(self.model.config.num_experts, cfg.model.router_aux_loss_coef,
                              self.rollout_cfg.record_routing, self.algo.router_replay, self._own_forward())
        # The training forward returns its routing when a router term needs it (`forward`).
        self.routes_in_training = self.model.config.num_experts > 0 and (
            cfg.model.router_aux_loss_coef > 0 or self.algo.router_replay)
        self.encoder = PromptEncoder(
            self.tokenizer, prompt_field=cfg.data.prompt_field, max_prompt_tokens=cfg.data.max_prompt_tokens,
            system_prompt=cfg.data.system_prompt, use_chat_template=cfg.data.use_chat_template,
            template_kwargs=cfg.data.chat_template_kwargs)
        self.reward, self.reward_runner = build_reward_runner(cfg, self.reward, self._env_choice is not None)
        env_factory = None
        if self._env_choice is not None:  # samples are multi-turn episodes (rlbolt.agents)
            from rlbolt.agents.environment import load_env_factory

            env_factory = load_env_factory(self._env_choice)  # ConfigError naming rollout.env
        self.scorers, self._given["teacher"] = build_scorers(cfg, self.policy, self._given["teacher"], self.tokenizer,
                                                             context)
        # Each group's prompt runs once where a stage's micro batches hold whole groups and the
        # mesh has one batch shard (prompt_sharing.py).
        self.train_group_size = self._group_size(context.plan.train_micro_batch_size, context.plan)
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
        """Refuses `num_generations=1` when this algorithm's advantages are group-relative.

        Found by what the algorithm computes, not by name: `compute_advantages` is probed with
        four groups of one sample and four different rewards. If every advantage comes back 0
        (a baseline from the sample's own group: GRPO, Dr.GRPO, RLOO, GSPO, DAPO), no sample
        would ever get a gradient. Batch-level estimators (REINFORCE++, PPO's GAE) pass.
        """
        if plan.num_generations > 1:
            return
        n, c = 4, 3
        probe = Batch(rewards=np.asarray([0.0, 1.0, 0.25, 0.5], np.float32), group_ids=np.arange(n),
                      completion_mask=np.ones((n, c), bool), old_logps=np.zeros((n, c), np.float32),
                      sampler_logps=np.zeros((n, c), np.float32), old_values=np.zeros((n, c), np.float32))
        try:
            out = self.compute_advantages(probe)
        except KeyError:  # a subclass reading columns the probe lacks: it cannot be judged this way
            return
        advantages = np.asarray(out["advantages"] if isinstance(out, Mapping) else out)
        if not np.any(advantages):
            raise PlanError(
                f"num_generations=1 with {type(self).__name__}: its advantage compares each sample with the other "
                "samples of the same prompt, so with one sample per prompt every advantage is 0 and nothing learns; "
                "use num_generations >= 2 (plan.num_generations)")

    def lr_schedule(self, count: int) -> float:
        """The learning rate of optimizer update `count` (0-based): linear warm-up, then constant.
        LearningRateMonitor reads it; configure_optimizers uses the same function."""
        a = self.algo
        return float(optax.linear_schedule(0.0, a.lr, a.warmup_steps)(count)) if a.warmup_steps else a.lr

    def configure_optimizers(self) -> optax.GradientTransformation:
        """AdamW with optional linear warm-up and global-norm clipping (config.algorithm)."""
        a = self.algo
        lr = optax.linear_schedule(0.0, a.lr, a.warmup_steps) if a.warmup_steps else a.lr
        adamw = optax.adamw(lr, weight_decay=a.weight_decay)
        return optax.chain(optax.clip_by_global_norm(a.max_grad_norm), adamw) if a.max_grad_norm > 0 else adamw

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
        from rlbolt.distributed import kv_cache_bytes, per_device_bytes

        held = {name: s for name, s in self.scorers.items() if s.on_train_devices and s.params is not None}
        out = {"reference": per_device_bytes(held["ref"].params)} if "ref" in held else {}
        if self.lora is not None:
            out["frozen base"] = per_device_bytes(self.lora.base)
        if "teacher" in held:
            out["teacher"] = per_device_bytes(held["teacher"].params)
        rows = self.context.plan.rollout_micro_batch_size
        rows = 1 << max(0, (rows - 1).bit_length())  # the sampler pads a call to a power of two
        # An upper bound: with the prompt shared the prompt slots are held once per group.
        out["kv cache"] = kv_cache_bytes(self.model.config, rows, self.encoder.width + self.completion_width - 1,
                                         sharding)
        return out

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
                          hparams=self.hparams)

    # -- logps --------------------------------------------------------------------------------------
    def logps_group_size(self, batch: Batch) -> int:
        """The group size a logps forward over `batch` shares prompts over (1: unshared); the
        batch's layout is checked first (prompt_sharing.py)."""
        size = self._group_size(batch.num_samples, self.context.plan)
        require_shared_layout(batch["prompt_ids"], batch["prompt_mask"], size, "on_rollout")
        return size

    def _group_size(self, micro_batch_size: int, plan) -> int:
        shards = 1 if self.sharding is None else self.sharding.batch_shards
        return stage_group_size(self.config.model.share_prompt, micro_batch_size, plan.num_generations, shards)

    @property
    def _train_temperature(self) -> float:
        # The ratio must compare like with like: logps under the distribution the sampler drew from.
        t = self.rollout_cfg.temperature
        return t if t > 0 else 1.0

    def compute_logps(self, params: Any, batch: Batch) -> Batch:
        """Adds `old_logps` (a forward pass when `_forward_old` says so; else the sampler's), each
        scorer's `<name>_logps` (`ref_logps` when beta > 0, `teacher_logps` when distilling), and
        `importance_weights` [N, C] float32 and `keep_mask` [N, C] bool when `algorithm.rollout_correction`
        corrects the engine's logps toward the trainer's (`rlbolt.algorithms.rollout_correction`:
        weights 0 and keep False on dropped tokens; its metrics are logged)."""
        forward_old = self._forward_old()
        group = self.logps_group_size(batch) if forward_old or self.scorers else 1
        old = self._old_logps(params, batch, group) if forward_old else batch["sampler_logps"]
        cols: dict[str, Any] = {"old_logps": np.asarray(old, np.float32)}
        if self.algo.rollout_correction != "none":
            cols.update(self._rollout_correction(cols["old_logps"], batch))
        for name, scorer in self.scorers.items():  # a placed scorer's forward runs unshared on its own mesh
            cols[f"{name}_logps"] = scorer.logps(batch, group)
        return batch.with_columns(cols)

    def _forward_old(self) -> bool:
        """Whether old logps need the trainer's forward: several updates per batch, a rollout
        correction, a teacher (its logps come from the trainer's forward, so the student's must too:
        a teacher equal to the student gives a reverse KL of exactly 0), or recorded routing without
        replay (the forward recomputes it and logs moe/routing_mismatch)."""
        return (self.context.plan.num_iterations > 1 or self.algo.rollout_correction != "none"
                or "teacher" in self.scorers or self._measures_routing)

    @property
    def _measures_routing(self) -> bool:
        return self.rollout_cfg.record_routing and not self.algo.router_replay

    def _old_logps(self, params: Any, batch: Batch, group: int) -> np.ndarray:
        """The policy's logps of `batch` ([N, C] float32 host rows), replaying recorded routing with
        `algorithm.router_replay`, or measuring its mismatch when it is only recorded."""
        lm_params, sharding = self.policy_params(self.full_params(params)), self.sharding
        inputs = rows_on_mesh(sharding, batch)
        recorded = self._measures_routing or self.algo.router_replay
        routing = rows_on_mesh(sharding, batch, ROUTING_COLUMNS) if recorded else None
        if self._measures_routing:
            logps, mismatched, total = self.policy.logps_and_mismatch(lm_params, *inputs, *routing, group_size=group)
            self.log("moe/routing_mismatch", float(host_value(mismatched)) / max(float(host_value(total)), 1.0))
            return local_rows(sharding, logps)
        return local_rows(sharding, self.policy.logps(lm_params, *inputs, group_size=group, routing=routing))

    def _rollout_correction(self, old: np.ndarray, batch: Batch) -> dict[str, np.ndarray]:
        """`importance_weights` and `keep_mask` of the engine's logps against `old` (metrics logged)."""
        a = self.algo
        weights, keep, metrics = rollout_correction(
            jnp.asarray(old), jnp.asarray(batch["sampler_logps"]), jnp.asarray(batch["completion_mask"]),
            mode=a.rollout_correction, level=a.rollout_correction_level, cap=a.rollout_correction_cap)
        for name, value in metrics.items():
            self.log(name, float(value))
        # The objectives see the keep-mask (a dropped token is out of every sequence ratio and
        # covariance they pool: algorithms/objectives.py); the aggregation keeps the completion mask, so a
        # dropped token keeps its place in the normaliser with weight 0 and the loss's scale does
        # not depend on how many tokens were dropped (verl instead removes them from the mask).
        return {"importance_weights": np.asarray(jnp.where(keep, weights, 0.0), np.float32),
                "keep_mask": np.asarray(keep, bool)}

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
            a, mask = self.algo, np.asarray(batch["completion_mask"], bool)
            task = cols["advantages"] if a.distill_task_coef > 0 else None
            advantages, reverse_kl = reverse_kl_advantages(
                batch["old_logps"], batch["teacher_logps"], mask, kl_coef=a.distill_kl_coef, task_advantages=task,
                task_coef=a.distill_task_coef)
            cols["advantages"] = advantages
            self.log("distill/reverse_kl", float(np.asarray(reverse_kl)[mask].mean()) if mask.any() else 0.0)
        return batch.with_columns({k: np.asarray(v, np.float32) for k, v in cols.items()})

    def compute_rewards(self, batch: Batch) -> np.ndarray:
        """Scores each completion with the reward runner (failure-isolated) and adds DAPO's
        overlong penalty when `algorithm.overlong_cache_length` > 0. Returns [N] float32."""
        samples = rows_of(batch, _row_fields(batch))
        share = self.sharding.share if self.sharding is not None else None  # each process scores its rows
        rewards, metrics = score_shared(self.reward_runner, list(batch["completion_text"]), samples, share)
        for name, value in metrics.items():
            if name not in ("reward/mean", "reward/std"):  # the producer reports those after filtering
                self.log(name, value)
        if self.algo.overlong_cache_length > 0:
            lengths = np.asarray(batch["completion_mask"]).sum(axis=1)
            penalty = np.asarray(overlong_penalty(lengths, self.rollout_cfg.max_new_tokens, self.algo.overlong_cache_length))
            self.log("reward/overlong_penalty", float(penalty.mean()))
            rewards = rewards + penalty
        return rewards

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
            logps, entropy = packed_sequence_logps(
                self.policy.graphdef, self.policy_params(params), *token_inputs(batch), batch["pack_rows"],
                batch["pack_starts"], row_tokens=self.context.plan.packed_row_tokens, with_entropy=True,
                blocks=1 if self.sharding is None else self.sharding.batch_shards, **self.policy.options)
            return logps, entropy, {}
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
        if router is not None and self.config.model.router_aux_loss_coef > 0:
            # The load-balancing loss is not a sum over tokens: each micro batch's counts its own fed
            # completion tokens and enters weighted by its share of the mini batch's completion tokens.
            balance = completion_load_balancing(*router, batch["prompt_mask"], batch["completion_mask"],
                                                self.train_group_size)
            share = self.token_mean(jnp.ones(batch["completion_mask"].shape), batch)  # this micro batch's tokens
            metrics["moe/aux_loss"] = balance * share
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
        rows = rows_of(batch, [k for k in _row_fields(batch) if k != "prompt_index"])
        keys = np.asarray(batch["sample_keys"], np.uint32)
        if self.rollout.env_factory is not None:  # greedy episodes: the mean environment reward
            episodes = self.rollout.episodes(params, rows, keys, None, 0.0, log=False)
            return {"env_reward": float(np.mean(episodes["env_reward"]))}
        ids = self.encoder.encode_rows(rows)
        answer_field = self.config.data.answer_field
        greedy = self.rollout.generate(params, ids, keys, 0.0).output
        texts = self.rollout.decode(greedy.completion_ids, greedy.completion_mask)
        metrics = {"accuracy": float(np.mean([answer_score(t, r, answer_field) for t, r in zip(texts, rows)]))}
        k = num_samples or self.rollout_cfg.val_num_samples
        if k > 1:
            many_keys = np.asarray(jax.vmap(lambda key: jax.random.split(key, k))(jnp.asarray(keys)), np.uint32)
            out = self.rollout.generate(params, [i for i in ids for _ in range(k)], many_keys.reshape(-1, 2),
                                        self.rollout_cfg.val_temperature).output
            texts = self.rollout.decode(out.completion_ids, out.completion_mask)
            scores = np.array([answer_score(t, rows[j // k], answer_field) for j, t in enumerate(texts)])
            metrics[f"pass@{k}"] = float(scores.reshape(-1, k).max(axis=1).mean())
        return metrics
