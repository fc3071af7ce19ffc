"""Mesh shapes, the logical-axis rules, data shares and the one-process agreement helpers.

The rules are checked on `jax.sharding.AbstractMesh`es (no devices needed) against a table
written out by hand from the decoder's layout (rlbolt/models/decoder.py) and the rules
(vocab -> tp, embed -> fsdp, qkv/heads/mlp -> tp, head_dim replicated).
"""

from __future__ import annotations

import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

import jax
from rlbolt.config import ConfigError, load_config
from rlbolt.distributed import (AXES, DataShare, MeshError, MeshSpec, ShardingPlan, any_process, as_mesh,
                                gather_objects, gather_shares, max_over_processes, sum_over_processes)
from rlbolt.models import Decoder, tiny_config
from rlbolt.distributed.layout import validation_rows as _val_share


@pytest.mark.parametrize("spec, devices, want", [
    (MeshSpec(), 8, (1, 8, 1, 1, 1)),
    (MeshSpec(data=2, fsdp=-1, tp=2), 8, (2, 2, 1, 1, 2)),
    (MeshSpec(data=-1, fsdp=2, tp=1), 8, (4, 2, 1, 1, 1)),
    (MeshSpec(data=1, fsdp=1, tp=-1), 4, (1, 1, 1, 1, 4)),
    (MeshSpec(fsdp=2, expert=-1), 8, (1, 2, 4, 1, 1)),
    (MeshSpec(data=1, fsdp=1, tp=1), 1, (1, 1, 1, 1, 1)),
    (MeshSpec(), 1, (1, 1, 1, 1, 1)),
])
def test_mesh_spec_resolves_the_rest(spec, devices, want):
    assert spec.resolve(devices) == want


@pytest.mark.parametrize("spec, devices, words", [
    (MeshSpec(data=-1, fsdp=-1), 8, "at most one axis"),
    (MeshSpec(data=3), 8, "cannot be split"),
    (MeshSpec(data=2, fsdp=2, tp=1), 8, "needs 4 devices but 8"),
    (MeshSpec(fsdp=0), 8, "mesh.fsdp=0"),
    (MeshSpec(tp=-2), 8, "mesh.tp=-2"),
    (MeshSpec(data=True), 8, "mesh.data=True"),
])
def test_mesh_spec_refuses_shapes_that_do_not_fit(spec, devices, words):
    with pytest.raises(MeshError, match=words):
        spec.resolve(devices)


def test_mesh_spec_from_dict_names_unknown_axes():
    assert MeshSpec.of({"tp": 2}) == MeshSpec(data=1, fsdp=-1, tp=2)
    with pytest.raises(MeshError, match=r"unknown axes \['dp'\]"):
        MeshSpec.of({"dp": 2})
    with pytest.raises(TypeError, match="MeshSpec"):
        MeshSpec.of("fsdp=8")


def test_as_mesh_refuses_foreign_axis_names_and_builds_one_device():
    foreign = Mesh(jax.devices()[:1], ("batch",))
    with pytest.raises(MeshError, match="exactly"):
        as_mesh(foreign)
    mesh = as_mesh(None)
    assert mesh.axis_names == AXES and dict(mesh.shape) == {"data": 1, "fsdp": len(jax.devices()), "expert": 1, "context": 1, "tp": 1}


def _decoder_specs(mesh_shape, **config):
    plan = ShardingPlan(AbstractMesh(mesh_shape, AXES))
    model = nnx.eval_shape(lambda: Decoder(tiny_config(**config), rngs=nnx.Rngs(0)))
    shardings = plan.param_shardings(nnx.state(model))
    specs = {".".join(map(str, p)): v.get_value().spec for p, v in nnx.to_flat_state(shardings)}
    return specs, plan


def test_decoder_rules_match_the_hand_table():
    specs, plan = _decoder_specs((2, 4, 1, 1, 2), attention_bias=True, qk_norm=True)
    want = {
        "embed.embedding": P("tp", "fsdp"),
        "final_norm.scale": P("fsdp"),
        "lm_head.kernel": P("fsdp", "tp"),
        "layers.0.attn_norm.scale": P("fsdp"),
        "layers.0.attn.qkv_proj.kernel": P("fsdp", "tp"),
        "layers.0.attn.qkv_proj.bias": P("tp"),
        "layers.0.attn.q_norm.scale": P(None),
        "layers.0.attn.k_norm.scale": P(None),
        "layers.0.attn.o_proj.kernel": P("tp", "fsdp"),
        "layers.0.mlp_norm.scale": P("fsdp"),
        "layers.0.mlp.gate_up_proj.kernel": P("fsdp", "tp"),
        "layers.0.mlp.down_proj.kernel": P("tp", "fsdp"),
    }
    assert {k: v for k, v in specs.items() if not k.startswith("layers.1.")} == want
    assert plan.notes == [] and plan.batch_shards == 8


def test_axes_of_size_one_are_left_out_and_undividable_dims_replicated_with_a_note():
    # vocab 99 (the built-in tokenizer's) does not divide tp=2: the table's vocab axis is replicated.
    specs, plan = _decoder_specs((1, 4, 1, 1, 2), vocab_size=99)
    assert specs["embed.embedding"] == P(None, "fsdp")
    assert specs["lm_head.kernel"] == P("fsdp", None)
    assert specs["layers.0.attn.qkv_proj.kernel"] == P("fsdp", "tp")  # (4 + 2 * 2) * 16 = 128 divides
    assert plan.notes == ["vocab=99 does not divide tp=2: replicated over it (e.g. ['embed']['embedding'])"]
    one, _ = _decoder_specs((1, 1, 1, 1, 1))
    assert set(one.values()) == {P(None, None), P(None)}  # a one-device mesh shards nothing


def test_optimizer_state_follows_its_params_and_counters_are_replicated():
    plan = ShardingPlan(AbstractMesh((1, 4, 1, 1, 2), AXES))
    params = nnx.state(nnx.eval_shape(lambda: Decoder(tiny_config(), rngs=nnx.Rngs(0))))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    opt = jax.eval_shape(tx.init, params)
    shardings = plan.param_shardings(opt)
    adam = shardings[1][0]
    assert adam.mu["layers"][0]["attn"]["qkv_proj"]["kernel"].get_value().spec == P("fsdp", "tp")
    assert adam.nu["embed"]["embedding"].get_value().spec == P("tp", "fsdp")
    assert adam.count.spec == P()


def test_data_share_ranges_and_validation_shares():
    assert DataShare(0, 1).range(6) == (0, 6)
    assert [DataShare(r, 3).range(12) for r in range(3)] == [(0, 4), (4, 8), (8, 12)]
    with pytest.raises(ValueError, match="cannot be split equally over 3"):
        DataShare(0, 3).range(4)
    # 5 validation rows over 2 shares: 2 + 3; 2 rows over 3 shares: the third gets a filler of weight 0.
    assert [_val_share(10, 15, DataShare(r, 2)) for r in range(2)] == [([10, 11], 2), ([12, 13, 14], 3)]
    assert [_val_share(0, 2, DataShare(r, 3)) for r in range(3)] == [([0], 0), ([0], 1), ([1], 1)]


def test_agreement_helpers_on_one_process_return_their_input():
    assert any_process(True) is True and any_process(False) is False
    assert max_over_processes([3, 7]) == [3, 7]
    assert sum_over_processes({"a": 1.5, "b": -2.0}) == {"a": 1.5, "b": -2.0}
    assert gather_objects({"x": [1, "two"]}) == [{"x": [1, "two"]}]
    assert gather_shares("mine", 0, 1) == ["mine"]


def test_config_sections_mesh_and_distributed():
    cfg = load_config({"mesh": {"data": 2, "fsdp": -1, "tp": 2}})
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tp) == (2, -1, 2)
    assert cfg.distributed.mode == "auto" and cfg.distributed.heartbeat_timeout_s == 30
    with pytest.raises(ConfigError, match="mesh.fsdp=0"):
        load_config({"mesh": {"fsdp": 0}})
    with pytest.raises(ConfigError, match="more than one axis"):
        load_config({"mesh": {"data": -1}})
    with pytest.raises(ConfigError, match="distributed.mode"):
        load_config({"distributed": {"mode": "maybe"}})
    with pytest.raises(ConfigError, match="unknown key mesh.dp"):
        load_config({"mesh": {"dp": 2}})
