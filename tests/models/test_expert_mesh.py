"""Expert parallelism (`mesh.expert`): a Qwen3-MoE model on meshes with an expert axis equals one
device (logits, gradients, greedy tokens) and holds only E / expert experts per device. The
meshes run in a fresh process with 8 CPU devices (expert_mesh_check.py); the refusals run here."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from rlbolt.config import ConfigError, load_config
from rlbolt.distributed import AXES, MeshError, MeshSpec, ShardingPlan
from rlbolt.models import Decoder, tiny_config
from cpu_devices import child_env

SCRIPT = Path(__file__).with_name("expert_mesh_check.py")
MOE = dict(architecture="Qwen3MoeForCausalLM", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8)


def _check(meshes, mode: tuple[str, ...] = ()) -> dict:
    env = child_env()  # the script asks for its 8 devices itself
    done = subprocess.run([sys.executable, str(SCRIPT), *mode, json.dumps(meshes)], capture_output=True, text=True,
                          env=env, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_equal_to_one_device(results: dict) -> None:
    for mesh, r in results.items():
        ways = json.loads(mesh)["expert"]
        assert r["reduce_scatter"], (mesh, r)  # the experts ran split, not gathered
        assert r["loss_diff"] <= 1e-5 and r["logit_diff"] <= 1e-4, (mesh, r)
        assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"]), (mesh, r)
        assert r["greedy_equal"] and r["distinct"] >= 8, (mesh, r)
        e, h, i2 = r["gate_up_shape"]
        assert r["gate_up_shard"][0] == e // ways and r["gate_up_spec"].startswith("P('expert'"), (mesh, r)


@pytest.mark.slow  # 17 s on 2 cores; the refusals and the mesh spec below stay in the default tier
def test_expert2_x_fsdp2_x_tp2_equals_one_device_and_splits_the_experts():
    _assert_equal_to_one_device(_check([{"expert": 2, "fsdp": 2, "tp": 2}]))


@pytest.mark.slow
def test_gmm_under_shard_map_equals_one_device_with_ragged_dot():
    """model.moe_matmul: gmm (Pallas interpret mode) on meshes with and without an expert axis: the
    kernel runs under shard_map (a Mosaic kernel XLA cannot partition), and logits, gradients and
    greedy tokens equal one device's ragged_dot path (the same bounds as expert parallelism)."""
    results = _check([{"fsdp": 8}, {"expert": 2, "fsdp": 2, "tp": 2}], ("gmm",))
    for mesh, r in results.items():
        assert r["shard_map_gmm"], (mesh, r)
        assert r["loss_diff"] <= 1e-5 and r["logit_diff"] <= 1e-4, (mesh, r)
        assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"]), (mesh, r)
        assert r["greedy_equal"] and r["distinct"] >= 8, (mesh, r)


@pytest.mark.slow
def test_expert4_with_data_or_fsdp_equals_one_device():
    _assert_equal_to_one_device(_check([{"expert": 4, "data": 2, "fsdp": 1}, {"expert": 4, "fsdp": 2},
                                        {"expert": 2, "data": 4, "fsdp": 1}]))


@pytest.mark.slow
def test_grpo_with_router_replay_and_aux_loss_on_an_expert_mesh_equals_one_device():
    r = _check({"expert": 2, "fsdp": 4}, ("train",))
    assert r["same_completions"] and r["param_diff"] <= 1e-6, r
    for mesh_step, one_step in zip(r["steps"], r["one_steps"], strict=True):
        for name, value in one_step.items():
            assert abs(mesh_step[name] - value) <= 1e-5 * max(1.0, abs(value)), (name, r)
        assert one_step["moe/aux_loss"] > 0  # the balance term was in the loss on both


def _abstract_plan(expert: int) -> ShardingPlan:
    return ShardingPlan(AbstractMesh((1, 8 // expert, expert, 1, 1), AXES))


def test_an_expert_axis_that_does_not_divide_the_experts_is_refused_in_one_line():
    model = nnx.eval_shape(lambda: Decoder(tiny_config(**MOE), rngs=nnx.Rngs(0)))
    with pytest.raises(MeshError, match=r"^mesh.expert=4 does not divide the model's num_experts=6; choose") as info:
        _abstract_plan(4).shard_activations(model)
    assert "\n" not in str(info.value)
    _abstract_plan(2).shard_activations(model)  # 2 divides 6
    assert all(layer.mlp.expert_mesh is not None for layer in model.layers)


def test_an_expert_axis_on_a_dense_model_is_refused():
    model = nnx.eval_shape(lambda: Decoder(tiny_config(), rngs=nnx.Rngs(0)))
    with pytest.raises(MeshError, match="mesh.expert=2 .* this model is dense"):
        _abstract_plan(2).shard_activations(model)


def test_the_expert_axis_in_the_config_and_the_mesh_spec():
    cfg = load_config({"mesh": {"expert": 2, "fsdp": -1}})
    assert cfg.mesh.expert == 2
    with pytest.raises(ConfigError, match="mesh.expert=0"):
        load_config({"mesh": {"expert": 0}})
    assert MeshSpec(fsdp=-1, expert=4).resolve(8) == (1, 2, 4, 1, 1)
    with pytest.raises(MeshError, match="needs 16 devices but 8"):
        MeshSpec(fsdp=2, expert=4, tp=2).resolve(8)


def test_a_mesh_without_the_expert_axis_gets_it_with_size_one():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from rlbolt.distributed import as_mesh

    old = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1, 1), ("tp", "data", "fsdp"))
    for mesh in (as_mesh(old), ShardingPlan(old).mesh):
        assert mesh.axis_names == AXES and dict(mesh.shape) == {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tp": 1}


def test_a_stacked_moe_block_gets_one_layers_kernel_specs_and_the_mesh_which_its_views_see():
    """Layers stored stacked (rlbolt.models.stacked_layers): the plan sets the one block's settings, its
    kernel specs those of one layer's [E, ...] kernels (the scan body and the views see slices), and a
    view of the model placed on one device drops the mesh. The mesh run is tests/models/test_stacked_experts.py."""
    from jax.sharding import PartitionSpec as P

    from rlbolt.models.moe import moe_layers
    from rlbolt.models.stacked_layers import stack_layers

    per_layer = nnx.eval_shape(lambda: Decoder(tiny_config(num_layers=3, **MOE), rngs=nnx.Rngs(0)))
    stacked = stack_layers(nnx.eval_shape(lambda: Decoder(tiny_config(num_layers=3, **MOE), rngs=nnx.Rngs(0))))
    plan = _abstract_plan(2)
    for model in (per_layer, stacked):
        plan.shard_activations(model)
    (block,) = moe_layers(stacked)
    assert block.gate_up.get_value().shape[0] == 3
    specs = (P("expert", "fsdp", None), P("expert", None, "fsdp"))
    assert block.kernel_specs == per_layer.layers[0].mlp.kernel_specs == specs
    assert block.expert_mesh is plan.mesh and block.row_mesh is plan.mesh
    view = stacked.layers[2].mlp
    assert (view.kernel_specs, view.expert_mesh, view.row_mesh) == (specs, plan.mesh, plan.mesh)
    single = ShardingPlan(AbstractMesh((1, 1, 1, 1, 1), AXES)).shard_activations(nnx.merge(*nnx.split(stacked)))
    (moved,) = moe_layers(single)
    assert (moved.expert_mesh, moved.row_mesh, moved.kernel_specs) == (None, None, None)
    assert all(layer.mlp.expert_mesh is None for layer in single.layers)
