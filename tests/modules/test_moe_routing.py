"""Mixture-of-experts terms of the LM modules (modules/moe_routing.py): the load-balancing loss in
the RL loss, router replay in the training forward, the routing-mismatch metric, and the
refusals. References: hand counts, and float64 NumPy over routing read straight from the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from module_helpers import prompt_batch, setup_context
from rlbolt.config import ConfigError, load_config
from rlbolt.data import gsm8k_style_rows
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.moe import pop_routing, record_routing
from rlbolt.module import collect_log_values
from rlbolt.modules import GRPO, PPO
from rlbolt.modules.moe_routing import routed_token_masks, routing_columns, slot_mismatch
from rlbolt.rollout import left_pad_positions
from rlbolt.models.logps import forward_routing
from rlbolt.update import add_mini_batch_totals

E, K = 4, 2


def _moe_model(tokenizer, scale=6.0):
    config = tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=16, architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=E,
                         num_experts_per_tok=K, moe_intermediate_size=16, norm_topk_prob=True)
    model = Decoder(config, rngs=nnx.Rngs(0))
    nnx.update(model, jax.tree.map(lambda x: scale * x if x.ndim >= 2 else x, nnx.state(model, nnx.Param)))
    return model


def _module(tokenizer, model=None, *, coef=0.0, record=False, replay=False, cls=GRPO):
    config = {"algorithm": {"name": cls.algorithm_name, "router_replay": replay},
              "rollout": {"max_new_tokens": 8, "record_routing": record, "temperature": 1.0},
              "model": {"router_aux_loss_coef": coef, "share_prompt": False},
              "data": {"max_prompt_tokens": 32}, "reward": {"weights": {"digits": 1.0}}}
    module = cls(config, model=model if model is not None else _moe_model(tokenizer), tokenizer=tokenizer)
    module.setup(setup_context())
    return module


def _moved(params, scale=0.5):
    """The parameters after an 'update': every router perturbed, so re-routing differs."""
    keys = iter(jax.random.split(jax.random.key(7), 8))

    def move(path, x):
        name = jax.tree_util.keystr(path)
        return x + scale * jax.random.normal(next(keys), x.shape) if "router_kernel" in name else x

    return jax.tree_util.tree_map_with_path(move, params)


def _forward_routing(module, params, batch):
    """(experts per layer [N, k], probs per layer [N, E]) of a plain model forward, read from the model."""
    model = nnx.merge(module.graphdef, params)
    record_routing(model)
    ids = jnp.concatenate([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = jnp.concatenate([batch["prompt_mask"], batch["completion_mask"]], 1).astype(bool)
    experts, probs = _routed_forward(model, ids, left_pad_positions(mask), mask)
    return [np.asarray(e) for e in experts], [np.asarray(p, np.float64) for p in probs]


@nnx.jit
def _routed_forward(model, ids, positions, mask):
    """The forward, jitted (eagerly every primitive compiles alone), and the routing it recorded."""
    model(ids, positions, attention_mask=mask)
    return pop_routing(model)


def test_slot_mismatch_and_token_masks_against_hand_counts():
    recorded = [jnp.asarray([[0, 1], [2, 3], [1, 2]]), jnp.asarray([[3, 0], [1, 2], [0, 1]])]
    recomputed = [jnp.asarray([[1, 0], [2, 0], [3, 0]]), jnp.asarray([[3, 0], [2, 1], [2, 3]])]
    # layer 0: token 0 same set (order ignored) 0; token 1: 0 is new -> 1; token 2: 3 and 0 new -> 2
    # layer 1: 0, 0, 2 -> with token 2 masked out: 1 + 0 (layer 0) + 0 + 0 (layer 1) = 1 of 2*2*2 = 8
    mismatched, total = slot_mismatch(recorded, recomputed, jnp.asarray([True, True, False]))
    assert (float(mismatched), float(total)) == (1.0, 8.0)
    mismatched, total = slot_mismatch(recorded, recomputed, jnp.ones(3, bool))
    assert (float(mismatched), float(total)) == (5.0, 12.0)
    assert float(slot_mismatch(recorded, recomputed, jnp.zeros(3, bool))[1]) == 0.0  # all masked: nothing counted

    prompt_mask = jnp.asarray([[False, True], [True, True]])
    completion_mask = jnp.asarray([[True, True, False], [True, False, False]])  # row 1: one token, never fed
    routed, completion = routed_token_masks(prompt_mask, completion_mask, 1)
    assert routed.tolist() == [False, True, True, False, False, True, True, False, False, False]
    assert completion.tolist() == [False, False, True, False, False, False, False, False, False, False]
    routed, completion = routed_token_masks(jnp.asarray([[True, True]] * 2), completion_mask, 2)  # one prompt, C-1
    assert routed.tolist() == [True, True, True, False, False, False]
    assert completion.tolist() == [False, False, True, False, False, False]


def test_routing_columns_left_pad_to_the_batch_width_and_refuse_wider_prompts():
    prompt, completion = np.ones((2, 3, 4, 2), np.int32), np.full((2, 5, 4, 2), 7, np.int32)
    cols = routing_columns(prompt, completion, 6, num_experts=128)
    assert cols["prompt_routing"].shape == (2, 6, 4, 2) and cols["prompt_routing"].dtype == np.uint8
    assert (cols["prompt_routing"][:, :3] == 0).all() and (cols["prompt_routing"][:, 3:] == 1).all()
    assert routing_columns(prompt, completion, 3, num_experts=512)["completion_routing"].dtype == np.int16
    with pytest.raises(ValueError, match="more than the batch's prompt width 2"):
        routing_columns(prompt, completion, 2, num_experts=4)


def _trained(module, params, batch):
    batch = add_mini_batch_totals(module.on_advantage(batch).numeric())
    return jax.jit(module.training_step)(params, batch), batch


def test_aux_loss_adds_coef_times_the_hand_computed_load_balancing_loss(tokenizer):
    model = _moe_model(tokenizer)
    plain, weighted = _module(tokenizer, model), _module(tokenizer, model, coef=0.25)
    params = plain.init_params(jax.random.key(0))
    batch = plain.on_rollout(params, prompt_batch(gsm8k_style_rows(2)))
    batch = plain.compute_logps(params, batch)
    (loss0, metrics0), _ = _trained(plain, params, batch)
    (loss1, metrics1), b = _trained(weighted, params, batch)
    assert "moe/aux_loss" not in metrics0  # coef 0: the term is not even computed
    assert not plain.routes_in_training and weighted.routes_in_training

    # float64 reference: E * sum_e f_e P_e over every layer's fed completion tokens (transformers' formula)
    experts, probs = _forward_routing(plain, params, b)
    mask = np.asarray(b["completion_mask"], bool)
    fed = mask & np.concatenate([mask[:, 1:], np.zeros_like(mask[:, :1])], 1)
    keep = np.concatenate([np.zeros_like(np.asarray(b["prompt_mask"], bool)), fed], 1).reshape(-1)
    assert keep.sum() > 4
    counts = sum(np.stack([(e[keep] == j).sum() for j in range(E)]) for e in experts)
    prob_sum = sum(p[keep].sum(0) for p in probs)
    rows = keep.sum() * len(experts)
    want = E * np.sum((counts / rows) * (prob_sum / rows))  # one micro batch: its share of the tokens is 1
    assert 0 < want <= E * K
    # float32 against float64: sums of <= 2 * 64 probabilities (each <= 1) and counts: <= 128 * eps = 1.5e-5
    # of the sum, and the aux loss is ~E * K times it: rtol=1e-5 of the loss; the loss difference cancels two
    # float32 losses of ~1 (4e-7 each): rtol=1e-4 + atol=1e-6; the other metrics do not depend on the aux term
    np.testing.assert_allclose(float(metrics1["moe/aux_loss"]), want, rtol=1e-5)
    np.testing.assert_allclose(float(loss1) - float(loss0), 0.25 * want, rtol=1e-4, atol=1e-6)
    for name in metrics0:  # nothing else moved
        np.testing.assert_allclose(float(metrics1[name]), float(metrics0[name]), rtol=1e-6, atol=1e-7)


def test_router_replay_trains_on_the_rollout_routing_after_the_routers_moved(tokenizer):
    model = _moe_model(tokenizer)
    replaying = _module(tokenizer, model, record=True, replay=True, coef=0.1)
    params = replaying.init_params(jax.random.key(0))
    batch = replaying.on_rollout(params, prompt_batch(gsm8k_style_rows(2)))
    assert batch["prompt_routing"].shape[:2] == batch["prompt_ids"].shape and batch["prompt_routing"].shape[2:] == (2, K)
    assert batch["completion_routing"].shape == (*batch["completion_ids"].shape, 2, K)
    batch = replaying.compute_logps(params, batch)
    moved = _moved(params)
    b = add_mini_batch_totals(replaying.on_advantage(batch).numeric())
    routed, _ = routed_token_masks(b["prompt_mask"], b["completion_mask"], 1)
    routed = np.asarray(routed)
    recorded = [np.sort(np.asarray(r), -1) for r in forward_routing((b["prompt_routing"], b["completion_routing"]))]

    _, _, aux = jax.jit(replaying.forward)(moved, b)
    replayed = [np.sort(np.asarray(e), -1) for e in aux["router"][0]]
    free, _ = _forward_routing(replaying, moved, b)  # the moved model routing on its own
    free = [np.sort(e, -1) for e in free]
    for old, new, own in zip(recorded, replayed, free):
        assert (old[routed] == new[routed]).all()  # exactly the rollout's experts
    assert any((old[routed] != own[routed]).any() for old, own in zip(recorded, free))  # they would differ
    (loss, metrics), _ = _trained(replaying, moved, batch)
    assert np.isfinite(float(loss)) and float(metrics["moe/aux_loss"]) > 0


def test_routing_mismatch_metric_equals_a_hand_count(tokenizer):
    model = _moe_model(tokenizer)
    recording = _module(tokenizer, model, record=True)
    params = recording.init_params(jax.random.key(0))
    batch = recording.on_rollout(params, prompt_batch(gsm8k_style_rows(2)))
    with collect_log_values() as same:
        recording.compute_logps(params, batch)
    assert same["moe/routing_mismatch"] == [0.0]  # the rollout's own weights route as the rollout did

    moved = _moved(params)
    with collect_log_values() as logged:
        out = recording.compute_logps(moved, batch)
    experts, _ = _forward_routing(recording, moved, out)
    routed, _ = routed_token_masks(jnp.asarray(out["prompt_mask"]), jnp.asarray(out["completion_mask"]), 1)
    routed = np.asarray(routed)
    recorded = [np.asarray(r) for r in forward_routing((out["prompt_routing"], out["completion_routing"]))]
    missing = sum(int(sum(e not in set(old[t]) for e in new[t])) for old, new in zip(recorded, experts)
                  for t in np.flatnonzero(routed))
    want = missing / (routed.sum() * len(experts) * K)
    assert 0 < want < 1
    np.testing.assert_allclose(logged["moe/routing_mismatch"], [want], rtol=1e-6)


def test_router_settings_are_refused_in_one_line(tokenizer):
    with pytest.raises(ConfigError, match="^algorithm.router_replay=true .* set rollout.record_routing=true$"):
        load_config({"algorithm": {"router_replay": True}})
    with pytest.raises(ConfigError, match="rollout.record_routing=true is recorded by the native engine only"):
        load_config({"rollout": {"record_routing": True, "engine": "vllm"}})
    dense = Decoder(tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=16, intermediate_size=32), rngs=nnx.Rngs(0))
    for settings, field in (({"record": True, "replay": True}, "rollout.record_routing"),
                            ({"coef": 0.01}, "model.router_aux_loss_coef")):
        with pytest.raises(ConfigError, match=f"^{field} is set, but the model is dense") as info:
            _module(tokenizer, dense, **settings)
        assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef is not wired into PPO"):
        _module(tokenizer, coef=0.01, cls=PPO)


@pytest.mark.parametrize("settings", [{}, {"coef": 0.01}, {"record": True}, {"record": True, "replay": True}],
                         ids=["none", "aux_loss", "record", "replay"])
def test_scan_layers_stores_moe_layers_stacked_only_without_routing_features(tokenizer, settings):
    """`build_policy` with model.scan_layers: a run that neither records nor replays routing (no aux
    loss, rollout.record_routing, algorithm.router_replay) stores its MoE layers stacked, and its block
    gets model.moe_matmul and model.expert_block_size; any routing feature keeps them per layer, and the
    reason names its fields."""
    from rlbolt.models.scan_layers import stack_reason
    from rlbolt.models.stacked_layers import is_stacked
    from rlbolt.modules.moe_routing import routing_fields
    from rlbolt.modules.policy_setup import build_policy

    coef, record, replay = settings.get("coef", 0.0), settings.get("record", False), settings.get("replay", False)
    cfg = load_config({"algorithm": {"name": "grpo", "router_replay": replay},
                       "rollout": {"record_routing": record},
                       "model": {"scan_layers": True, "router_aux_loss_coef": coef, "moe_matmul": "ragged_dot",
                                 "expert_block_size": 8}})
    model = build_policy(cfg, _moe_model(tokenizer), tokenizer, setup_context(), 1.0).model
    fields = routing_fields(coef, record, replay)
    assert is_stacked(model) == (not fields)
    if fields:
        assert f"({', '.join(fields)})" in stack_reason(model, routing=fields)
    else:
        assert model.layers.block.mlp.gate_up.shape[0] == 2  # [L, E, H, 2I]
    assert {(layer.mlp.matmul, layer.mlp.block_size) for layer in model.layers} == {("ragged_dot", 8)}  # views too
