"""Router replay for mixture-of-experts models: the sampler records the experts of every token it
runs, and the training forward forced with them routes every real token exactly as the rollout did,
also after the routers moved (where, without replay, routing differs). Layouts checked for the
unshared forward and the prompt-shared one (groups of two), with decode segments and compaction."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from float_tolerance import EPS32, decoder_logps_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.moe import pop_routing, record_routing, replay_routing, routing_mismatch
from rlbolt.models.shared_prefix import grouped_completion_hidden
from rlbolt.rollout import NativeSampler, left_pad_positions, token_logps
from rlbolt.models.logps import forward_routing
from rollout_jit import token_logps as jitted_token_logps


def _model():
    config = tiny_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                         qk_norm=True, architecture="Qwen3MoeForCausalLM", num_layers=3, mlp_only_layers=(1,))
    model = Decoder(config, rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: 6 * x if x.ndim >= 2 else x, nnx.state(model, nnx.Param)))
    return model


def _moved(model, scale=0.3):
    """A copy of the model after an 'update': its routers perturbed."""
    graphdef, state = nnx.split(nnx.clone(model))
    keys = iter(jax.random.split(jax.random.key(1), 8))
    for i in (0, 2):
        kernel = state["layers"][i]["mlp"]["router_kernel"]
        kernel.set_value(kernel.get_value() + scale * jax.random.normal(next(keys), kernel.get_value().shape))
    return nnx.merge(graphdef, state)


def _forward_routing_of(model, out, group, replay):
    """The experts the training forward (unshared for group 1, else prompt-shared) routes each token to."""
    model = nnx.clone(model)
    record_routing(model)
    replay_routing(model, replay)
    args = [jnp.asarray(x) for x in (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)]
    if group == 1:
        ids, mask = jnp.concatenate([args[0], args[2]], 1), jnp.concatenate([args[1], args[3]], 1)
        model(ids, left_pad_positions(mask), attention_mask=mask)
    else:
        grouped_completion_hidden(model, *args, group)
    return jnp.stack(pop_routing(model)[0])  # [L, N, k]


def _real(out, group):
    """[N] bool: the tokens whose routing matters (real prompt tokens and fed completion tokens)."""
    mask = np.asarray(out.completion_mask)
    # A row's last token (the stop token, or token C - 1) is never fed back: it predicts nothing.
    fed = mask & np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], 1)
    if group == 1:
        return jnp.asarray(np.concatenate([out.prompt_mask, fed], 1).reshape(-1))
    return jnp.asarray(np.concatenate([np.asarray(out.prompt_mask)[::group].reshape(-1), fed[:, :-1].reshape(-1)]))


# Slow tier (~19 s with its compiles): the default tier keeps replay at the model level
# (tests/models/test_moe.py) and the routing's aux loss and mismatch metric (below).
@pytest.mark.slow
@pytest.mark.parametrize("stop", [False, True])
def test_training_forward_replays_the_rollout_routing(stop):
    model = _model()
    rng = np.random.default_rng(3)
    a, b = (rng.integers(1, 256, n).tolist() for n in (5, 11))
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 4))
    sampler = NativeSampler(model, max_new_tokens=12, temperature=1.0, decode_segment=4, record_routing=True,
                            stop_token_ids=tuple(range(0, 256, 5)) if stop else ())
    out = sampler.generate([a, a, b, b], keys)
    assert sampler.last_group_size == 2
    prompt_routing, completion_routing = sampler.last_routing
    assert prompt_routing.shape == (4, out.prompt_ids.shape[1], 2, 2)
    assert completion_routing.shape == (4, 12, 2, 2)
    if stop:  # some rows stopped early: later segments ran compacted
        assert np.asarray(out.completion_mask).sum(1).min() < 8

    moved = _moved(model)
    for group in (1, 2):
        recorded = jnp.stack(forward_routing(sampler.last_routing, group))  # [L, N, k]
        real = _real(out, group)
        # Same weights: the training forward routes as the rollout did (the layouts line up).
        assert float(routing_mismatch(recorded, _forward_routing_of(model, out, group, None), real)) == 0.0
        # Moved routers: routing differs without replay, and equals the rollout's with it.
        assert float(routing_mismatch(recorded, _forward_routing_of(moved, out, group, None), real)) > 0.02
        replayed = _forward_routing_of(moved, out, group, forward_routing(sampler.last_routing, group))
        assert float(routing_mismatch(recorded, replayed, real)) == 0.0

    # With the rollout's weights, replayed logps are the sampler's (which sampled at temperature 1).
    graphdef, params = nnx.split(model)
    for group in (1, 2):
        logps = token_logps(graphdef, params, out.prompt_ids, out.prompt_mask, out.completion_ids,
                            out.completion_mask, group_size=group, routing=sampler.last_routing)
        tolerance = decoder_logps_tolerance(model, out.prompt_ids.shape[1] + out.completion_ids.shape[1])
        np.testing.assert_allclose(np.asarray(logps), np.asarray(out.logps), rtol=0, atol=tolerance)


def test_record_routing_needs_experts():
    with pytest.raises(ValueError, match="num_experts"):
        NativeSampler(Decoder(tiny_config(), rngs=nnx.Rngs(0)), max_new_tokens=4, record_routing=True)


def test_token_logps_and_routing_feed_the_aux_loss_and_the_mismatch_metric():
    from rlbolt.models.moe import load_balancing_loss
    from rlbolt.models.logps import token_logps_and_routing

    model = _model()
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 2))
    sampler = NativeSampler(model, max_new_tokens=6, temperature=1.0, record_routing=True)
    out = sampler.generate([[3, 4, 5], [7, 8, 9, 10]], keys)
    graphdef, params = nnx.split(_moved(model))
    args = (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
    for routing in (None, sampler.last_routing):
        logps, experts, probs = jax.jit(lambda p, r: token_logps_and_routing(graphdef, p, *args, routing=r))(
            params, routing)
        tolerance = decoder_logps_tolerance(model, args[0].shape[1] + args[2].shape[1])  # lm_head as _moved's
        plain = jitted_token_logps(graphdef, params, *args, routing=routing)
        np.testing.assert_allclose(np.asarray(logps), np.asarray(plain),
                                   rtol=0, atol=tolerance)  # the same forward, with the routing as extra outputs
        assert len(experts) == len(probs) == 2 and probs[0].shape == (2 * (out.prompt_ids.shape[1] + 6), 4)
        real = _real(out, 1)
        mismatch = float(routing_mismatch(jnp.stack(forward_routing(sampler.last_routing, 1)), jnp.stack(experts),
                                          real))
        assert (mismatch == 0.0) if routing is not None else (mismatch > 0.02)
        # The aux loss on these records, against float64 NumPy of E * sum_e f_e * P_e over real tokens.
        w = np.asarray(real, np.float64)
        counts = sum(np.bincount(np.asarray(e).reshape(-1), weights=np.repeat(w, 2), minlength=4) for e in experts)
        prob_sum = sum((np.asarray(p, np.float64) * w[:, None]).sum(0) for p in probs)
        rows = 2 * w.sum()
        want = 4 * np.sum(counts / rows * prob_sum / rows)
        # float32 against float64: sums of <= 2 * 24 real tokens' probabilities (each <= 1) per layer, 2 layers
        assert float(load_balancing_loss(probs, experts, real)) == pytest.approx(want, rel=2 * 48 * EPS32 * 4)
