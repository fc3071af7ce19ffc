"""Training on episodes from Python: `EpisodeGRPO`, GRPO whose `on_rollout` calls `run_episodes`.

This is the documented Python path for an RLModule author: subclass a ready module, run the
episodes in `on_rollout`, and hand the trainer the episode batch's columns. Three things differ
from single-turn GRPO, each one method here:

- `on_rollout`: one environment per sample (`env_factory(row)`), `run_episodes`, and the columns
  `completion_ids` / `completion_mask` (the loss mask: 1 on sampled ids only) / `sequence_mask`
  (every real id) / `sampler_logps` / `env_reward`;
- `compute_rewards`: the environment's reward instead of the reward runner;
- `_token_inputs`: the training forward attends over `sequence_mask` (sampled and environment
  ids); the loss, the metrics and the KL still use `completion_mask`, so environment ids get
  no gradient.

`train_demo(task)` trains a 2-layer width-64 model from scratch on one of `rlbolt.agents.tasks`
(`python -m rlbolt.agents.demo_training --task tool`), printing the mean episode reward.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from rlbolt.agents.environment import EnvFactory
from rlbolt.agents.rollout import run_episodes
from rlbolt.batch import Batch
from rlbolt.modules import GRPO
from rlbolt.modules.prompts import rows_of

__all__ = ["EpisodeGRPO", "train_demo", "no_reward"]

# Columns the producer adds before on_rollout; every other column is a field of the prompt row.
_PRODUCER_COLUMNS = frozenset({"group_ids", "policy_version", "sample_keys", "dock_index"})


def no_reward(completion: str, sample: Mapping) -> float:
    """A placeholder reward term: episodes are scored by their environments."""
    return 0.0


class EpisodeGRPO(GRPO):
    """GRPO on multi-turn episodes (see the module docstring).

    Args:
      config: the run config (as for GRPO); `rollout.max_new_tokens` is not used for episodes.
      env_factory: `Factory(row) -> Environment`.
      max_turns: most model turns per episode.
      max_total_tokens: ids after the prompt per episode (sampled + environment).
      max_turn_tokens: ids sampled per turn.
      prompt_width: every opening prompt is left-padded to this many ids (one compile).
      model: the Decoder to train.
      tokenizer: renders the environment's messages and decodes turns.
    """

    def __init__(self, config: Any, *, env_factory: EnvFactory, max_turns: int, max_total_tokens: int,
                 max_turn_tokens: int, prompt_width: int, model=None, tokenizer=None):
        super().__init__(config, model=model, tokenizer=tokenizer, reward=no_reward)
        self.env_factory = env_factory
        self.limits = dict(max_turns=max_turns, max_total_tokens=max_total_tokens, max_turn_tokens=max_turn_tokens)
        self.prompt_width = prompt_width

    def on_rollout(self, params: Any, batch: Batch) -> Batch:
        """Runs one episode per sample and adds the episode batch's columns (T = max_total_tokens)."""
        rows = rows_of(batch, [k for k in batch if k not in _PRODUCER_COLUMNS])
        envs = [self.env_factory(row) for row in rows]
        lm_params = self.policy_params(self.full_params(params))

        def generate(prompt_ids, rng_keys, **opts):
            return self._generate_turn(lm_params, prompt_ids, rng_keys, **opts)

        episodes = run_episodes(generate, envs, np.asarray(batch["sample_keys"], np.uint32), tokenizer=self.tokenizer,
                                temperature=self.rollout_cfg.temperature, **self.limits)
        for name, value in episodes.metrics().items():
            self.log(name, value)
        return batch.with_columns(episodes.columns(self.tokenizer.pad_id, self.prompt_width))

    def _generate_turn(self, lm_params: Any, prompt_ids: list[list[int]], rng_keys: np.ndarray, **opts: Any):
        """One turn's batched generate with the policy's sampler (built on first use)."""
        from rlbolt.rollout import NativeSampler

        with self._sampler_lock:
            if self._sampler is None:
                longest = self.prompt_width + self.limits["max_total_tokens"]
                buckets = tuple(b for b in (8, 16, 32, 64) if b < longest) + (longest,)
                self._sampler = NativeSampler(self.model, max_new_tokens=self.limits["max_turn_tokens"],
                                              temperature=self.rollout_cfg.temperature,
                                              stop_token_ids=(self.tokenizer.eos_id,), pad_id=self.tokenizer.pad_id,
                                              prompt_buckets=buckets, share_prompts=False,
                                              micro_batch_size=self.trainer.plan.rollout_micro_batch_size)
            self._sampler.update_weights(lm_params, 0)
            return self._sampler.generate(prompt_ids, rng_keys, **opts)

    def compute_rewards(self, batch: Batch) -> np.ndarray:
        """The environments' summed step rewards ([N] float32)."""
        return np.asarray(batch["env_reward"], np.float32)

    def _token_inputs(self, batch: Batch) -> tuple:
        """The training forward's inputs: it attends over every real id (`sequence_mask`)."""
        return tuple(jnp.asarray(batch[k]) for k in ("prompt_ids", "prompt_mask", "completion_ids", "sequence_mask"))

    def validation_step(self, params: Any, batch: Batch) -> dict[str, float]:
        """Not used by the demo (it reports the training reward)."""
        return {}


def _demo_config(learning_rate: float, entropy_coef: float, max_turn_tokens: int) -> dict:
    return {"algorithm": {"name": "grpo", "lr": learning_rate, "beta": 0.0, "loss_aggregation": "token-mean",
                          "entropy_coef": entropy_coef},
            "rollout": {"max_new_tokens": max_turn_tokens, "temperature": 1.0},
            "reward": {"weights": {"answer": 1.0}, "executor": "thread"},
            "model": {"share_prompt": False}}


def train_demo(task: str = "tool", *, steps: int | None = None, prompts_per_step: int = 16,
               num_generations: int = 8,
               learning_rate: float | None = None, entropy_coef: float = 0.02, hidden_size: int = 64, seed: int = 0,
               run_dir: str | None = None, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Trains a 2-layer random-init model on a demo task with EpisodeGRPO; returns the reward per step.

    Args:
      task: "tool" or "guess" (`rlbolt.agents.tasks.DEMO_TASKS`).
      steps: global steps; None: the task's (`DEMO_TASKS`).
      prompts_per_step: prompts per step.
      num_generations: episodes per prompt (the GRPO group).
      learning_rate: AdamW learning rate; None: the task's (`DEMO_TASKS`).
      entropy_coef: entropy bonus; keeps the answer turn exploring while the call is being learned
        (without it the answer collapses to one digit before the lookup is right often enough).
      hidden_size: model width (2 layers).
      seed: model init, rows and sampling.
      run_dir: where the trainer writes (a fresh temporary folder when None).
      on_step: called with (step, mean episode reward) after each step.

    Returns:
      The mean episode reward of each step.
    """
    import tempfile

    from flax import nnx

    from rlbolt import BatchPlan, Callback, Trainer
    from rlbolt.agents.tasks import DEMO_TASKS, demo_tokenizer
    from rlbolt.models import Decoder, tiny_config

    if task not in DEMO_TASKS:
        raise ValueError(f"task={task!r}; the demo tasks are {sorted(DEMO_TASKS)}")
    spec = DEMO_TASKS[task]
    make_rows, factory, limits = spec.rows, spec.env_factory, spec.limits
    learning_rate = spec.learning_rate if learning_rate is None else learning_rate
    steps = spec.steps if steps is None else steps
    tokenizer = demo_tokenizer()
    prompt_width = 4
    config = tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=hidden_size // 4,
                         max_position_embeddings=prompt_width + limits["max_total_tokens"] + 1)
    model = Decoder(config, rngs=nnx.Rngs(seed))
    module = EpisodeGRPO(_demo_config(learning_rate, entropy_coef, limits["max_turn_tokens"]), env_factory=factory,
                         prompt_width=prompt_width, model=model, tokenizer=tokenizer, **limits)
    rewards: list[float] = []

    class _Record(Callback):
        def on_step_end(self, trainer, info):
            value = float(info.metrics.get("reward/mean", np.nan))
            rewards.append(value)
            if on_step is not None:
                on_step(info.step, value)

    plan = BatchPlan(prompts_per_step=prompts_per_step, num_generations=num_generations)
    with tempfile.TemporaryDirectory() as scratch:
        trainer = Trainer(plan, max_steps=steps, seed=seed, callbacks=[_Record()], run_dir=run_dir or scratch)
        trainer.fit(module, make_rows(max(steps * prompts_per_step, 64), seed))
    return rewards


def main(argv: list[str] | None = None) -> None:
    """`python -m rlbolt.agents.demo_training --task tool` (the task's steps unless --steps is given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="tool", choices=("tool", "guess"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--entropy", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()

    def show(step: int, reward: float) -> None:
        print(f"step {step:4d}  reward {reward:.3f}  ({time.monotonic() - started:.0f} s)", flush=True)

    rewards = train_demo(args.task, steps=args.steps, learning_rate=args.lr, entropy_coef=args.entropy, seed=args.seed,
                         on_step=show)
    first, last = np.mean(rewards[:10]), np.mean(rewards[-20:])
    print(f"task {args.task}: mean reward of the first 10 steps {first:.3f}, of the last 20 steps {last:.3f}")


if __name__ == "__main__":
    main()
