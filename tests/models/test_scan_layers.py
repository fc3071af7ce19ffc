"""Scanned layers (`model.scan_layers`, rlbolt.models.scan_layers): the scanned forward gives the
loop's logits and gradients, really runs as one scan, and falls back where it cannot.

Tolerance: `decoder_tolerance` (tests/float_tolerance.py): the scan compiles the same ops into
another fusion, so XLA may round differently (observed: up to 4e-7 on logits of ~5); gradients
take 3x that relative bound of their own magnitude (the backward's reductions mirror the forward's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlbolt.models import Decoder, tiny_config
from rlbolt.models.moe import record_routing, replay_routing
from rlbolt.models.scan_layers import scan_reason, stack_reason
from float_tolerance import decoder_tolerance

GEMMA3 = dict(architecture="Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh", norm_unit_offset=True,
              sandwich_norms=True, scale_embeddings=True, qk_norm=True, sliding_window=5, rope_local_theta=1000.0,
              layer_types=("sliding_attention", "full_attention", "sliding_attention"))


def _loss(model, scan: bool):
    """(loss of the summed log-probs of token 3 at real positions, and its logits; the model's params)."""
    model.scan_layers = scan
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jax.random.randint(jax.random.key(1), (2, 20), 0, model.config.vocab_size)
    mask = jnp.arange(20)[None] >= jnp.asarray([0, 6])[:, None]  # one left-padded row
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)

    def loss(p):
        logits = nnx.merge(graphdef, p)(ids, positions, attention_mask=mask)[0]
        return jnp.sum(jnp.where(mask, jax.nn.log_softmax(logits)[..., 3], 0.0)), logits

    return loss, params, mask


def _scans(loss, params) -> int:
    return str(jax.make_jaxpr(loss)(params)).count(" scan[")


def _run(model, scan: bool):
    loss, params, mask = _loss(model, scan)
    scans = _scans(loss, params)
    (value, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return scans, np.where(mask[..., None], logits, 0.0), grads


def _scan_equals_loop(model):
    """The scanned forward's logits and gradients against the loop's (the scan really ran); its gradients."""
    loop_scans, loop_logits, loop_grads = _run(model, False)
    scans, logits, grads = _run(model, True)
    assert (loop_scans, scans) == (0, 1)
    config = model.config
    np.testing.assert_allclose(logits, loop_logits, rtol=0, atol=decoder_tolerance(loop_logits, config, 20))
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(loop_grads)):
        np.testing.assert_allclose(g, ref, rtol=0, atol=3 * decoder_tolerance(np.asarray(ref), config, 20) + 1e-30)
    return grads


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow), "gemma3"])
def test_the_scanned_forward_equals_the_loop(family):
    """Gemma 3 carries its per-layer window and RoPE base through the scan as arrays. (llama is in the
    slow tier: tests/models/test_stacked_layers.py scans a llama's stored stack against the loop by default.)"""
    model = Decoder(tiny_config(num_layers=3, **(GEMMA3 if family == "gemma3" else {})), rngs=nnx.Rngs(0))
    grads = _scan_equals_loop(model)
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))


def test_a_scanned_gemma3_keeps_only_each_layers_input_for_the_backward():
    """Under full remat the forward scan hands the backward one stack: each layer's input [L, B, T, H].
    Its RoPE tables and mask are picked per kind of layer inside the layer's checkpoint
    (`scan_layers.ByKind`); picked outside, the checkpoint kept them as inputs and the scan stacked
    [L, B, T, D] cos and sin and an [L, B, T, T] mask beside it (at Gemma-3-12B and 32k tokens, 1.5 GiB
    per chip of tables). Its gradients still equal the loop's (the test above, and test_remat.py)."""
    model = Decoder(tiny_config(num_layers=3, **GEMMA3), rngs=nnx.Rngs(0))
    model.scan_layers, model.remat = True, "full"
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jax.random.randint(jax.random.key(1), (2, 20), 0, model.config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(20), (2, 20))
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(ids, positions, attention_mask=jnp.ones((2, 20), bool))[0])  # noqa: E731
    forward = next(e for e in jax.make_jaxpr(jax.grad(loss))(params).jaxpr.eqns if e.primitive.name == "scan")
    stacks = [tuple(v.aval.shape) for v in forward.outvars][1:]  # after the final carry
    assert stacks == [(3, 2, 20, model.config.hidden_size)]


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def test_layers_that_differ_keep_the_loop():
    moe = Decoder(tiny_config(**MOE, mlp_only_layers=(0,)), rngs=nnx.Rngs(0))
    assert "differ in structure" in scan_reason(moe)
    loss, params, _ = _loss(moe, True)  # the gradient traced (forward and backward), not compiled: its jaxpr says it
    assert _scans(jax.grad(lambda p: loss(p)[0]), params) == 0
    assert scan_reason(Decoder(tiny_config(), rngs=nnx.Rngs(0))) is None


def test_mixture_of_experts_layers_scan_unless_their_routing_is_recorded_or_replayed():
    """Every layer an MoE: the scanned forward gives the loop's logits and gradients (router and
    experts included); a run with a routing feature keeps the layers stored per layer (they set
    attributes on each layer's block), one without stores them stacked (tests/models/
    test_stacked_layers.py); a block that records or replays its routing sends the forward back to the loop."""
    model = Decoder(tiny_config(num_layers=3, **MOE), rngs=nnx.Rngs(0))
    assert scan_reason(model) is None and stack_reason(model, routing=[]) is None
    reason = stack_reason(model, routing=["model.router_aux_loss_coef", "algorithm.router_replay"])
    assert "(model.router_aux_loss_coef, algorithm.router_replay)" in reason and "per layer" in reason
    assert stack_reason(Decoder(tiny_config(), rngs=nnx.Rngs(0)), routing=["rollout.record_routing"]) is None  # dense
    grads = _scan_equals_loop(model)
    router = grads["layers"][1]["mlp"]["router_kernel"][...]
    assert np.any(np.asarray(router) != 0)  # the router trains through the scan too
    record_routing(model)
    assert "record or replay" in scan_reason(model)  # Decoder._forward scans only when it is None
    record_routing(model, False)
    replay_routing(model, [jnp.zeros((40, 2), jnp.int32)] * 3)
    assert "record or replay" in scan_reason(model)
    replay_routing(model, None)
    assert scan_reason(model) is None
