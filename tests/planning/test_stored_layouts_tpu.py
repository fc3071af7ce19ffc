"""The update forms each gradient in the layout its parameter is stored in (`rlbolt.distributed.stored_layouts`).

On a TPU a [V, H / fsdp] shard whose last dimension is not a multiple of 128 is stored column-major,
and a gradient formed by the lookup's scatter-add comes out row-major. Left to itself XLA then copies
the float32 masters and both AdamW moments into the gradient's layout for the optimizer's update and
back (1.5 GiB of temporaries per chip at Gemma-3-12B on v5p:2x2x2). With the gradient constrained to
the stored layout, no optimizer state is copied. Marked `tpu` (libtpu's compiler for v5p:2x2x2 on this
CPU); skipped without libtpu.
"""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

V, H, T = 4096, 960, 128  # fsdp 8: a [4096, 120] shard, 120 lanes (not a multiple of 128)


def _embedding_run():
    """A tied embedding (lookup + head) on fsdp 8, bf16 parameters, float32 masters and AdamW moments."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rlbolt import master_weights
    from rlbolt.batch import Batch
    from rlbolt.distributed import ShardingPlan, as_mesh
    from rlbolt.distributed.topology import target_devices

    plan = ShardingPlan(as_mesh({"fsdp": 8}, target_devices("v5p:2x2x2")))
    table = NamedSharding(plan.mesh, P(None, "fsdp"))
    params = {"embed": jax.ShapeDtypeStruct((V, H), jnp.bfloat16, sharding=table)}
    tx = master_weights.with_master_weights(optax.adamw(1e-3))
    opt_state = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=table if s.ndim == 2 else plan.replicated),
        jax.eval_shape(tx.init, params))

    def step(p, micro):
        h = jnp.take(p["embed"], micro["input_ids"], axis=0)
        logits = jnp.einsum("bth,vh->btv", h, p["embed"]).astype(jnp.float32)
        per_token = jnp.sum(jnp.square(logits), axis=-1) * micro["completion_mask"]
        return jnp.sum(per_token) / micro["mini_batch_num_tokens"][0], {}

    rows = NamedSharding(plan.mesh, P(None, "fsdp"))
    micro = Batch({"input_ids": jax.ShapeDtypeStruct((1, 8, T), jnp.int32, sharding=rows),
                   "completion_mask": jax.ShapeDtypeStruct((1, 8, T), jnp.float32, sharding=rows)})
    return plan, tx, params, opt_state, step, micro


def _state_copies(plan, tx, params, opt_state, step, micro) -> list[str]:
    """The compiled update's copies of an optimizer-state argument (masters, mu, nu) of the table's shape."""
    from rlbolt.update import make_update_fn

    update = make_update_fn(step, tx, 1, sharding=plan, params=params, opt_state=opt_state)
    hlo = update.func.lower(params, opt_state, micro, None).compile().as_text()
    return [line.strip()[:120] for line in hlo.splitlines()
            if re.search(rf"f32\[{V},{H // 8}\]\S* copy\(", line) and 'op_name="opt_state' in line]


def test_the_accumulator_layout_is_the_stored_one_and_only_where_it_is_not_row_major():
    import jax
    import jax.numpy as jnp

    from rlbolt.distributed.stored_layouts import accumulator_layouts

    plan, _, params, *_ = _embedding_run()
    narrow = accumulator_layouts(params, {"embed": jnp.float32})["embed"]
    assert narrow is not None and narrow.layout.major_to_minor == (1, 0)  # the 4096 rows minor: as the TPU stores it
    assert narrow.sharding == params["embed"].sharding
    wide = {"embed": jax.ShapeDtypeStruct((V, 1024), jnp.bfloat16, sharding=params["embed"].sharding)}
    assert accumulator_layouts(wide, {"embed": jnp.float32})["embed"] is None  # [4096, 128]: row-major already
    vector = {"embed": jax.ShapeDtypeStruct((H,), jnp.bfloat16, sharding=plan.replicated)}
    assert accumulator_layouts(vector, {"embed": jnp.float32})["embed"] is None  # one dimension: nothing to order


def test_no_optimizer_state_is_copied_into_the_gradients_layout(monkeypatch):
    import rlbolt.update

    run = _embedding_run()
    assert _state_copies(*run) == []
    monkeypatch.setattr(rlbolt.update, "accumulator_layouts", lambda params, dtypes: None)
    unconstrained = _state_copies(*run)
    assert len(unconstrained) >= 3, f"the measure is blind: without the constraint {unconstrained}"


def _expert_kernels(topology: str, chips: int):
    """Two layers' [E, I, H] kernels on fsdp over all `chips`, H split into 16-lane shards (stored with
    dim 0 minor); a micro batch of 2 x chips rows."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from rlbolt import master_weights
    from rlbolt.batch import Batch
    from rlbolt.distributed import ShardingPlan, as_mesh
    from rlbolt.distributed.topology import target_devices

    plan = ShardingPlan(as_mesh({"fsdp": chips}, target_devices(topology)))
    kernel = NamedSharding(plan.mesh, P(None, None, "fsdp"))
    params = {"w": [jax.ShapeDtypeStruct((8, 64, 16 * chips), jnp.bfloat16, sharding=kernel) for _ in range(2)]}
    tx = master_weights.with_master_weights(optax.adamw(1e-3))
    opt_state = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=kernel if s.ndim == 3 else plan.replicated),
        jax.eval_shape(tx.init, params))

    def step(p, micro):
        h = micro["x"]
        for w in p["w"]:
            h = jnp.tanh(jnp.einsum("bti,eih->bth", jnp.einsum("bth,eih->bti", h, w), w))
        return jnp.sum(jnp.square(h.astype(jnp.float32))), {}

    rows = NamedSharding(plan.mesh, P(None, "fsdp"))
    micro = Batch({"x": jax.ShapeDtypeStruct((2, chips, 16, 16 * chips), jnp.bfloat16, sharding=rows),
                   "completion_mask": jax.ShapeDtypeStruct((2, chips, 16), jnp.float32, sharding=rows)})
    return plan, tx, params, opt_state, step, micro


def test_no_constraint_where_the_compiler_would_gather_the_accumulator(monkeypatch):
    """On v5p:4x4x4 (fsdp 64) a value constrained to its own stored layout compiles to an all-reduce of the
    whole array: the update then held every layer's whole float32 gradient (Qwen3-30B-A3B's 48 expert
    kernels, 36 GiB per chip). The probe declines those formats there and keeps them on 32 chips."""
    import jax.numpy as jnp

    import rlbolt.distributed.stored_layouts as stored_layouts
    from rlbolt.update import make_update_fn

    def temporaries(plan, tx, params, opt_state, step, micro) -> int:
        update = make_update_fn(step, tx, 2, sharding=plan, params=params, opt_state=opt_state)
        return update.func.lower(params, opt_state, micro, None).compile().memory_analysis().temp_size_in_bytes

    f32 = {"w": [jnp.float32, jnp.float32]}
    on_32, on_64 = _expert_kernels("v5p:2x4x4", 32), _expert_kernels("v5p:4x4x4", 64)
    assert all(f is not None for f in stored_layouts.accumulator_layouts(on_32[2], f32)["w"])
    assert stored_layouts.accumulator_layouts(on_64[2], f32)["w"] == [None, None]
    kept = temporaries(*on_64)
    monkeypatch.setattr(stored_layouts, "_stored_format", stored_layouts._stored_format.__wrapped__)
    monkeypatch.setattr(stored_layouts, "_COLLECTIVE", __import__("re").compile(r"(?!x)x"))  # the probe blind
    forced = temporaries(*on_64)
    assert forced > 4 * kept, f"the measure is blind: forced {forced} B against {kept} B"
