"""Float32 master weights behind bfloat16 params: a small learning rate still moves the weights
(the masters follow a float64 hand computation of AdamW), while pure bfloat16 rounds every
update away; float32 params get no masters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from float_tolerance import EPS32

from rlbolt import master_weights
from rlbolt.batch import Batch
from rlbolt.distributed.memory import plan_memory
from rlbolt.update import make_update_fn

W0 = np.array([1.0, -2.0, 0.25, 3.0])  # exact in bfloat16
C = np.array([0.5, -1.0, 2.0, 0.125])  # the loss is sum(C * w): the gradient is C, exact in bfloat16
LR, WD, STEPS = 2e-4, 0.01, 12  # lr < half a bfloat16 ulp of every |w| (1/256 at 1, 1/1024 at 0.25)
B1, B2, EPS = 0.9, 0.999, 1e-8  # optax.adamw's defaults


def _step(params, micro):
    del micro
    return jnp.sum(params["w"].astype(jnp.float32) * jnp.asarray(C, jnp.float32)), {}


def _run(mode):
    params = {"w": jnp.asarray(W0, jnp.bfloat16)}
    tx = master_weights.wrap(optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD), params, mode)
    opt_state = tx.init(params)
    update = make_update_fn(_step, tx, 1)
    micro = Batch({"completion_mask": np.ones((1, 1, 1), bool)})
    for _ in range(STEPS):
        params, opt_state, _ = update(params, opt_state, micro)
    return params, opt_state


def _adamw_float64():
    w, m, v = W0.copy(), np.zeros(4), np.zeros(4)
    for t in range(1, STEPS + 1):
        m = B1 * m + (1 - B1) * C
        v = B2 * v + (1 - B2) * C * C
        w = w - LR * ((m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS) + WD * w)
    return w


def test_masters_move_the_weights_where_pure_bfloat16_rounds_them_away():
    pure, pure_state = _run("none")
    assert master_weights.masters_of(pure_state) is None
    np.testing.assert_array_equal(np.asarray(pure["w"], np.float64), W0)  # every update rounded away

    params, state = _run("auto")
    masters = master_weights.masters_of(state)["w"]
    assert masters.dtype == jnp.float32 and params["w"].dtype == jnp.bfloat16
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.inner) if x.ndim)  # float32 moments
    expected = _adamw_float64()
    # Each step's float32 rounding is a few ulps of |w| (the Adam ratio, the decay, the add); 8 ulps a
    # step, summed over the steps, bounds it. The moved distance is ~STEPS * LR, far above that.
    np.testing.assert_allclose(np.asarray(masters, np.float64), expected, rtol=0, atol=8 * STEPS * EPS32 * np.abs(W0).max())
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(masters.astype(jnp.bfloat16)))
    moved = np.asarray(params["w"], np.float64) != W0
    assert moved[0] and moved[2]  # 1.0 and 0.25 moved past half a bfloat16 ulp; 3.0 needs more steps
    assert not moved[3]


def test_float32_params_get_no_masters_and_mode_is_checked():
    params = {"w": jnp.zeros(3, jnp.float32), "count": jnp.zeros((), jnp.int32)}
    tx = optax.adam(1e-3)
    assert master_weights.wrap(tx, params, "auto") is tx
    assert not master_weights.needs_masters(params)
    assert master_weights.needs_masters({"w": jnp.zeros(3, jnp.bfloat16)})
    with pytest.raises(ValueError, match=r"master_weights='fp32'; allowed: \('auto', 'none'\)"):
        master_weights.wrap(tx, params, "fp32")


def test_memory_plan_counts_the_masters_and_float32_gradients():
    from rlbolt.distributed.mesh import AXES
    from rlbolt.distributed.sharding import ShardingPlan

    params = {"w": jnp.zeros((64, 32), jnp.bfloat16)}  # one device: per-device bytes are the whole
    n = 64 * 32
    sharding = ShardingPlan(jax.make_mesh((1,) * len(AXES), AXES, devices=jax.devices()[:1]))
    with_masters = master_weights.wrap(optax.adamw(1e-3), params, "auto")
    items = plan_memory(sharding, params, with_masters.init(params), device_bytes=1 << 40).items
    assert (items["params"], items["gradients"], items["master weights"]) == (2 * n, 4 * n, 4 * n)
    assert items["optimizer state"] == 8 * n + 4  # two float32 moments and the int32 step count
    pure = plan_memory(sharding, params, optax.adamw(1e-3).init(params), device_bytes=1 << 40).items
    assert "master weights" not in pure and (pure["gradients"], pure["optimizer state"]) == (2 * n, 4 * n + 4)


@pytest.mark.slow  # three short fits (~25 s)
def test_a_bfloat16_fit_trains_masters_donates_and_resumes_exactly(tmp_path):
    from toy_module import ToyModule, prompt_rows

    from rlbolt.callbacks.checkpoint import ModelCheckpoint
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    class Bfloat16Toy(ToyModule):
        def init_params(self, rng):
            return jax.tree.map(lambda x: x.astype(jnp.bfloat16), super().init_params(rng))

    def fit(run_dir, steps, **kwargs):
        trainer = Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=steps, seed=3, run_dir=run_dir,
                          callbacks=[ModelCheckpoint(resume="latest", every_n_steps=1)], **kwargs)
        return trainer, trainer.fit(Bfloat16Toy(lr=1e-3), prompt_rows(8))

    trainer, state = fit(tmp_path / "a", 2)
    assert trainer.donated == ("params", "opt_state") and "master weights" in trainer.memory_plan.items
    masters = master_weights.masters_of(state.opt_state)["table"]
    assert state.params["table"].dtype == jnp.bfloat16 and masters.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(state.params["table"]), np.asarray(masters.astype(jnp.bfloat16)))
    _, resumed = fit(tmp_path / "b", 1)
    _, resumed = fit(tmp_path / "b", 2)  # resumes step 1 from its checkpoint, masters included
    for x, y in zip(jax.tree.leaves((state.params, state.opt_state)), jax.tree.leaves((resumed.params, resumed.opt_state)),
                    strict=True):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    _, pure = fit(tmp_path / "c", 1, master_weights="none")
    assert master_weights.masters_of(pure.opt_state) is None
