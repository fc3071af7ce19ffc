"""model.moe_matmul on a TPU slice, compiled on this CPU with libtpu (`rlbolt plan`'s path).

Without a shard_map, XLA's partitioner runs the experts' sort, gather and `ragged_dot` over every
chip's rows on every chip (the [N_global * k, H] gathered rows are all-reduced whole), so the
compiled scratch grows with the slice; Pallas gmm under shard_map (model.moe_matmul: gmm, what auto
resolves to on TPU) keeps each chip to its own rows. Marked `tpu` (run with -m tpu in a venv with
the rlbolt[tpu] extra); skipped without libtpu. About 10-20 s per compile on two cores."""

from __future__ import annotations

import functools
import os

import pytest

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from rlbolt.config import load_config  # noqa: E402
from plan_tiny import RUN  # noqa: E402

TOPOLOGY = "v5p:2x2x2"  # 8 chips
T, E, K, H, I = 1024, 16, 4, 256, 128  # tokens per chip, experts, top k, hidden, expert MLP (bf16)


def _expert_block_temp_bytes(kernel: str, shard: bool) -> int:
    """Compiled scratch per chip of one expert block's forward + backward over 8 x T tokens (fsdp 8)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rlbolt.distributed.mesh import BATCH_AXES
    from rlbolt.distributed.topology import target_devices
    from rlbolt.models.moe import expert_parallel_experts, grouped_experts

    devices = target_devices(TOPOLOGY)
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, 8, 1, 1, 1), ("data", "fsdp", "expert", "context", "tp"))
    rows = NamedSharding(mesh, P(BATCH_AXES))
    n = 8 * T
    args = (jax.ShapeDtypeStruct((n, H), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((n, K), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((n, K), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((E, H, 2 * I), jnp.bfloat16, sharding=NamedSharding(mesh, P("expert", "fsdp", None))),
            jax.ShapeDtypeStruct((E, I, H), jnp.bfloat16, sharding=NamedSharding(mesh, P("expert", None, "fsdp"))))
    block = (functools.partial(expert_parallel_experts, hidden_act="silu", mesh=mesh, kernel=kernel) if shard
             else functools.partial(grouped_experts, hidden_act="silu", kernel=kernel))
    loss = lambda *a: jnp.sum(block(*a).astype(jnp.float32) ** 2)  # noqa: E731
    compiled = jax.jit(jax.grad(loss, argnums=(0, 3, 4))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_gmm_keeps_each_chip_to_its_own_rows_where_xla_replicates_them():
    """gmm under shard_map: scratch within a hand bound of the chip's own rows (T * K rows of the
    gathered tokens [H], gate|up [2I], the activation [I] and the expert outputs [H], bf16, forward and
    backward: x4 for the copies the backward keeps and rebuilds, plus the 8-way gathered expert
    kernels and their gradients); the ragged_dot path partitioned by XLA: at least the all-reduced
    [8 T K, H] gathered rows of every chip (what the compiler builds today)."""
    rows, weights = T * K * (2 * H + 3 * I) * 2, E * 3 * H * I * 2
    gmm = _expert_block_temp_bytes("gmm", shard=True)
    assert gmm <= 4 * rows + 2 * weights, (gmm, rows, weights)
    xla = _expert_block_temp_bytes("ragged_dot", shard=False)
    assert xla >= 8 * T * K * H * 2, xla
    assert xla > 2 * gmm, (xla, gmm)


def test_a_moe_run_plans_with_gmm_on_the_slice():
    """auto resolves to gmm for the slice's platform (on this CPU host), every MoE block runs it under
    shard_map over the slice's mesh, and the update compiles."""
    from rlbolt.distributed.topology import target_devices
    from rlbolt.models.moe import moe_layers
    from rlbolt.planning import build_abstract, plan_run

    tiny = {**RUN["model"]["tiny"], "architecture": "Qwen3MoeForCausalLM", "num_experts": 8,
            "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True}
    run = build_abstract(load_config({**RUN, "model": {**RUN["model"], "tiny": tiny}}), target_devices(TOPOLOGY))
    blocks = moe_layers(run.module.model)
    assert blocks and {b.matmul for b in blocks} == {"gmm"}
    assert all(b.row_mesh is not None and b.row_mesh.size == 8 for b in blocks)
    (update,) = plan_run(run, TOPOLOGY, names=("update",)).executables
    assert update.temp_bytes > 0


def _moe_run(layers: int, scan: bool):
    from rlbolt.distributed.topology import target_devices
    from rlbolt.planning import build_abstract

    config = {**RUN, "model": {**RUN["model"], "scan_layers": scan, "remat": "full",
                               "tiny": {**RUN["model"]["tiny"], "num_layers": layers, "num_experts": E,
                                        "num_experts_per_tok": K, "moe_intermediate_size": I}}}
    return build_abstract(load_config(config), target_devices(TOPOLOGY))


def test_moe_layers_scan_and_keep_one_layers_expert_gradients_at_a_time():
    """The MoE layers (gmm under shard_map) as one scanned body: at 8 layers the update's compiled
    scratch is well below the loop's, where every layer's whole expert-kernel gradient (all-reduced
    over fsdp) stayed live at once (measured: 25.4 MB scanned, 62.0 MB looped; from 4 to 8 layers
    the loop grows 6.0 MB per layer, the scan 1.8). Before, MoE layers never scanned (the two
    compiles gave the same program)."""
    from rlbolt.planning import plan_run
    from rlbolt.planning.compile import _lower_update

    temps, loops = {}, {}
    for scan in (False, True):
        run = _moe_run(8, scan)
        assert run.module.model.layers[0].mlp.matmul == "gmm"
        loops[scan] = _lower_update(run).as_text().count("stablehlo.while")
        (update,) = plan_run(run, TOPOLOGY, names=("update",)).executables
        temps[scan] = update.temp_bytes
    assert loops[True] > loops[False]  # the layers' scan
    assert temps[True] < 0.6 * temps[False], temps


def test_expert_kernels_gathered_in_blocks_hold_less_scratch():
    """model.expert_block_size: with the kernels entering in their fsdp shards (`MoeMLP.kernel_specs`) and
    4 blocks of the intermediate dim, one block of the gathered kernels and of their gradients exists at a
    time: the scratch falls by at least half the whole gathered kernels (E x 3 x H x I bf16), which the
    whole-kernel path holds, with their gradients, several times over (Qwen3-30B-A3B: about 5 GiB per chip)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from rlbolt.distributed.mesh import BATCH_AXES
    from rlbolt.distributed.topology import target_devices
    from rlbolt.models.moe import expert_parallel_experts

    t, e, k, h, i = 64, 64, 4, 256, 512  # the kernels (48 MiB gathered) outweigh the rows
    mesh = jax.sharding.Mesh(np.array(target_devices(TOPOLOGY)).reshape(1, 8, 1, 1, 1),
                             ("data", "fsdp", "expert", "context", "tp"))
    rows = NamedSharding(mesh, P(BATCH_AXES))
    specs = (P("expert", "fsdp", None), P("expert", None, "fsdp"))
    args = (jax.ShapeDtypeStruct((8 * t, h), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((8 * t, k), jnp.int32, sharding=rows),
            jax.ShapeDtypeStruct((8 * t, k), jnp.bfloat16, sharding=rows),
            jax.ShapeDtypeStruct((e, h, 2 * i), jnp.bfloat16, sharding=NamedSharding(mesh, specs[0])),
            jax.ShapeDtypeStruct((e, i, h), jnp.bfloat16, sharding=NamedSharding(mesh, specs[1])))

    def temp_bytes(block: int) -> int:
        run = functools.partial(expert_parallel_experts, hidden_act="silu", mesh=mesh, kernel="gmm", specs=specs,
                                block=block)
        loss = lambda *a: jnp.sum(run(*a).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 3, 4))).lower(*args).compile().memory_analysis().temp_size_in_bytes

    whole, blocked = temp_bytes(0), temp_bytes(i // 4)
    assert blocked <= whole - e * 3 * h * i * 2 // 2, (whole, blocked)
