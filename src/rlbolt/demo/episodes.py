"""Training on episodes from Python, and the demo tasks' training.

The ready modules run episodes themselves: `GRPO(config, env=factory)` (or `rollout.env:
'package.module:Factory'` in a config) makes each sample a multi-turn episode
(`rlbolt.agents.run_episodes`), trains the sampled ids only (`completion_mask`) while the forward
attends over every real id (`sequence_mask`), and scores with `reward.weights: {env: 1.0}` (the
environment's rewards, summed) plus any other term. `EpisodeGRPO` is that GRPO with the episode
limits as arguments.

`train_demo(task)` trains a 2-layer width-64 model from scratch on one of the episode tasks
(`rlbolt.demo.tasks`: tool, guess; `rlbolt demo --task tool`, or `python -m rlbolt.demo.episodes
--task tool`), returning the mean episode reward of each step.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from rlbolt.agents.environment import EnvFactory
from rlbolt.data.tokenizers import Tokenizer
from rlbolt.demo.tasks import DEMO_TASKS, episode_tasks
from rlbolt.models.decoder import Decoder
from rlbolt.modules import GRPO

__all__ = ["EpisodeGRPO", "episode_config", "train_demo"]


def episode_config(config: dict, *, max_turns: int, max_total_tokens: int, max_turn_tokens: int,
                   prompt_width: int) -> dict:
    """`config` (a `{section: {key: value}}` dict) with the episode limits and the `env` reward term."""
    out = {k: dict(v) for k, v in config.items()}
    out.setdefault("rollout", {}).update(max_new_tokens=max_turn_tokens, max_turns=max_turns,
                                         max_total_tokens=max_total_tokens)
    out.setdefault("data", {}).setdefault("max_prompt_tokens", prompt_width)
    out.setdefault("reward", {}).setdefault("weights", {"env": 1.0})
    return out


class EpisodeGRPO(GRPO):
    """GRPO on multi-turn episodes: `GRPO(config, env=env_factory)` with the limits as arguments.

    Args:
      config: a `{section: {key: value}}` dict (as for GRPO).
      env_factory: `Factory(row) -> Environment`.
      max_turns: most model turns per episode.
      max_total_tokens: ids after the prompt per episode (sampled + environment).
      max_turn_tokens: ids sampled per turn.
      prompt_width: the prompts' padded width.
      model: the Decoder to train.
      tokenizer: renders the environment's messages and decodes turns.
    """

    def __init__(self, config: dict, *, env_factory: EnvFactory, max_turns: int, max_total_tokens: int,
                 max_turn_tokens: int, prompt_width: int, model: Decoder | None = None,
                 tokenizer: Tokenizer | None = None):
        super().__init__(episode_config(config, max_turns=max_turns, max_total_tokens=max_total_tokens,
                                        max_turn_tokens=max_turn_tokens, prompt_width=prompt_width),
                         model=model, tokenizer=tokenizer, env=env_factory)


def _demo_config(learning_rate: float, entropy_coef: float, max_turn_tokens: int) -> dict:
    return {"algorithm": {"name": "grpo", "lr": learning_rate, "beta": 0.0, "loss_aggregation": "token-mean",
                          "entropy_coef": entropy_coef},
            "rollout": {"max_new_tokens": max_turn_tokens, "temperature": 1.0},
            "reward": {"weights": {"env": 1.0}, "executor": "thread"},
            "model": {"share_prompt": False}}


def demo_module(task: str, *, learning_rate: float | None = None, entropy_coef: float = 0.02, hidden_size: int = 64,
                seed: int = 0) -> EpisodeGRPO:
    """The module a demo task trains: a 2-layer random-init model of width `hidden_size` with the
    demo tokenizer, GRPO on the task's episodes (learning rate: the task's when None)."""
    from flax import nnx

    from rlbolt.demo.agent_tasks import demo_tokenizer
    from rlbolt.models import Decoder, tiny_config

    if task not in episode_tasks():
        raise ValueError(f"task={task!r}; the episode demo tasks are {list(episode_tasks())}")
    spec = DEMO_TASKS[task]
    learning_rate = spec.learning_rate if learning_rate is None else learning_rate
    tokenizer = demo_tokenizer()
    prompt_width = 4
    config = tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=hidden_size // 4,
                         max_position_embeddings=prompt_width + spec.limits["max_total_tokens"] + 1)
    model = Decoder(config, rngs=nnx.Rngs(seed))
    return EpisodeGRPO(_demo_config(learning_rate, entropy_coef, spec.limits["max_turn_tokens"]),
                       env_factory=spec.load("env"), prompt_width=prompt_width, model=model, tokenizer=tokenizer,
                       **spec.limits)


def train_demo(task: str = "tool", *, steps: int | None = None, prompts_per_step: int = 16,
               num_generations: int = 8,
               learning_rate: float | None = None, entropy_coef: float = 0.02, hidden_size: int = 64, seed: int = 0,
               run_dir: str | None = None, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Trains a 2-layer random-init model on a demo task (`demo_module`); returns the reward per step.

    Args:
      task: "tool" or "guess" (`rlbolt.demo.tasks.DEMO_TASKS`).
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

    from rlbolt import BatchPlan, Callback, Trainer
    from rlbolt.demo.config import demo_num_prompts

    module = demo_module(task, learning_rate=learning_rate, entropy_coef=entropy_coef, hidden_size=hidden_size,
                         seed=seed)
    spec = DEMO_TASKS[task]
    steps = spec.steps if steps is None else steps
    make_rows = spec.load("rows")
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
        trainer.fit(module, make_rows(demo_num_prompts(task, steps, prompts_per_step), seed))
    return rewards


def main(argv: list[str] | None = None) -> None:
    """`python -m rlbolt.demo.episodes --task tool` (the task's steps unless --steps is given)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="tool", choices=episode_tasks())
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
