"""plan.packing: the update and the log-prob forwards over packed rows change nothing but the speed.

For the LM algorithms and every loss aggregation, the old/reference logps, the loss, every metric
and the gradients of the packed path equal the padded path's on the same batch (prompts of unequal
lengths, completions of unequal lengths, one of them empty; an episode's environment tokens masked
out of the loss but attended). The packed path is an independent evaluation of the same network:
other rows, other slots, other positions of the padding, so its agreement is float32 rounding.
Tolerances as tests/modules/test_prompt_sharing.py: logps to `decoder_logps_tolerance`, losses and
metrics to the network's relative bound times three (a gradient runs each product forward and twice
backward), gradients to that bound relative to their largest entry.
"""

import jax
import numpy as np
import pytest
from float_tolerance import decoder_logps_tolerance, decoder_tolerance
from module_helpers import G, module_config, prompt_batch
from rlbolt.modules import DAPO, GRPO, GSPO
from rlbolt.packing import PackingSpec, with_pack_columns
from rlbolt.plan import BatchPlan
from rlbolt.setup_context import SetupContext
from rlbolt.update import add_mini_batch_totals

ROWS = [{"question": "What is 12 plus 30?", "answer": "42"}, {"question": "7?", "answer": "7"}]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _module(cls, model, tokenizer, packing, **algorithm):
    config = module_config(cls.algorithm_name, **algorithm)
    module = cls(config, model=model, tokenizer=tokenizer)
    module.setup(SetupContext(BatchPlan(2, G, num_iterations=2, packing=packing)))  # old logps from a forward
    return module


def _rolled(module, params):
    rolled = module.on_rollout(params, prompt_batch(ROWS, seed=1))
    mask = np.asarray(rolled["completion_mask"]).copy()
    mask[3] = False  # an empty completion: no token to train, still a sample in every normaliser
    return rolled.with_columns(completion_mask=mask)


def _check(cls, model, tokenizer, episode=False, **algorithm):
    packed, padded = (_module(cls, model, tokenizer, mode, beta=0.04, entropy_coef=0.01, **algorithm)
                      for mode in ("on", "off"))
    params = padded.init_params(jax.random.key(0))
    rolled = _rolled(padded, params)
    seq = rolled["prompt_mask"].shape[1] + rolled["completion_mask"].shape[1]
    if episode:  # tokens 2..3 of every completion are the environment's: attended, never trained
        sequence = np.asarray(rolled["completion_mask"])
        trained = sequence.copy()
        trained[:, 2:4] = False
        rolled = rolled.with_columns(sequence_mask=sequence, completion_mask=trained)
    a, b = packed.compute_logps(params, rolled), padded.compute_logps(params, rolled)
    for column in ("old_logps", "ref_logps"):
        np.testing.assert_allclose(a[column], b[column], rtol=0, atol=decoder_logps_tolerance(model, seq), err_msg=column)
    assert np.abs(b["old_logps"]).max() > 1  # real log-probabilities, not zeros

    batch = add_mini_batch_totals(padded.on_advantage(b).numeric())
    batch = batch.with_columns(advantages=np.linspace(-1.0, 2.0, batch.num_samples).astype(np.float32))
    packed_batch = with_pack_columns(batch, batch.num_samples, PackingSpec())
    assert packed_batch["pack_rows"].shape[1] < batch.num_samples  # fewer rows than samples: really packed
    relative = decoder_tolerance(1.0, model.config, seq)
    backward = 3 * relative
    (l_p, m_p), g_p = jax.jit(jax.value_and_grad(packed.training_step, has_aux=True))(params, packed_batch)
    (l_u, m_u), g_u = jax.jit(jax.value_and_grad(padded.training_step, has_aux=True))(params, batch)
    assert abs(float(l_p) - float(l_u)) <= backward * max(1.0, abs(float(l_u))), (float(l_p), float(l_u))
    assert set(m_p) == set(m_u)
    for key in m_u:
        np.testing.assert_allclose(float(m_p[key]), float(m_u[key]), rtol=backward, atol=backward * 1e-2, err_msg=key)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(g_u))
    assert scale > 0
    for x, y in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_u)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=backward * scale)


@pytest.mark.slow
def test_packed_grpo_token_mean_episode_equals_padded(model, tokenizer):
    _check(GRPO, model, tokenizer, episode=True, loss_aggregation="token-mean")


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_packed_equals_padded_for_each_aggregation(aggregation, model, tokenizer):
    _check(GRPO, model, tokenizer, loss_aggregation=aggregation)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [DAPO, GSPO], ids=["dapo", "gspo"])
def test_packed_equals_padded_for_other_objectives(cls, model, tokenizer):
    _check(cls, model, tokenizer, **({"dynamic_sampling": False} if cls is DAPO else {}))
