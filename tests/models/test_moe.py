"""Qwen3-MoE pieces against independent references: the grouped (ragged) expert computation vs a
dense float64 NumPy loop over all experts, the load-balancing loss vs transformers' own function and
a hand case, the routing-mismatch metric by hand, and router replay in a real Decoder forward.
Logits, generation, bf16 loading and export vs transformers run in test_hf_* (the qwen3_moe families)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from float_tolerance import EPS32, decoder_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.moe import (dense_reference, grouped_experts, moe_layers, pop_routing, record_routing,
                               replay_routing, route, routing_mismatch, load_balancing_loss)


@functools.partial(jax.jit, static_argnums=(4, 5))
def _route_and_group(x, router, gate_up, down, top_k, norm):
    """route + grouped_experts as one compiled program (eagerly, each primitive of each shape compiles)."""
    weights, experts, probs = route(jnp.dot(x, router), top_k, norm)
    return grouped_experts(x, experts, weights, gate_up, down), experts, probs


@pytest.mark.parametrize("top_k, norm, n", [(1, False, 37), (2, True, 37), (3, False, 1), (5, True, 8)])
def test_grouped_experts_equal_a_dense_float64_loop(top_k, norm, n):
    rng = np.random.default_rng(top_k)
    h, e, i = 16, 5, 12
    x = rng.normal(size=(n, h)).astype(np.float32)
    router = rng.normal(size=(h, e)).astype(np.float32)
    x[:, -1] = 1.0  # a constant feature whose router row biases expert 4 away: never chosen for k < 5
    router[-1] = 0.0
    router[-1, 4] = -50.0
    gate_up = (0.3 * rng.normal(size=(e, h, 2 * i))).astype(np.float32)
    down = (0.3 * rng.normal(size=(e, i, h))).astype(np.float32)
    got, experts, probs = _route_and_group(jnp.asarray(x), jnp.asarray(router), jnp.asarray(gate_up),
                                           jnp.asarray(down), top_k, norm)
    want, want_experts = dense_reference(x, router, gate_up, down, top_k, norm)
    np.testing.assert_array_equal(np.sort(np.asarray(experts), -1), np.sort(want_experts, -1))
    # float32 against float64: two products (h, then i terms) and a k-term sum; worst case K * eps of |x||w|
    scale = np.abs(x).max() * np.abs(gate_up).max() * h * np.abs(down).max() * i
    np.testing.assert_allclose(np.asarray(got), want, atol=(h + i + top_k) * EPS32 * scale, rtol=0)
    assert np.asarray(probs).shape == (n, e)


def test_grouped_experts_gradients_equal_the_dense_form():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(9, 8)), jnp.float32)
    gate_up = jnp.asarray(0.3 * rng.normal(size=(3, 8, 10)), jnp.float32)
    down = jnp.asarray(0.3 * rng.normal(size=(3, 5, 8)), jnp.float32)
    experts = jnp.asarray(rng.integers(0, 3, (9, 2)), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(9, 2)), jnp.float32)

    def dense(x, gate_up, down):
        out = jnp.zeros_like(x)
        for j in range(2):
            g, u = jnp.split(jnp.einsum("nh,nhf->nf", x, gate_up[experts[:, j]]), 2, -1)
            out += weights[:, j:j + 1] * jnp.einsum("nf,nfh->nh", jax.nn.silu(g) * u, down[experts[:, j]])
        return out

    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    grouped = lambda x, gu, d: grouped_experts(x, experts, weights, gu, d)  # noqa: E731
    grads = (jax.jit(jax.grad(loss(grouped), (0, 1, 2)))(x, gate_up, down),
             jax.jit(jax.grad(loss(dense), (0, 1, 2)))(x, gate_up, down))
    for got, want in zip(*grads):
        # two float32 programs (grouped against dense): products of <= 10 terms, ~4 deep, relative to the gradient
        want = np.asarray(want)
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=4 * 10 * EPS32 * np.abs(want).max() * 10)


@pytest.mark.parametrize("top_k", [1, 2])
def test_load_balancing_loss_equals_transformers(top_k):
    rng = np.random.default_rng(top_k)
    logits = [rng.normal(size=(2 * 7, 6)).astype(np.float32) for _ in range(3)]  # 3 layers, B=2, T=7, E=6
    mask = np.ones((2, 7), bool)
    mask[1, :3] = False
    routed = [route(jnp.asarray(lg), top_k, False) for lg in logits]
    ours = load_balancing_loss([r[2] for r in routed], [r[1] for r in routed], jnp.asarray(mask.reshape(-1)))
    theirs = load_balancing_loss_func(tuple(torch.from_numpy(lg) for lg in logits), 6, top_k,
                                      torch.from_numpy(mask.astype(np.int64)))
    # float32 torch against float32 rlbolt: means of <= 42 probabilities (each <= 1) over 3 layers, times E
    np.testing.assert_allclose(float(ours), float(theirs), rtol=0, atol=3 * 42 * 6 * EPS32 * top_k)


def test_load_balancing_loss_hand_cases():
    # Uniform probabilities, each expert chosen equally often: E * sum_e (k/E) * (1/E) = k.
    probs = jnp.full((4, 4), 0.25)
    experts = jnp.asarray([[0, 1], [2, 3], [1, 0], [3, 2]])
    assert float(load_balancing_loss([probs], [experts])) == pytest.approx(2.0)  # sums of quarters and halves: exact in float32
    # Collapse onto expert 0 with probability 1: E * 1 * 1 = E (masked rows do not count).
    probs = jnp.asarray([[1.0, 0, 0], [1.0, 0, 0], [0, 0, 1.0]])
    experts = jnp.asarray([[0], [0], [2]])
    assert float(load_balancing_loss([probs], [experts], jnp.asarray([True, True, False]))) == pytest.approx(3.0)  # integer-valued: exact


def test_routing_mismatch_by_hand():
    recorded = jnp.asarray([[0, 1], [2, 3], [1, 2], [0, 3]])
    recomputed = jnp.asarray([[1, 0], [2, 1], [1, 2], [3, 1]])  # same set, differs, same, differs
    assert float(routing_mismatch(recorded, recomputed)) == pytest.approx(0.5)  # 2 of 4: exact in float32
    assert float(routing_mismatch(recorded, recomputed, jnp.asarray([True, False, True, False]))) == 0.0
    assert float(routing_mismatch(recorded, recomputed, jnp.zeros(4, bool))) == 0.0  # nothing real: 0, not NaN


def _moe_config(**overrides):
    fields = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, qk_norm=True,
                  architecture="Qwen3MoeForCausalLM", num_layers=3, mlp_only_layers=(1,))
    fields.update(overrides)
    return tiny_config(**fields)


def _logits(model, ids):
    positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    return model(ids, positions)[0]


@functools.partial(jax.jit, static_argnums=0)
def _jit_routed(graphdef, state, ids, replay):
    """One compiled forward (eagerly, every primitive compiles on its own) that records its routing,
    replaying `replay` (a list per MoE layer, or None): (logits, recorded experts per MoE layer)."""
    model = nnx.merge(graphdef, state)
    record_routing(model)
    replay_routing(model, replay)
    logits = _logits(model, ids)
    return logits, pop_routing(model)[0]


def _forward(model, ids, replay=None):
    return _jit_routed(*nnx.split(model), ids, replay)


@pytest.fixture(scope="module")
def moe_model():
    """The MoE Decoder the tests share; none mutates it (replay and recording happen on merged copies)."""
    return Decoder(_moe_config(), rngs=nnx.Rngs(0))


def test_router_replay_forces_the_recorded_routing_and_keeps_router_gradients(moe_model):
    model = moe_model
    assert len(moe_layers(model)) == 2  # layers 0 and 2; layer 1 is dense
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (3, 11)), jnp.int32)
    before, recorded = _forward(model, ids)
    assert [r.shape for r in recorded] == [(33, 2), (33, 2)]

    # The "training" model: routers moved, as after an update; without replay the routing drifts.
    graphdef, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.key(1), 8))
    state = jax.tree.map(lambda x: x, state)
    for block_path in ("0", "2"):
        kernel = state["layers"][int(block_path)]["mlp"]["router_kernel"]
        kernel.set_value(kernel.get_value() + 0.05 * jax.random.normal(next(keys), kernel.get_value().shape))
    moved = nnx.merge(graphdef, state)
    _, drifted = _forward(moved, ids)
    assert float(routing_mismatch(jnp.stack(recorded), jnp.stack(drifted))) > 0.05

    _, replayed = _forward(moved, ids, recorded)
    for got, want in zip(replayed, recorded):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(routing_mismatch(jnp.stack(recorded), jnp.stack(replayed))) == 0.0

    # Replaying a model's own routing changes nothing; gradients still reach the router.
    # the same network with a replayed (equal) routing: another graph, so its rounding bound
    np.testing.assert_allclose(np.asarray(_forward(model, ids, recorded)[0]), np.asarray(before), rtol=0,
                               atol=decoder_tolerance(before, model.config, ids.shape[1]))

    params_graph, params, rest = nnx.split(moved, nnx.Param, ...)

    def loss(params):
        m = nnx.merge(params_graph, params, rest)
        replay_routing(m, recorded)
        return jnp.sum(_logits(m, ids) ** 2)

    grad = jax.jit(jax.grad(loss))(params)
    assert float(jnp.abs(grad["layers"][0]["mlp"]["router_kernel"].get_value()).max()) > 0


def test_replay_of_the_wrong_layer_count_is_refused(moe_model):
    with pytest.raises(ValueError, match="2 MoE layers"):
        replay_routing(moe_model, [jnp.zeros((3, 2), jnp.int32)])


@pytest.mark.parametrize("overrides, field", [
    (dict(num_experts_per_tok=5), "num_experts_per_tok"), (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(mlp_only_layers=[1]), "mlp_only_layers")])
def test_moe_config_is_validated(overrides, field):
    with pytest.raises(ValueError, match=field):
        _moe_config(**overrides)


def test_moe_bf16_forward_is_close_to_float32(moe_model):
    model, config = moe_model, moe_model.config
    half = Decoder(dataclasses.replace(config, param_dtype="bfloat16"), rngs=nnx.Rngs(0))
    nnx.update(half, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model)))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 9)), jnp.int32)
    full, low = np.asarray(_forward(model, ids)[0]), np.asarray(_forward(half, ids)[0])
    assert low.dtype == np.float32 and np.abs(full - low).max() < 0.05 * np.abs(full).max() + 1e-2


def test_lora_on_attention_works_and_on_experts_is_refused(moe_model):
    from rlbolt.models.lora import LoraConfig, apply_lora

    model = moe_model  # apply_lora adapts a clone
    adapted = apply_lora(model, LoraConfig(rank=2, targets=("q", "o")), rngs=nnx.Rngs(1))
    ids = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    want = np.asarray(_forward(model, ids)[0])  # B = 0 adapters: the base's math through other fusions
    np.testing.assert_allclose(np.asarray(_forward(adapted, ids)[0]), want, rtol=0,
                               atol=decoder_tolerance(want, model.config, ids.shape[1], adapter_rank=2))
    with pytest.raises(ValueError, match="mixture-of-experts"):
        apply_lora(model, LoraConfig(rank=2, targets=("q", "up")), rngs=nnx.Rngs(1))
