"""The prompt once per group (model.share_prompt) changes nothing but the speed: for GRPO, DAPO,
GSPO and PPO the old/reference logps (and PPO's values), the loss, its gradients and the
parameters after several AdamW steps equal those of the unshared forward.

The batch holds prompts of different lengths, left-padded to one width. Tolerance: float32
rounding. The two paths sum the same products in a different order, so logps agree to the
network's bound (tests/float_tolerance.py: decoder_logps_tolerance), losses and gradients to the
network's relative bound (gradients relative to their largest entry), parameters after three
SGD-with-momentum steps to that bound (three products per forward one, for the backward pass) of how far the steps moved them. SGD, not AdamW: Adam divides each entry's step by that entry's own gradient size, so an
entry whose gradient is zero up to rounding moves by up to +-lr in either path whatever the
forward (seen here: 2e-5 on one of 2,048 entries); SGD carries the gradient's rounding linearly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from float_tolerance import decoder_logps_tolerance, decoder_tolerance
from module_helpers import G, module_config, prompt_batch, setup_context

from rlbolt.modules import DAPO, GRPO, GSPO, PPO
from rlbolt.modules.prompt_sharing import require_shared_layout, stage_group_size
from rlbolt.update import add_mini_batch_totals

ROWS = [{"question": "What is 12 plus 30?", "answer": "42"},
        {"question": "7?", "answer": "7"}]  # 20 and 2 characters: left-padded by 12 and 30 of 32
ALGORITHMS = {"grpo": (GRPO, {"beta": 0.04}), "dapo": (DAPO, {"dynamic_sampling": False, "beta": 0.04}),
              "gspo": (GSPO, {"beta": 0.04}), "ppo": (PPO, {})}


def _module(cls, model, tokenizer, share, **algorithm):
    config = module_config(cls.algorithm_name, **algorithm)
    config["model"] = {"share_prompt": share}
    module = cls(config, model=model, tokenizer=tokenizer)
    module.setup(setup_context(num_iterations=2))  # old logps come from a forward, not the sampler
    return module


# Default tier: GRPO's policy path and PPO's trunk + value head; DAPO and GSPO share GRPO's forward (slow).
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("dapo", "gspo") else n
                                  for n in sorted(ALGORITHMS)])
def test_shared_prompt_equals_the_unshared_path(name, model, tokenizer):
    cls, algorithm = ALGORITHMS[name]
    shared, unshared = (_module(cls, model, tokenizer, share, **algorithm) for share in (True, False))
    assert (shared.train_group_size, unshared.train_group_size) == (G, 1)
    params = shared.init_params(jax.random.key(0))
    rolled = shared.on_rollout(params, prompt_batch(ROWS, seed=1))
    lengths = rolled["prompt_mask"].sum(1)
    assert len(set(lengths.tolist())) == 2 and lengths.max() < rolled["prompt_mask"].shape[1]  # padded, unequal
    assert shared.logps_group_size(rolled) == G and unshared.logps_group_size(rolled) == 1

    # The reference / old logps forward (and PPO's value forward).
    a, b = shared.compute_logps(params, rolled), unshared.compute_logps(params, rolled)
    columns = [c for c in ("old_logps", "ref_logps", "old_values") if c in b]
    assert "old_logps" in columns and ("old_values" in columns if name == "ppo" else "ref_logps" in columns)
    seq = rolled["prompt_mask"].shape[1] + rolled["completion_mask"].shape[1]
    relative = decoder_tolerance(1.0, model.config, seq)  # the network's rounding, relative to its outputs
    backward = 3 * relative  # a gradient runs each product forward and twice backward
    for column in columns:
        tolerance = decoder_logps_tolerance(model, seq) if column != "old_values" else relative * np.abs(b[column]).max()
        np.testing.assert_allclose(a[column], b[column], rtol=0, atol=tolerance, err_msg=column)
    assert np.abs(a["old_logps"]).max() > 1  # real log-probabilities, not zeros

    # One batch for both training paths (the unshared one's columns), so only the forward differs.
    batch = add_mini_batch_totals(unshared.on_advantage(b).numeric())
    if name != "ppo":  # the sampler's advantages are often all 0 on a tiny model: make every token count
        batch = batch.with_columns(advantages=np.linspace(-1.0, 2.0, batch.num_samples).astype(np.float32))

    def grad_fn(module):
        return jax.jit(jax.value_and_grad(module.training_step, has_aux=True))

    steps = {m: grad_fn(m) for m in (shared, unshared)}
    optimizer = optax.sgd(0.05, momentum=0.9)
    p_shared, p_unshared = params, params
    o_shared, o_unshared = optimizer.init(params), optimizer.init(params)
    for step in range(3):
        (l_s, m_s), g_s = steps[shared](p_shared, batch)
        (l_u, m_u), g_u = steps[unshared](p_unshared, batch)
        assert abs(float(l_s) - float(l_u)) <= backward * max(1.0, abs(float(l_u))), (step, float(l_s), float(l_u))
        for key in m_u:
            np.testing.assert_allclose(float(m_s[key]), float(m_u[key]), rtol=backward, atol=backward * 1e-2, err_msg=key)
        for (path, gu), gs in zip(jax.tree_util.tree_leaves_with_path(g_u), jax.tree.leaves(g_s)):
            gu, gs = np.asarray(gu), np.asarray(gs)
            np.testing.assert_allclose(gs, gu, rtol=0, atol=backward * np.abs(gu).max() + 1e-12, err_msg=str(path))
        u_s, o_shared = optimizer.update(g_s, o_shared, p_shared)
        u_u, o_unshared = optimizer.update(g_u, o_unshared, p_unshared)
        p_shared, p_unshared = optax.apply_updates(p_shared, u_s), optax.apply_updates(p_unshared, u_u)
    moved = max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(p_unshared), jax.tree.leaves(params)))
    assert moved > 1e-3  # three steps moved the parameters, so agreeing below means something
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(p_unshared), jax.tree.leaves(p_shared)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=0, atol=backward * moved, err_msg=str(path))


def test_stages_that_split_groups_or_span_batch_shards_run_unshared():
    assert stage_group_size(True, 8, 4) == 4 and stage_group_size(True, 12, 4) == 4
    assert stage_group_size(True, 6, 4) == 1  # a micro batch of 6 would split the second group
    assert stage_group_size(True, 8, 4, batch_shards=2) == 1  # a group's rows on two devices
    assert stage_group_size(False, 8, 4) == 1 and stage_group_size(True, 8, 1) == 1  # off; groups of one


def test_a_batch_that_broke_the_group_layout_is_refused_with_one_line():
    ids = np.array([[0, 5, 6], [0, 5, 6], [0, 0, 7], [0, 0, 7]])
    mask = ids > 0
    junk = np.where(mask, ids, 99)  # padding slots may hold anything: still one prompt per group
    require_shared_layout(junk, mask, 2, "on_rollout")
    swapped = ids[[0, 2, 1, 3]]  # a hook reordered single samples
    with pytest.raises(ValueError, match=r"on_advantage gave a batch whose sample 1 has a different prompt from "
                                         r"sample 0.*model.share_prompt=false"):
        require_shared_layout(swapped, swapped > 0, 2, "on_advantage")
    with pytest.raises(ValueError, match="3 samples do not split into groups of 2"):
        require_shared_layout(ids[:3], mask[:3], 2, "on_rollout")
