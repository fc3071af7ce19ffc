"""The built-in demo's task and module: a tiny random-init decoder learns a digit task from scratch
with GRPO (`rlbolt demo`; the application side, the command and its run folder, is `rlbolt.app`).

Task (`task="copy"`, the default): the prompt is `num_digits` random digits and "=", e.g.
"3141="; the right completion repeats the digits ("3141"). "reverse" ("1413") and "increment"
("4252") are harder variants. The completion has exactly `num_digits` tokens and the reward is
the fraction of right digits (partial credit), so a random policy scores ~0.1 and a perfect
one 1.0. The model starts knowing nothing, not even that digits should be copied.

The module is GRPO (DeepSeekMath, arXiv 2402.03300, Sec. 4.1) composed from `rlbolt.algorithms`:
group z-scored advantages, the clipped surrogate, token-mean aggregation over the mini batch.
Departures from the paper, for speed on a laptop CPU: no KL term (beta = 0, as DAPO and
Dr.GRPO also do), so no reference model; and process-supervision advantages (Sec. 4.1.3, each
completion token is a "step" scored by whether it is right), which assign credit per digit and
learn several times faster than one outcome reward per completion on this task.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rlbolt.algorithms import aggregate_loss, clipped_surrogate, grpo_process_advantages
from rlbolt.batch import Batch
from rlbolt.demo.config import DemoConfig, DemoConfigError
from rlbolt.demo.tasks import DEMO_TASKS
from rlbolt.data.tokenizers import CharTokenizer
from rlbolt.models import Decoder, tiny_config
from rlbolt.module import RLModule
from rlbolt.modules.lora_policy import LoraHooks
from rlbolt.plan import PlanError
from rlbolt.rollout.engines import EngineHandle, EngineSpec, build_engine

DIGITS = "0123456789"


def demo_tokenizer() -> CharTokenizer:
    """The digit tasks' tokenizer: pad 0, eos 1, bos 2, the digits 3-12, "=" 13."""
    return CharTokenizer(DIGITS + "=")


def target_match_reward(completion: str, sample: Mapping[str, Any]) -> float:
    """The digit tasks' reward as a `RewardFn`: the share of the row's `answer` characters that the
    completion has at the same position (`position_rewards`' mean for one sample).

    Args:
      completion: the sampled text.
      sample: the prompt row; its "answer" field holds the target digits.
    """
    target = str(sample["answer"])
    return float(sum(a == b for a, b in zip(completion, target)) / max(len(target), 1))


def copy_target(digits: str) -> str:
    """The "copy" task: the digits themselves ("3141" -> "3141")."""
    return digits


def reverse_target(digits: str) -> str:
    """The "reverse" task: the digits backwards ("3141" -> "1413")."""
    return digits[::-1]


def increment_target(digits: str) -> str:
    """The "increment" task: each digit plus one, mod 10 ("3141" -> "4252")."""
    return "".join(DIGITS[(DIGITS.index(d) + 1) % 10] for d in digits)


def demo_rows(config: DemoConfig) -> list[dict[str, str]]:
    """The synthetic prompts: `{"prompt": "3141=", "target": "1413"}` rows, seeded, the target
    the task's (`rlbolt.demo.tasks`); an episode task's own rows for "tool" and "guess"; an unset
    `num_prompts` is the task's (`DemoConfig.resolved`)."""
    config = config.resolved()
    task = DEMO_TASKS[config.task]
    if task.episodes:
        return task.load("rows")(config.num_prompts, config.seed)
    target = task.load("target")
    rng = np.random.default_rng(config.seed)
    digits = rng.integers(0, 10, size=(config.num_prompts, config.num_digits))
    rows = []
    for row in digits:
        text = "".join(DIGITS[d] for d in row)
        rows.append({"prompt": text + "=", "target": target(text)})
    return rows


def position_rewards(completions: list[str], targets: list[str], length: int) -> np.ndarray:
    """[N, C] float32: 1 where completion character t equals target character t, else 0."""
    out = np.zeros((len(targets), length), np.float32)
    for i, (got, want) in enumerate(zip(completions, targets)):
        for t, (a, b) in enumerate(zip(got[:length], want[:length])):
            out[i, t] = float(a == b)
    return out


class DigitsGRPO(LoraHooks, RLModule):
    """GRPO on the digit tasks (copy by default) with a tiny random-init decoder.

    Args:
      config: the demo's DemoConfig.
      base_model: a Decoder to start from instead of a random one (`demo.base_run`: the app layer
        reads that run's latest model, `rlbolt.app.cli_export.demo_base_model`); it must have this
        demo's model shape.
    """

    def __init__(self, config: DemoConfig, base_model: Decoder | None = None):
        self.config = config.resolved()  # the task's learning rate when unset
        self.base_model = base_model
        self.tokenizer = demo_tokenizer()
        self.model_config = tiny_config(vocab_size=self.tokenizer.vocab_size, hidden_size=config.hidden_size,
                                        intermediate_size=2 * config.hidden_size, head_dim=config.hidden_size // 4,
                                        max_position_embeddings=2 * config.num_digits + 2)
        self.graphdef = None
        self.lora = None  # a LoraPolicy when config.lora_rank is set
        self._engine: EngineHandle | None = None
        self._engine_lock = threading.Lock()  # rollout (producer thread) and validation share it

    @property
    def model(self) -> Decoder:
        """A Decoder holding the initial parameters (built in `init_params`)."""
        return self._model

    def init_params(self, rng: jax.Array) -> nnx.State:
        self._model = Decoder(self.model_config, rngs=nnx.Rngs(params=rng))
        if self.base_model is not None:
            if self.base_model.config != self.model_config:
                raise DemoConfigError(f"demo.base_run={self.config.base_run!r} trained a model of another shape "
                                      f"(hidden_size={self.config.hidden_size}, num_digits={self.config.num_digits}); "
                                      "use the same ones")
            self._model = self.base_model
        if self.config.lora_rank:
            from rlbolt.models.lora import LoraConfig
            from rlbolt.modules.lora_policy import LoraPolicy

            rank = self.config.lora_rank
            self.lora = LoraPolicy(self._model, LoraConfig(rank=rank, alpha=2.0 * rank),
                                   rngs=nnx.Rngs(params=jax.random.fold_in(rng, 1)), path=self.config.base_run)
            self._model = self.lora.policy_model
        self.graphdef, params = nnx.split(self._model, nnx.Param)
        prompt_len = self.config.num_digits + 1  # every prompt has this length: one bucket, no padding
        spec = EngineSpec(max_new_tokens=self.config.num_digits, temperature=self.config.temperature,
                          prompt_width=prompt_len)
        self._engine = EngineHandle(build_engine("native", self._model, spec))
        return self.lora.adapters if self.lora is not None else params

    def hf_model(self, params: nnx.State) -> Decoder:
        """The policy as a plain Decoder (LoRA adapters merged into the base), for HFExport."""
        if self.lora is not None:
            return self.lora.merged_model(params)
        return nnx.merge(self.graphdef, params)

    def generate(self, params: nnx.State, prompts: list[str], sample_keys: np.ndarray,
                 version: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Samples one completion per prompt with the rollout engine (rlbolt's native sampler).

        Args:
          params: the policy parameters to sample with.
          prompts: N prompt strings.
          sample_keys: [N, 2] uint32 raw keys, one per sample.
          version: the policy version of `params` (None: the engine's latest, for validation).

        Returns:
          (prompt_ids [N, P] int32, completion_ids [N, C] int32, sampler logps [N, C] float32).
        """
        prompt_ids = np.asarray([self.tokenizer.encode(p) for p in prompts], np.int32)
        with self._engine_lock:
            version = self._engine.version if version is None else version
            out = self._engine.generate(self.with_frozen(params, self.frozen_params()), version, prompt_ids.tolist(),
                                        np.asarray(sample_keys, np.uint32))
        return prompt_ids, np.asarray(out.completion_ids, np.int32), np.asarray(out.logps, np.float32)

    def check_plan(self, plan) -> None:
        """Refuses groups of one: the process advantages are relative to the group, so they would all be 0."""
        if plan.num_generations < 2:
            raise PlanError(f"num_generations={plan.num_generations}: the demo's GRPO advantages compare samples of "
                            "the same prompt; use num_generations >= 2")

    def configure_optimizers(self) -> optax.GradientTransformation:
        """AdamW at `config.learning_rate` with global-norm clipping at 1.0."""
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(self.config.learning_rate, weight_decay=0.0))

    # -- model calls (pure) ---------------------------------------------------------------------
    def _logits(self, params: nnx.State, ids: jax.Array) -> jax.Array:
        """[N, T] ids -> [N, T, V] next-token logits (no padding: every prompt has the same length)."""
        model = nnx.merge(self.graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        logits, _ = model(ids, positions)
        return logits

    def token_logps(self, params: nnx.State, prompt_ids: jax.Array, completion_ids: jax.Array) -> jax.Array:
        """Log-probs of the completion tokens under the temperature-scaled policy.

        Args:
          params: the policy parameters.
          prompt_ids: [N, P] int32.
          completion_ids: [N, C] int32.

        Returns:
          [N, C] float32.
        """
        p, c = prompt_ids.shape[1], completion_ids.shape[1]
        ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
        logits = self._logits(params, ids)[:, p - 1:p - 1 + c] / self.config.temperature
        logps = jax.nn.log_softmax(logits, axis=-1)
        return jnp.take_along_axis(logps, completion_ids[..., None], axis=-1)[..., 0]

    # -- hooks ------------------------------------------------------------------------------------
    def on_rollout(self, params: nnx.State, batch: Batch) -> Batch:
        prompt_ids, tokens, logps = self.generate(params, list(batch["prompt"]), batch["sample_keys"],
                                                  version=int(np.asarray(batch["policy_version"])[0]))
        return batch.with_columns(
            prompt_ids=prompt_ids, prompt_mask=np.ones_like(prompt_ids, bool),
            completion_ids=tokens, completion_mask=np.ones_like(tokens, bool),
            sampler_logps=logps,
            completion_text=np.asarray([self.tokenizer.decode(t) for t in tokens], object),
        )

    def on_advantage(self, batch: Batch) -> Batch:
        step_rewards = position_rewards(list(batch["completion_text"]), list(batch["target"]), self.config.num_digits)
        rewards = step_rewards.mean(axis=1)
        advantages = np.asarray(grpo_process_advantages(step_rewards, np.asarray(batch["group_ids"])))
        self.log("reward/exact_match", float((rewards == 1.0).mean()))
        return batch.with_columns(rewards=rewards, advantages=advantages)

    def training_step(self, params: nnx.State, batch: Batch):
        logps = self.token_logps(params, batch["prompt_ids"], batch["completion_ids"])
        mask = batch["completion_mask"]
        per_token, info = clipped_surrogate(logps, batch["old_logps"], batch["advantages"], mask,
                                            clip_low=self.config.clip, clip_high=self.config.clip)
        totals = dict(num_tokens_total=batch["mini_batch_num_tokens"][0],
                      num_samples_total=batch["mini_batch_num_samples"][0])
        loss = aggregate_loss(per_token, mask, "token-mean", **totals)
        clip_frac = aggregate_loss(info["clipped"].astype(jnp.float32), mask, "token-mean", **totals)
        return loss, {"clip_frac": clip_frac}

    def validation_step(self, params: nnx.State, batch: Batch) -> dict[str, float]:
        _, tokens, _ = self.generate(params, list(batch["prompt"]), batch["sample_keys"])
        texts = [self.tokenizer.decode(t) for t in tokens]
        return {"reward": float(position_rewards(texts, list(batch["target"]), self.config.num_digits).mean())}
