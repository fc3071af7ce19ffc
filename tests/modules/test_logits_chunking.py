"""`model.logits_chunk_tokens` changes memory, not results: for every ready algorithm (and the
policy objectives CISPO, SAPO, GMPO, and on-policy distillation) the old / reference / teacher
logps (PPO: and values), the training loss, its metrics and its gradients equal those of the
unchunked forward (`logits_chunk_tokens: 0`), on ragged prompts and completions.

The chunk of 24 tokens over 8 rows is 3 positions of each row, which does not divide the 8
completion positions; 1 (one position per chunk, fewer tokens than rows) and 10,000 (more than
the batch holds: one chunk) are the hostile ends. Tolerances are float32 rounding: both paths
sum the same products, the chunked one in another order (logps 2e-5 on values of size ~5;
losses and gradients 1e-4 relative, gradients relative to their largest entry).
"""

import jax
import numpy as np
import pytest
from flax import nnx
from float_tolerance import decoder_logps_tolerance, decoder_tolerance
from module_helpers import G, TINY, module_config, prompt_batch, setup_context

from rlbolt.models import Decoder, tiny_config
from rlbolt.modules import DAPO, GRPO, GSPO, PPO, RLOO, DrGRPO, ReinforcePP
from rlbolt.update import add_mini_batch_totals

ROWS = [{"question": "What is 12 plus 30?", "answer": "42"}, {"question": "7?", "answer": "7"}]
ENTROPY = {"entropy_coef": 0.05}  # the entropy term's gradient goes through the fused backward too
ALGORITHMS = {
    "grpo": (GRPO, {"beta": 0.04, **ENTROPY}),
    "dapo": (DAPO, {"dynamic_sampling": False, "beta": 0.04}),
    "drgrpo": (DrGRPO, {"beta": 0.04}),
    "rloo": (RLOO, {"beta": 0.04}),
    "reinforcepp": (ReinforcePP, {"beta": 0.04}),
    "gspo": (GSPO, {"beta": 0.04}),
    "ppo": (PPO, {"beta": 0.04, **ENTROPY}),
    "grpo+cispo": (GRPO, {"policy_loss": "cispo"}),
    "grpo+sapo": (GRPO, {"policy_loss": "sapo", **ENTROPY}),
    "grpo+gmpo": (GRPO, {"policy_loss": "gmpo"}),
    "grpo+distillation": (GRPO, {"distill_kl_coef": 0.5}),
}
# The default tier covers each distinct path (the policy forward, PPO's trunk + value head, the
# teacher's forward) and both hostile ends; the other algorithms share those paths (slow tier).
# (PPO chunked at 24 is slow tier: ppo-10000 runs its trunk + value head through the same chunked function.)
DEFAULT_TIER = {("grpo", 24), ("grpo+distillation", 24), ("grpo", 1), ("ppo", 10_000)}
CASES = [pytest.param(name, chunk, marks=() if (name, chunk) in DEFAULT_TIER else pytest.mark.slow)
         for name, chunk in [(name, 24) for name in ALGORITHMS] + [("grpo", 1), ("grpo", 10_000), ("ppo", 1),
                                                                   ("ppo", 10_000)]]


@pytest.fixture(scope="module")
def teacher(tokenizer):
    return Decoder(tiny_config(vocab_size=tokenizer.vocab_size, **TINY), rngs=nnx.Rngs(7))


def _module(name, chunk, model, tokenizer, teacher):
    cls, algorithm = ALGORITHMS[name]
    config = module_config(cls.algorithm_name, **algorithm)
    config["model"] = {"logits_chunk_tokens": chunk}
    module = cls(config, model=model, tokenizer=tokenizer, teacher=teacher if "distillation" in name else None)
    module.setup(setup_context(num_iterations=2))  # old logps from a forward, not the sampler
    assert module.config.model.logits_chunk_tokens == chunk
    return module


def _ragged(batch):
    """Completions cut to lengths 1..C (a row of one token, a full row), so masks are ragged."""
    mask = np.asarray(batch["completion_mask"], bool).copy()
    c = mask.shape[1]
    for row, length in enumerate(np.resize([1, c, 3, 5, 2, 7, 4, 6], batch.num_samples)):
        mask[row, min(length, c):] = False
    return batch.with_columns(completion_mask=mask)


@pytest.mark.parametrize("name, chunk", CASES)
def test_chunked_logits_equal_the_unchunked_path(name, chunk, model, tokenizer, teacher):
    reference, chunked = (_module(name, c, model, tokenizer, teacher) for c in (0, chunk))
    params = reference.init_params(jax.random.key(0))
    rolled = _ragged(reference.on_rollout(params, prompt_batch(ROWS, seed=1)))
    lengths = rolled["completion_mask"].sum(1)
    assert lengths.min() == 1 and len(set(lengths.tolist())) > 3  # ragged, with a one-token row
    assert len(set(rolled["prompt_mask"].sum(1).tolist())) == 2  # prompts of two lengths

    a, b = chunked.compute_logps(params, rolled), reference.compute_logps(params, rolled)
    columns = [c for c in ("old_logps", "ref_logps", "teacher_logps", "old_values") if c in b]
    assert "old_logps" in columns and ("ref_logps" in columns or "beta" not in ALGORITHMS[name][1])
    seq = rolled["prompt_mask"].shape[1] + rolled["completion_mask"].shape[1]
    relative = decoder_tolerance(1.0, model.config, seq)  # the network's rounding, relative to its outputs
    backward = 3 * relative  # a gradient runs each product forward and twice backward
    for column in columns:  # the teacher is another tiny Decoder of the same shape
        tolerance = decoder_logps_tolerance(model if column != "teacher_logps" else teacher, seq)
        if column == "old_values":
            tolerance = relative * np.abs(b[column]).max()
        np.testing.assert_allclose(a[column], b[column], rtol=0, atol=tolerance, err_msg=column)
    assert np.abs(b["old_logps"]).max() > 1  # real log-probabilities, not zeros

    batch = reference.on_advantage(b).numeric()
    advantages = np.asarray(batch["advantages"])
    spread = np.linspace(-1.0, 2.0, advantages.size).reshape(advantages.shape).astype(np.float32)
    batch = add_mini_batch_totals(batch.with_columns(advantages=spread))

    (loss_c, metrics_c), grads_c = jax.jit(jax.value_and_grad(chunked.training_step, has_aux=True))(params, batch)
    (loss_r, metrics_r), grads_r = jax.jit(jax.value_and_grad(reference.training_step, has_aux=True))(params, batch)
    assert abs(float(loss_c) - float(loss_r)) <= backward * max(1.0, abs(float(loss_r))), (float(loss_c), float(loss_r))
    assert set(metrics_c) == set(metrics_r)
    for key in metrics_r:
        np.testing.assert_allclose(float(metrics_c[key]), float(metrics_r[key]), rtol=backward, atol=backward * 1e-2,
                                   err_msg=key)
    assert float(metrics_r["entropy"]) > 0.1  # the entropy really is computed (the tiny model is near uniform)
    leaves = jax.tree_util.tree_leaves_with_path(grads_r)
    assert max(float(np.abs(np.asarray(g)).max()) for _, g in leaves) > 1e-4  # a gradient to compare
    for (path, want), got in zip(leaves, jax.tree.leaves(grads_c)):
        want, got = np.asarray(want), np.asarray(got)
        np.testing.assert_allclose(got, want, rtol=0, atol=backward * np.abs(want).max() + 1e-12, err_msg=str(path))
