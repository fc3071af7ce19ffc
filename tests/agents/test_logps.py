"""A multi-turn sample's sampler logps equal the training forward's, batching does not change an
episode, and environment ids never reach the loss (a real NativeSampler on a tiny model)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlbolt.agents import run_episodes
from rlbolt.demo.agent_tasks import demo_tokenizer, guess_env, guess_rows
from rlbolt.algorithms import aggregate_loss, clipped_surrogate
from rlbolt.models import Decoder, tiny_config
from rlbolt.rollout import NativeSampler
from rollout_jit import token_logps

from float_tolerance import decoder_logps_tolerance

LIMITS = dict(max_turns=4, max_turn_tokens=3, max_total_tokens=20)


def _logp_tolerance(model) -> float:
    # Sampler (prefill + cached decode) and training forward (one pass) differ only by float32
    # rounding: derived from the model over its longest sequence (tests/float_tolerance.py).
    return decoder_logps_tolerance(model, model.config.max_position_embeddings)


@pytest.fixture(scope="module")
def setup():
    tok = demo_tokenizer()
    config = tiny_config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=32)
    model = Decoder(config, rngs=nnx.Rngs(3))
    sampler = NativeSampler(model, max_new_tokens=LIMITS["max_turn_tokens"], stop_token_ids=(tok.eos_id,),
                            pad_id=tok.pad_id, prompt_buckets=(8, 16, 24))
    rows = guess_rows(6, seed=1)
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), len(rows))), np.uint32)
    out = run_episodes(sampler, [guess_env(r) for r in rows], keys, tokenizer=tok, **LIMITS)
    return tok, model, sampler, rows, keys, out


def test_the_episodes_are_multi_turn_with_environment_holes(setup):
    _, _, _, _, _, out = setup
    env = out.sequence_mask & ~out.completion_mask
    assert (out.turns >= 2).sum() >= 3 and env.any(axis=1).sum() >= 3
    # holes: some row has a sampled id after an environment id
    assert any(np.flatnonzero(e).min() < np.flatnonzero(m).max() for e, m in zip(env, out.completion_mask) if e.any())


def test_sampler_logps_equal_the_training_forward_on_the_assembled_sequence(setup):
    tok, model, _, _, _, out = setup
    prompt_ids, prompt_mask = out.padded_prompts(tok.pad_id)
    graphdef, params = nnx.split(model)
    logps = np.asarray(token_logps(graphdef, params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask),
                                   jnp.asarray(out.completion_ids), jnp.asarray(out.sequence_mask), temperature=1.0))
    mask = out.completion_mask
    assert mask.sum() > 20
    tol = _logp_tolerance(model)
    np.testing.assert_allclose(logps[mask], out.sampler_logps[mask], atol=tol, rtol=0)
    assert (out.sampler_logps[~mask] == 0).all()
    # The same forward with the loss mask as its attention mask (environment ids left out) is wrong:
    # the model would read a different context. This is why the batch carries sequence_mask.
    wrong = np.asarray(token_logps(graphdef, params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask),
                                   jnp.asarray(out.completion_ids), jnp.asarray(mask), temperature=1.0))
    assert np.abs(wrong[mask] - out.sampler_logps[mask]).max() > 16 * tol


def test_an_episode_does_not_depend_on_which_episodes_share_its_batch(setup):
    tok, model, sampler, rows, keys, out = setup
    for i in (0, 4):
        alone = run_episodes(sampler, [guess_env(rows[i])], keys[i:i + 1], tokenizer=tok, **LIMITS)
        np.testing.assert_array_equal(alone.completion_ids[0], out.completion_ids[i])
        np.testing.assert_array_equal(alone.completion_mask[0], out.completion_mask[i])
        np.testing.assert_allclose(alone.sampler_logps[0], out.sampler_logps[i], atol=_logp_tolerance(model))
        assert alone.end_reason[0] == out.end_reason[i] and alone.env_reward[0] == out.env_reward[i]


def _loss(logps, old, advantages, mask):
    per_token, _ = clipped_surrogate(logps, old, advantages, mask, clip_low=0.2, clip_high=0.2)
    return aggregate_loss(per_token, mask, "token-mean", num_tokens_total=mask.sum(), num_samples_total=mask.shape[0])


def test_environment_ids_change_neither_the_loss_nor_its_gradient(setup):
    tok, model, _, _, _, out = setup
    mask = jnp.asarray(out.completion_mask)
    env = out.sequence_mask & ~out.completion_mask
    old = jnp.asarray(out.sampler_logps)
    advantages = jnp.linspace(-1.0, 1.0, out.num_episodes)
    prompt_ids, prompt_mask = out.padded_prompts(tok.pad_id)
    graphdef, params = nnx.split(model)
    logps = token_logps(graphdef, params, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask),
                        jnp.asarray(out.completion_ids), jnp.asarray(out.sequence_mask), temperature=1.0)
    logps = logps + 0.05 * jnp.asarray(out.completion_mask)  # a policy that moved a little
    noise = jnp.where(jnp.asarray(env), 7.0 * jax.random.normal(jax.random.key(1), logps.shape), 0.0)
    loss_and_grad = jax.jit(jax.value_and_grad(_loss))  # one program for both calls
    loss, grad = loss_and_grad(logps, old, advantages, mask)
    loss_p, grad_p = loss_and_grad(logps + noise, old - noise, advantages, mask)
    assert float(loss) != 0.0
    assert float(loss_p) == float(loss)
    np.testing.assert_array_equal(np.asarray(grad_p), np.asarray(grad))
    assert (np.asarray(grad)[env] == 0).all() and np.abs(np.asarray(grad)[out.completion_mask]).max() > 0
