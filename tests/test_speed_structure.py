"""Structural properties the GRPO step's speed relies on (benchmarks/grpo_step.py measures the speed).

- With num_iterations == 1 the old logps come from the sampler: no policy logps forward on the
  producer; with beta > 0 only the frozen reference's forward runs.
- Steps whose prompt lengths and completion lengths vary reuse every executable: no backend
  compilation after the first (warm-up) step.
- The logps forward and the training step never hold a [B, T, V] float32 array: their compiled
  temporary memory stays under that size (the vocabulary projection is chunked).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlbolt.callback import Callback
from rlbolt.data.tokenizers import IntTokenizer
from rlbolt.models import Decoder, tiny_config
from rlbolt.modules import GRPO
from rlbolt.plan import BatchPlan
from rlbolt.setup_context import SetupContext
from rlbolt.models.logps import sequence_logps
from rlbolt.trainer import Trainer
from rlbolt.update import add_mini_batch_totals

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
PROMPTS, G = 2, 2


def _module(vocab: int, beta: float, new_tokens: int, stop_at_eos: bool, prompt_tokens: int = 16):
    config = {"algorithm": {"beta": beta, "lr": 1e-3},
              "rollout": {"max_new_tokens": new_tokens, "temperature": 1.0, "stop_at_eos": stop_at_eos},
              "data": {"prompt_field": "prompt", "max_prompt_tokens": prompt_tokens, "use_chat_template": False}}
    model = Decoder(tiny_config(vocab_size=vocab, **TINY), rngs=nnx.Rngs(0))
    return CountingGRPO(config, model=model, tokenizer=IntTokenizer(vocab), reward=_even_fraction)


def _even_fraction(completion: str, sample) -> float:
    ids = completion.split()
    return sum(int(t) % 2 == 0 for t in ids) / max(len(ids), 1)


def _rows(count: int, vocab: int, lengths: tuple[int, ...], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt": " ".join(map(str, rng.integers(2, vocab, lengths[i % len(lengths)])))} for i in range(count)]


class CountingGRPO(GRPO):
    """GRPO that records each call of its jitted logps forwards: False for the policy's, True for
    the reference scorer's (the same jitted function, called with the reference params)."""

    def setup(self, context):
        super().setup(context)
        self.logps_calls: list[bool] = []
        self.policy.logps = self._counted(self.policy.logps, False)
        if "ref" in self.scorers:
            self.scorers["ref"].forward = self._counted(self.scorers["ref"].forward, True)

    def _counted(self, forward, is_reference: bool):
        def counted(params, *inputs, **options):  # options: group_size (the prompt once per group)
            self.logps_calls.append(is_reference and params is self.ref_params)
            return forward(params, *inputs, **options)

        return counted


class RecordSteps(Callback):
    def __init__(self, compiles: list):
        self.compiles, self.compiles_at_step_end, self.completion_lengths = compiles, [], []

    def on_step_end(self, trainer, info):
        self.compiles_at_step_end.append(len(self.compiles))
        self.completion_lengths.append(np.asarray(info.batch["completion_mask"]).sum(axis=1))


def _fit(module, rows, steps: int, callbacks=()):
    trainer = Trainer(BatchPlan(prompts_per_step=PROMPTS, num_generations=G), max_steps=steps, seed=0,
                      shuffle=False, callbacks=callbacks)
    return trainer.fit(module, rows)


VARYING_STEPS = 4


@pytest.fixture(scope="module")
def varying_lengths_fit():
    """A beta > 0 fit whose prompt and completion lengths vary, with every backend compile counted: the
    recompilation test's run, and the one-iteration test's beta > 0 case (one fit, not two)."""
    vocab = 8  # a tiny vocabulary makes EOS (id 1) frequent: completion lengths vary
    compiles: list[int] = []

    def on_event(event, *args, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(1)

    jax.monitoring.register_event_duration_secs_listener(on_event)
    record = RecordSteps(compiles)
    try:
        module = _module(vocab, beta=0.04, new_tokens=12, stop_at_eos=True)
        _fit(module, _rows(VARYING_STEPS * PROMPTS, vocab, (5, 9, 13, 16)), steps=VARYING_STEPS, callbacks=[record])
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    return module, record


def test_no_policy_logps_forward_when_one_iteration_without_reference(varying_lengths_fit):
    # The counted fit runs first (the fixture): this fit's shapes then reuse its compiled sampler, and
    # cannot hide a recompilation from it.
    vocab = 8
    module = _module(vocab, 0.0, new_tokens=12, stop_at_eos=True)
    _fit(module, _rows(2 * PROMPTS, vocab, (5, 9, 13, 16)), steps=2)
    assert module.logps_calls == []  # beta = 0: no forward at all on the producer


def test_no_policy_logps_forward_when_one_iteration_with_reference(varying_lengths_fit):
    module, _ = varying_lengths_fit
    # One logps micro batch per step (logps_micro_batch_size defaults to the global batch): the reference's.
    assert module.logps_calls == [True] * VARYING_STEPS


def test_no_recompilation_when_prompt_and_completion_lengths_vary(varying_lengths_fit):
    _, record = varying_lengths_fit
    lengths = np.stack(record.completion_lengths)  # [steps, N]
    assert len(np.unique(lengths)) > 1, "the workload must vary completion lengths for this test to mean anything"
    # Step 1 compiles everything once; steps 2..4 must reuse it.
    assert record.compiles_at_step_end[-1] - record.compiles_at_step_end[0] == 0


def test_logps_and_training_step_memory_stay_under_full_logits():
    # A large vocabulary against a tiny trunk, so [B, T, V] is what would dominate: the chunked
    # projection keeps one or two blocks of model.logits_chunk_tokens x V instead (4 x 1,032 tokens:
    # [B, T, V] is 1.08 GB, two blocks of the default 1,024 tokens 0.54 GB).
    vocab, batch, prompt_len, new_tokens = 65536, 4, 8, 1024
    module = _module(vocab, beta=0.04, new_tokens=new_tokens, stop_at_eos=False, prompt_tokens=prompt_len)
    module.setup(SetupContext(BatchPlan(2, 2)))
    params = nnx.state(module.model, nnx.Param)
    shapes = {
        "prompt_ids": ((batch, prompt_len), jnp.int32), "prompt_mask": ((batch, prompt_len), bool),
        "completion_ids": ((batch, new_tokens), jnp.int32), "completion_mask": ((batch, new_tokens), bool),
        "old_logps": ((batch, new_tokens), jnp.float32), "ref_logps": ((batch, new_tokens), jnp.float32),
        "advantages": ((batch,), jnp.float32),
    }
    columns = {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in shapes.items()}
    full_logits_bytes = batch * (prompt_len + new_tokens) * vocab * 4  # [B, T, V] float32

    logps_fn = jax.jit(lambda p, *inputs, with_entropy: sequence_logps(module.graphdef, p, *inputs, with_entropy=with_entropy,
                                                                        temperature=1.0), static_argnames="with_entropy")
    inputs = [columns[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    logps_temp = logps_fn.lower(params, *inputs, with_entropy=False).compile().memory_analysis().temp_size_in_bytes

    from rlbolt.batch import Batch

    def loss(p, cols):
        return module.training_step(p, add_mini_batch_totals(Batch(cols)))[0]

    grad_temp = jax.jit(jax.grad(loss)).lower(params, columns).compile().memory_analysis().temp_size_in_bytes
    assert 0 < logps_temp < full_logits_bytes, f"logps temp {logps_temp} B >= [B, T, V] f32 {full_logits_bytes} B"
    assert 0 < grad_temp < full_logits_bytes, f"training-step temp {grad_temp} B >= [B, T, V] f32 {full_logits_bytes} B"
