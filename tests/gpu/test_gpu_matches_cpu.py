"""The `gpu` marker's tests: a GPU computes what the CPU computes, within the derived float32
tolerances (tests/float_tolerance.py): the decoder's logits, a GRPO step's loss and gradients,
and the native engine's samples against an independent CPU forward. Skipped where JAX sees no
GPU; run them with `python -m pytest -m gpu tests/gpu` (under a minute).

The products run at float32 precision (`jax.default_matmul_precision("float32")`): a GPU's
default lets XLA multiply float32 matrices in TF32 (a 10-bit mantissa), which the float32
tolerances do not cover; rlbolt's numbers are float32's.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from float_tolerance import EPS32, decoder_contractions, decoder_logps_tolerance, decoder_tolerance
from rlbolt.algorithms import aggregate_loss, clipped_surrogate, grpo_advantages
from rlbolt.models import Decoder, tiny_config
from rlbolt.rollout import NativeSampler, token_logps

pytestmark = pytest.mark.gpu
try:
    GPU = jax.devices("gpu")[0]
except RuntimeError:
    pytest.skip("no GPU visible to JAX", allow_module_level=True)
CPU = jax.devices("cpu")[0]
VOCAB, P, C = 64, 6, 10


@pytest.fixture(scope="module")
def model():
    config = tiny_config(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate_size=128)
    return Decoder(config, rngs=nnx.Rngs(0))


def _on(device, fn, *args):
    """`fn(*args)` jitted, with every argument placed on `device` (so it runs there), as NumPy."""
    with jax.default_matmul_precision("float32"):
        return jax.tree.map(np.asarray, jax.jit(fn)(*jax.device_put(args, device)))


def test_logits_on_the_gpu_match_the_cpu(model):
    graphdef, state = nnx.split(model)
    ids = np.random.default_rng(0).integers(0, VOCAB, (4, 16)).astype(np.int32)
    positions = np.broadcast_to(np.arange(16, dtype=np.int32), ids.shape)
    forward = lambda s, i, p: nnx.merge(graphdef, s)(i, p)[0]  # noqa: E731
    cpu, gpu = _on(CPU, forward, state, ids, positions), _on(GPU, forward, state, ids, positions)
    assert gpu.shape == (4, 16, VOCAB) and np.isfinite(gpu).all()
    np.testing.assert_allclose(gpu, cpu, rtol=0, atol=decoder_tolerance(cpu, model.config, 16))


def _grpo_batch():
    rng = np.random.default_rng(1)
    completion_mask = np.ones((8, C), bool)
    completion_mask[::3, 7:] = False  # some completions stopped early
    rewards = np.array([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.25], np.float32)
    return (rng.integers(2, VOCAB, (8, P)).astype(np.int32), np.ones((8, P), bool),
            rng.integers(2, VOCAB, (8, C)).astype(np.int32), completion_mask,
            np.asarray(grpo_advantages(rewards, np.repeat(np.arange(2), 4)), np.float32))


def test_the_grpo_step_on_the_gpu_matches_the_cpu(model):
    """GRPO's token-mean clipped surrogate and its gradients from one state and batch."""
    graphdef, state = nnx.split(model)
    prompt_ids, prompt_mask, completion_ids, completion_mask, advantages = _grpo_batch()
    logps = lambda s: token_logps(graphdef, s, prompt_ids, prompt_mask, completion_ids, completion_mask,  # noqa: E731
                                  chunk_size=None)
    cpu_logps = _on(CPU, logps, state)
    old_logps = (cpu_logps - 0.05 * np.random.default_rng(2).standard_normal(cpu_logps.shape)).astype(np.float32)

    def loss(s):
        per_token, _ = clipped_surrogate(logps(s), old_logps, advantages, completion_mask)
        return aggregate_loss(per_token, completion_mask, "token-mean", num_tokens_total=int(completion_mask.sum()),
                              num_samples_total=8)

    step = lambda s: jax.value_and_grad(loss)(s)  # noqa: E731
    (cpu_loss, cpu_grads), (gpu_loss, gpu_grads) = _on(CPU, step, state), _on(GPU, step, state)
    # The loss: each token's -A * ratio moves by at most max|A| * max ratio * expm1(the logps'
    # tolerance); the token mean adds its own summation rounding (n * eps * mean |term|).
    tol = decoder_logps_tolerance(model, P + C)
    ratio = np.exp(np.where(completion_mask, cpu_logps - old_logps, 0.0))
    terms = np.abs(advantages)[:, None] * ratio * completion_mask
    bound = np.abs(advantages).max() * ratio.max() * np.expm1(tol) + completion_mask.sum() * EPS32 * terms.mean()
    assert abs(float(gpu_loss) - float(cpu_loss)) <= bound, (float(gpu_loss), float(cpu_loss), bound)
    # The gradients: the backward runs through the same contractions as the forward, so each leaf
    # gets the forward's relative bound (eps times the contraction lengths, decoder_tolerance's
    # analysis) twice, the forward's error carried in and the backward's own, at its largest entry.
    relative = 2 * EPS32 * sum(decoder_contractions(model.config, P + C))
    for (path, g), (_, want) in zip(jax.tree_util.tree_leaves_with_path(gpu_grads),
                                    jax.tree_util.tree_leaves_with_path(cpu_grads), strict=True):
        np.testing.assert_allclose(g, want, rtol=0, atol=relative * float(np.abs(want).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_the_native_engine_generates_on_the_gpu(model):
    """Samples drawn on the GPU stop at their stop token, and their logps are those of an
    independent forward of the same tokens on the CPU."""
    assert jax.default_backend() == "gpu"  # the sampler's params and programs are on the GPU
    rows = [list(range(3 + i, 6 + i + i % 3)) for i in range(8)]  # 3 to 5 tokens, no stop id
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), len(rows))), np.uint32)
    stops = (1, 2)
    out = NativeSampler(model, max_new_tokens=C, temperature=1.0, prompt_buckets=(8,),
                        stop_token_ids=stops).generate(rows, keys)
    lengths = out.completion_mask.sum(1)
    for ids, n in zip(out.completion_ids, lengths):  # a row ends at its first stop id
        found = np.flatnonzero(np.isin(ids[:n], stops))
        assert (n == C and found.size == 0) or (found.size == 1 and found[0] == n - 1)
    graphdef, state = nnx.split(model)
    reference = _on(CPU, lambda s: token_logps(graphdef, s, out.prompt_ids, out.prompt_mask, out.completion_ids,
                                                out.completion_mask), state)
    tolerance = decoder_logps_tolerance(model, out.prompt_ids.shape[1] + C)
    np.testing.assert_allclose(np.where(out.completion_mask, out.logps, 0),
                               np.where(out.completion_mask, reference, 0), rtol=0, atol=tolerance)
