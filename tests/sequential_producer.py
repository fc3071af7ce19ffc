"""The reference the pipeline is held to: the single-threaded producer rlbolt had before the
ExperienceDock (one step at a time: prompts -> rollout micro chunks -> logps micro chunks per
service batch -> on_advantage on the whole round -> refills -> trim), kept verbatim in spirit
and simplified, so a fit through the dock can be compared with it bit for bit.

`SequentialProducer` takes the Producer's constructor arguments and is patched over
`rlbolt.trainer.Producer`; it runs in the main thread, lazily: the trainer asks for step s only
after publishing the weights step s needs, in sync and async mode alike.
"""

from __future__ import annotations

import contextlib

import numpy as np

import rlbolt.trainer
from rlbolt.batch import Batch, check_stage
from rlbolt.callback import Callback
from rlbolt.module import collect_logs
from rlbolt.producer import ProducedStep, sample_keys

TIMING_PREFIXES = ("time/", "throughput/")


class SequentialProducer:
    def __init__(self, module, plan, source, weights, base_rng, *, max_steps, max_prompts, **_ignored):
        self.module, self.plan, self.source, self.weights = module, plan, source, weights
        self.base_rng, self.max_steps, self.max_prompts = base_rng, max_steps, max_prompts

    @contextlib.contextmanager
    def start(self, start_step, start_position, **_ignored):
        yield self.run(start_step, start_position, None)

    def run(self, start_step, start_position, stop_event):
        position, step = start_position, start_step
        while self.max_steps is None or step < self.max_steps:
            if self.max_prompts is not None and position + self.plan.prompts_per_step > self.max_prompts:
                return
            params, version = self.weights.get(step, stop_event) if stop_event else self._weights_now(step)
            produced = self.produce_step(step, position, params, version)
            position = produced.data_position
            yield produced
            step += 1

    def _weights_now(self, step):
        return self.weights.retained()[self.weights.key_for_step(step)]

    def produce_step(self, step, position, params, version):
        plan, want = self.plan, self.plan.global_batch_size
        kept, dropped = [], 0
        with collect_logs() as logged:
            for round_index in range(plan.max_refill_rounds + 1):
                missing = want - sum(b.num_samples for b in kept)
                prompts = -(-missing // plan.num_generations) if round_index else plan.prompts_per_step
                rows = self.source.take(position, prompts)
                batch = Batch.from_rows(rows).repeat(plan.num_generations)
                n = batch.num_samples
                batch = batch.with_columns(
                    group_ids=batch["prompt_index"].astype(np.int32), policy_version=np.full((n,), version, np.int32),
                    sample_keys=np.asarray(sample_keys(self.base_rng, step, round_index, np.arange(n))))
                position += prompts
                batch = self._rollout_and_logps(params, batch)
                advantaged = check_stage(self.module.on_advantage(batch), "advantage")
                dropped += batch.num_samples - advantaged.num_samples
                kept.append(advantaged)
                if sum(b.num_samples for b in kept) >= want:
                    break
        batch = Batch.concat(kept)
        if batch.num_samples < want:
            raise RuntimeError(f"step {step}: kept {batch.num_samples} of {want} samples")
        batch = batch.slice(0, want)
        metrics = dict(logged)  # the Trainer adds the batch metrics (rlbolt.step_metrics), as for the producer
        if plan.max_refill_rounds:
            metrics["refill/dropped_samples"] = float(dropped)
        return ProducedStep(step, batch, position, self.weights.key_for_step(step), version, metrics)

    def _rollout_and_logps(self, params, batch):
        plan, out = self.plan, []
        service = min(plan.service_batch_size, batch.num_samples)
        pieces = batch.chunk(service) if batch.num_samples % service == 0 else [batch]
        for piece in pieces:
            rolled = _map_chunks(lambda b: self.module.on_rollout(params, b), piece, plan.rollout_micro_batch_size)
            check_stage(rolled, "rollout")
            out.append(check_stage(_map_chunks(lambda b: self.module.compute_logps(params, b), rolled,
                                               plan.logps_micro_batch_size), "logps"))
        return Batch.concat(out)


def _map_chunks(fn, batch, size):
    if batch.num_samples % size:
        return fn(batch)
    return Batch.concat([fn(chunk) for chunk in batch.chunk(size)])


class _Capture(Callback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, trainer, info):
        self.steps.append((dict(info.metrics), info.batch))


def fit_both(make_trainer, make_module, rows, monkeypatch):
    """Fits once through the pipeline and once through this reference; returns both
    (state, [(metrics, batch) per step]) pairs. `make_trainer(callbacks)` builds a Trainer."""
    out = []
    for reference in (False, True):
        if reference:
            monkeypatch.setattr(rlbolt.trainer, "Producer", SequentialProducer)
        capture = _Capture()
        state = make_trainer([capture]).fit(make_module(), rows)
        out.append((state, capture.steps))
    monkeypatch.undo()
    return out


def assert_same_fit(run, reference, param_leaves):
    """Every trained batch, every metric outside time/ and throughput/, and the final params
    (`param_leaves(state)` -> list of arrays) equal, bit for bit."""
    (state, steps), (ref_state, ref_steps) = run, reference
    assert len(steps) == len(ref_steps) > 0
    for s, ((metrics, batch), (ref_metrics, ref_batch)) in enumerate(zip(steps, ref_steps)):
        keys = {k for k in metrics if not k.startswith(TIMING_PREFIXES)}
        assert keys == {k for k in ref_metrics if not k.startswith(TIMING_PREFIXES)}, f"step {s}: metric names"
        for k in keys:
            assert metrics[k] == ref_metrics[k], f"step {s}: {k} = {metrics[k]!r}, reference {ref_metrics[k]!r}"
        assert sorted(batch) == sorted(ref_batch)
        for col in batch:
            a, b = np.asarray(batch[col]), np.asarray(ref_batch[col])
            assert a.dtype == b.dtype and a.shape == b.shape, f"step {s}: column {col}"
            assert (a == b).all(), f"step {s}: column {col} differs"
    for a, b in zip(param_leaves(state), param_leaves(ref_state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), "final params differ"
    assert (state.step, state.policy_version, state.data_position) == (
        ref_state.step, ref_state.policy_version, ref_state.data_position)
