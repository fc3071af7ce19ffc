"""The data flow of one global step, in one thread: the specification the pipelined `Producer`
is held to, bit for bit (tests/core/test_producer_equivalence.py).

    for each round (the first, then refills while on_advantage dropped samples):
        rows    = source.take(position, prompts)                  prompts_per_step, then what is missing
        batch   = rows repeated G times + group_ids, policy_version, sample_keys(step, round, i)
        for each service batch (the lcm of the micro sizes):
            batch = on_rollout   per rollout micro batch          ids, masks, sampler_logps, text
            batch = compute_logps per logps micro batch           old_logps (+ ref_logps, teacher_logps)
            batch = on_reward    per reward micro batch           rewards (a module that overrides it)
        batch = on_advantage(the whole round)                     rewards, advantages; may drop groups
    step batch = the kept rounds, concatenated, cut to the global batch size

The `Producer` runs the same calls on stage threads around an `ExperienceDock`, overlapping
them; since every sample's result depends only on its own key, its step's weights and the
dispatch it was in, which are these, the two agree. `SequentialProducer` takes the Producer's
constructor arguments, so a Trainer runs on it when it replaces `rlbolt.trainer.Producer`; it
produces lazily, in the caller's thread: step s is made only when the Trainer asks for it, after
publishing the weights step s needs, in sync and async mode alike. One process only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from rlbolt.batch import Batch, check_stage
from rlbolt.module import RLModule, collect_logs
from rlbolt.producer.handoff import with_rewards
from rlbolt.producer.producer import ProducedStep, sample_keys


class SequentialProducer:
    """Each step's experience made in one thread, in the order of the data flow above.

    Args:
      module: the RLModule.
      plan: the BatchPlan (sizes, refill rounds).
      source: the PromptSource.
      weights: the WeightStore (which weights each step rolls out with).
      base_rng: the run's base key (`sample_keys`).
      max_steps: stop after this step (None: while prompts last).
      max_prompts: stop before a step that would take prompts past this many (None: no limit).
      **_ignored: the Producer's other arguments (threads, processes, timeline).
    """

    def __init__(self, module: RLModule, plan: Any, source: Any, weights: Any, base_rng: Any, *,
                 max_steps: int | None, max_prompts: int | None, **_ignored: Any) -> None:
        self.module, self.plan, self.source, self.weights = module, plan, source, weights
        self.base_rng, self.max_steps, self.max_prompts = base_rng, max_steps, max_prompts
        self.rewards = type(module).on_reward is not RLModule.on_reward  # a reward stage, as the Producer's

    @contextlib.contextmanager
    def start(self, start_step: int, start_position: int, **_ignored: Any) -> Iterator[Iterator[ProducedStep]]:
        """The Producer's entry point: yields the iterator of produced steps."""
        yield self.run(start_step, start_position, None)

    def run(self, start_step: int, start_position: int, stop_event: Any) -> Iterator[ProducedStep]:
        """Steps from `start_step`, prompts from `start_position`, until max_steps or max_prompts."""
        position, step = start_position, start_step
        while self.max_steps is None or step < self.max_steps:
            if self.max_prompts is not None and position + self.plan.prompts_per_step > self.max_prompts:
                return
            if stop_event is not None:
                params, version = self.weights.get(step, stop_event)
            else:
                params, version = self.weights.retained()[self.weights.key_for_step(step)]
            produced = self.produce_step(step, position, params, version)
            position = produced.data_position
            yield produced
            step += 1

    def produce_step(self, step: int, position: int, params: Any, version: int) -> ProducedStep:
        """One global step's batch, rolled out with `params` (policy version `version`)."""
        plan, want = self.plan, self.plan.global_batch_size
        kept, dropped = [], 0
        with collect_logs() as logged:
            for round_index in range(plan.max_refill_rounds + 1):
                missing = want - sum(b.num_samples for b in kept)
                prompts = -(-missing // plan.num_generations) if round_index else plan.prompts_per_step
                batch = Batch.from_rows(self.source.take(position, prompts)).repeat(plan.num_generations)
                n = batch.num_samples
                batch = batch.with_columns(
                    group_ids=batch["prompt_index"].astype(np.int32), policy_version=np.full((n,), version, np.int32),
                    sample_keys=np.asarray(sample_keys(self.base_rng, step, round_index, np.arange(n))))
                position += prompts
                batch = self._per_sample_stages(params, batch)
                advantaged = check_stage(self.module.on_advantage(batch), "advantage")
                dropped += batch.num_samples - advantaged.num_samples
                kept.append(advantaged)
                if sum(b.num_samples for b in kept) >= want:
                    break
        batch = Batch.concat(kept)
        if batch.num_samples < want:
            raise RuntimeError(f"step {step}: kept {batch.num_samples} of {want} samples")
        metrics = dict(logged)  # the Trainer adds the batch metrics (rlbolt.step_metrics), as for the Producer
        if plan.max_refill_rounds:
            metrics["refill/dropped_samples"] = float(dropped)
        return ProducedStep(step, batch.slice(0, want), position, self.weights.key_for_step(step), version, metrics)

    def _per_sample_stages(self, params: Any, batch: Batch) -> Batch:
        """rollout, logps (and reward) over each service batch, each in its micro batches."""
        plan, out = self.plan, []
        service = min(plan.service_batch_size, batch.num_samples)
        for piece in (batch.chunk(service) if batch.num_samples % service == 0 else [batch]):
            piece = check_stage(_in_chunks(lambda b: self.module.on_rollout(params, b), piece,
                                           plan.rollout_micro_batch_size), "rollout")
            piece = check_stage(_in_chunks(lambda b: self.module.compute_logps(params, b), piece,
                                           plan.logps_micro_batch_size), "logps")
            if self.rewards:
                piece = _in_chunks(lambda b: with_rewards(self.module.on_reward(b)), piece,
                                   plan.reward_micro_batch_size)
            out.append(piece)
        return Batch.concat(out)


def _in_chunks(fn: Callable[[Batch], Batch], batch: Batch, size: int) -> Batch:
    """`fn` over consecutive chunks of `size` samples (the whole batch when size does not divide it)."""
    if batch.num_samples % size:
        return fn(batch)
    return Batch.concat([fn(chunk) for chunk in batch.chunk(size)])
