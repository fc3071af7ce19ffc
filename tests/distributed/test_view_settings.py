"""A model view placed on other devices takes only its own plan's static settings: re-sharding a
view of a model whose experts ran on the training mesh clears that mesh (it used to keep it, so an
MoE reference, rollout or teacher apart ran its experts' shard_map on the training devices)."""

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh
    from rlbolt.distributed.sharding import ShardingPlan
    from rlbolt.models import Decoder, tiny_config
    devices = np.array(jax.devices())
    train = ShardingPlan(Mesh(devices[:2].reshape(1, 1, 2, 1), ("data", "fsdp", "expert", "tp")))
    apart = ShardingPlan(Mesh(devices[2:].reshape(1, 2, 1, 1), ("data", "fsdp", "expert", "tp")))
    config = tiny_config(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8)
    model = train.shard_activations(Decoder(config, rngs=nnx.Rngs(0)))
    assert all(layer.mlp.expert_mesh is train.mesh for layer in model.layers)
    view = apart.shard_activations(nnx.merge(*nnx.split(model)))
    assert all(layer.mlp.expert_mesh is None for layer in view.layers), "the view kept the training mesh"
    assert view.activation_sharding.mesh is apart.mesh and view.embedding_read_sharding.mesh is apart.mesh
    alone = ShardingPlan(Mesh(devices[3:].reshape(1, 1, 1, 1), ("data", "fsdp", "expert", "tp")))
    single = alone.shard_activations(nnx.merge(*nnx.split(model)))
    assert single.activation_sharding is None and single.embedding_read_sharding is None
    assert all(layer.mlp.expert_mesh is None for layer in single.layers)
    print("ok")
""")


def test_a_view_on_other_devices_drops_the_training_meshs_settings():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
