"""LMPolicyModule: the shared base of the ready LM algorithms (GRPO and friends).

It owns everything that is the same across algorithms: building the model, tokenizer, sampler,
frozen reference and reward runner in `setup` (policy_setup.py, with LoRA's parameter hooks);
prompts -> completions in `on_rollout` (policy_rollout.py: the engine, episodes); reference (and, when needed, old) logps in
`compute_logps`; rewards in `on_advantage`; the loss skeleton in `training_step` (policy loss +
KL + entropy, aggregated with mini-batch totals); and greedy accuracy / pass@k in
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

import threading
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
from rlbolt.module import RLModule
from rlbolt.plan import PlanError
from rlbolt.modules.policy_rollout import PolicyRollout, row_fields as _row_fields
from rlbolt.modules.policy_setup import PolicySetup, _config_for, replace_section  # noqa: F401 (re-export)
from rlbolt.modules.prompt_sharing import require_shared_layout, stage_group_size
from rlbolt.modules.prompts import rows_of
from rlbolt.modules.policy_losses import COVARIANCE_SELECTIONS, POLICY_LOSSES
from rlbolt.modules.rewarding import answer_score, score_shared
from rlbolt.modules.moe_routing import ROUTING_COLUMNS, completion_load_balancing
from rlbolt.distributed.sharding import host_value
from rlbolt.packing import packed_sequence_logps
from rlbolt.rollout.logps import routed_token_logps, sequence_logps
from rlbolt.rewards import RewardFn, WeightedReward
from rlbolt.rollout.engine import RolloutEngine
from rlbolt.rollout.engines import EngineHandle



class LMPolicyModule(PolicyRollout, PolicySetup, RLModule):
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
        self.model, self.tokenizer, self.reward = model, tokenizer, reward
        self.ref_params = None
        self.reference = None  # a PlacedReference when placement gives the reference devices of its own
        self.sharding = None  # the trainer's ShardingPlan, from setup
        self.lora = None  # a LoraPolicy when config.model.lora is set
        self.train_group_size = 1  # G when the training forward runs each group's prompt once (setup)
        self.routes_in_training = False  # the training forward returns its MoE routing (setup)
        self._engine_lock = threading.Lock()  # validation (main thread) and rollout (producer) share it
        self._engine_choice = engine if engine is not None else self.config.rollout.engine
        self._engine: EngineHandle | None = None  # built on first use (rollout_engine)
        self._env_choice = env if env is not None else self.rollout_cfg.env
        self.teacher = teacher  # a Decoder (setup loads algorithm.distill_teacher)
        self.teacher_params = None
        self.teacher_forward = None  # a PlacedReference when placement gives the teacher devices of its own
        self.env_factory = None  # the environment factory (setup), when samples are episodes
        self.env_errors = None  # its EnvErrorMonitor (setup): every error logged, a broken environment stops the run

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

    @staticmethod
    def _forward_keys(batch: Batch) -> tuple[str, ...]:
        """The forward's inputs. An episode's forward attends over every real id (`sequence_mask`:
        sampled and environment ids), while the loss, KL and metrics use `completion_mask` (sampled
        ids only), so environment ids are context but never trained."""
        return ("prompt_ids", "prompt_mask", "completion_ids", "sequence_mask" if "sequence_mask" in batch else
                "completion_mask")

    def _token_inputs(self, batch: Batch) -> tuple:
        return tuple(jnp.asarray(batch[k]) for k in self._forward_keys(batch))

    def _rows_on_mesh(self, batch: Batch, keys: tuple[str, ...] | None = None) -> tuple:
        """This process's token inputs (or the columns `keys`) as arrays split over the mesh's batch shards."""
        host = tuple(np.asarray(batch[k]) for k in (keys or self._forward_keys(batch)))
        return host if self.sharding is None else self.sharding.put_local(host)

    def _local(self, x: Any) -> np.ndarray:
        return np.asarray(x if self.sharding is None else self.sharding.local_rows(x), np.float32)

    def compute_logps(self, params: Any, batch: Batch) -> Batch:
        """Adds `old_logps` (a forward pass when num_iterations > 1 or a rollout correction is on;
        else the sampler's), `ref_logps` when beta > 0, and `importance_weights` [N, C] float32 and
        `keep_mask` [N, C] bool when `algorithm.rollout_correction` corrects the engine's logps toward
        the trainer's (`rlbolt.algorithms.rollout_correction`: weights 0 and keep False on dropped
        tokens; its metrics are logged)."""
        inputs = self._rows_on_mesh(batch)
        cols: dict[str, Any] = {}
        correcting = self.algo.rollout_correction != "none"
        # A teacher's logps come from the trainer's forward: the student's must too, so that the
        # reverse KL compares like with like (a teacher equal to the student gives exactly 0).
        forward_old = self.context.plan.num_iterations > 1 or correcting or self.teacher is not None
        lm_params = self.policy_params(self.full_params(params))
        # Recorded routing without replay: the logps forward recomputes it (moe/routing_mismatch).
        mismatch = self.rollout_cfg.record_routing and not self.algo.router_replay
        forward_old = forward_old or mismatch
        group = self.logps_group_size(batch) if forward_old or self.algo.beta > 0 else 1
        if mismatch:
            routing = self._rows_on_mesh(batch, ROUTING_COLUMNS)
            logps, mismatched, total = self._logps_and_mismatch(lm_params, *inputs, *routing, group_size=group)
            old = self._local(logps)
            self.log("moe/routing_mismatch", float(host_value(mismatched)) / max(float(host_value(total)), 1.0))
        elif forward_old:
            routing = self._rows_on_mesh(batch, ROUTING_COLUMNS) if self.algo.router_replay else None
            old = self._local(self._logps(lm_params, *inputs, group_size=group, routing=routing))
        else:
            old = batch["sampler_logps"]
        cols["old_logps"] = np.asarray(old, np.float32)
        if correcting:
            a = self.algo
            weights, keep, metrics = rollout_correction(
                jnp.asarray(old), jnp.asarray(batch["sampler_logps"]), jnp.asarray(batch["completion_mask"]),
                mode=a.rollout_correction, level=a.rollout_correction_level, cap=a.rollout_correction_cap)
            # The objectives see the keep-mask (a dropped token is out of every sequence ratio and
            # covariance they pool: policy_losses.py); the aggregation keeps the completion mask, so a
            # dropped token keeps its place in the normaliser with weight 0 and the loss's scale does
            # not depend on how many tokens were dropped (verl instead removes them from the mask).
            cols["importance_weights"] = np.asarray(jnp.where(keep, weights, 0.0), np.float32)
            cols["keep_mask"] = np.asarray(keep, bool)
            for name, value in metrics.items():
                self.log(name, float(value))
        if self.reference is not None:  # on the reference's own devices (its forward runs unshared)
            cols["ref_logps"] = self.reference.logps(self.ref_params, batch)
        elif self.ref_params is not None:
            cols["ref_logps"] = self._local(self._logps(self.ref_params, *inputs, group_size=group))
        elif self.lora is not None and self.algo.beta > 0:
            cols["ref_logps"] = self._local(self._ref_logps(self.lora.base, *inputs, group_size=group))
        if self.teacher_forward is not None:  # on the teacher's own devices (its forward runs unshared)
            cols["teacher_logps"] = self.teacher_forward.logps(self.teacher_params, batch)
        elif self.teacher is not None:
            cols["teacher_logps"] = self._local(self._teacher_logps(self.teacher_params, *inputs, group_size=group))
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
        if self.teacher is not None:  # on-policy distillation: the teacher's per-token reverse KL
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
        """The per-token policy loss [N, C] that `algorithm.policy_loss` names (`modules/policy_losses.py`:
        PPO-clip with clip-higher and dual-clip by default; GSPO, CISPO, SAPO, GMPO, Clip-Cov, KL-Cov)."""
        return POLICY_LOSSES[self.algo.policy_loss](logps, batch, self.algo)

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
        if not self.routes_in_training and "pack_rows" in batch:  # plan.packing: the packed rows (rlbolt.packing)
            logps, entropy = packed_sequence_logps(
                self.graphdef, self.policy_params(params), *self._token_inputs(batch), batch["pack_rows"],
                batch["pack_starts"], row_tokens=self.context.plan.packed_row_tokens, with_entropy=True,
                blocks=1 if self.sharding is None else self.sharding.batch_shards, **self._logps_options)
            return logps, entropy, {}
        if not self.routes_in_training:
            logps, entropy = sequence_logps(self.graphdef, self.policy_params(params), *self._token_inputs(batch),
                                            with_entropy=True, group_size=self.train_group_size, **self._logps_options)
            return logps, entropy, {}
        # Mixture of experts with a router term: the forward also returns its routing (moe_routing.py).
        routing = tuple(batch[k] for k in ROUTING_COLUMNS) if self.algo.router_replay else None
        logps, entropy, experts, probs = routed_token_logps(
            self.graphdef, self.policy_params(params), *self._token_inputs(batch), with_entropy=True,
            group_size=self.train_group_size, routing=routing, **self._logps_options)
        return logps, entropy, {"router": (experts, probs)}

    def training_step(self, params: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """policy loss + beta * KL (when in the loss) - entropy_coef * entropy + extra_loss."""
        a = self.algo
        logps, entropy, aux = self.forward(params, batch)
        per_token, info = self.policy_loss(logps, batch)
        loss = self.aggregate(per_token, batch)
        metrics = {"loss/policy": loss, "entropy": self.token_mean(entropy, batch),
                   "clip_frac": self.token_mean(info["clipped"], batch), "ratio/mean": self.token_mean(info["ratio"], batch)}
        for rule in COVARIANCE_SELECTIONS:  # Clip-Cov / KL-Cov: the share of tokens the covariance rule picked
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
        if self.env_factory is not None:  # greedy episodes: the mean environment reward
            episodes = self._episodes(params, rows, self._episode_prompts(rows), keys, None, 0.0, log=False)
            return {"env_reward": float(np.mean(episodes["env_reward"]))}
        ids = self.encoder.encode_rows(rows)
        answer_field = self.config.data.answer_field
        greedy = self._generate(params, ids, keys, 0.0)
        texts = self._decode(greedy.completion_ids, greedy.completion_mask)
        metrics = {"accuracy": float(np.mean([answer_score(t, r, answer_field) for t, r in zip(texts, rows)]))}
        k = num_samples or self.rollout_cfg.val_num_samples
        if k > 1:
            many_keys = np.asarray(jax.vmap(lambda key: jax.random.split(key, k))(jnp.asarray(keys)), np.uint32)
            out = self._generate(params, [i for i in ids for _ in range(k)], many_keys.reshape(-1, 2),
                                 self.rollout_cfg.val_temperature)
            texts = self._decode(out.completion_ids, out.completion_mask)
            scores = np.array([answer_score(t, rows[j // k], answer_field) for j, t in enumerate(texts)])
            metrics[f"pass@{k}"] = float(scores.reshape(-1, k).max(axis=1).mean())
        return metrics
