"""Activation rematerialisation (`model.remat`, rlbolt.models.remat): every policy gives the loss
and gradients of `none`, and the policy really reaches the compiled program.

Why bit equality: remat re-runs the same operations on the same inputs in the backward; on CPU
XLA compiles the recomputed ops like the original ones, so the loss and every gradient come out
identical, not merely close (observed for every policy on the dense and the MoE tiny model; a
tolerance would hide a recomputation that read another value). That holds with XLA:CPU's fusion
emitters; the test tier compiles with the elemental ones (tests/conftest.py), which fuse the two
programs' loops differently (last-bit differences of 1e-7 in the gradients), so the comparisons run
in a child process with the emitters on.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cpu_devices import run_on_cpu_devices
from flax import nnx

from rlbolt.config import ConfigError, load_config
from rlbolt.config.sections import REMAT_POLICIES
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.remat import check_remat, checkpoint_policy
from rlbolt.modules.moe_routing import completion_load_balancing
from rlbolt.models.logps import token_logps, token_logps_and_routing

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(0,), num_layers=3)
P, C, G = 6, 10, 2  # prompt and completion tokens; rows per prompt group for the shared-prompt forward


def _batch(vocab: int):
    k = jax.random.split(jax.random.key(7), 2)
    prompt = jnp.repeat(jax.random.randint(k[0], (2, P), 1, vocab), G, axis=0)  # groups of G equal prompts
    prompt_mask = jnp.repeat(jnp.asarray([[False] * 2 + [True] * (P - 2), [True] * P]), G, axis=0)  # left padding
    completion = jax.random.randint(k[1], (2 * G, C), 1, vocab)
    completion_mask = jnp.arange(C)[None] < jnp.asarray([[C], [7], [C], [3]])  # right padding
    return prompt, prompt_mask, completion, completion_mask


def _loss_and_grads(model, policy: str, group_size: int):
    """(loss, grads) of a GRPO-like loss over the logps (plus the MoE load-balancing loss)."""
    model.remat = policy
    graphdef, params = nnx.split(model)
    batch = _batch(model.config.vocab_size)
    weights = jnp.asarray([1.0, -0.5, 0.25, -2.0])[:, None]

    def loss(params):
        if model.config.num_experts:
            logps, experts, probs = token_logps_and_routing(graphdef, params, *batch, group_size=group_size)
            aux = completion_load_balancing(experts, probs, batch[1], batch[3], group_size)
        else:
            logps, aux = token_logps(graphdef, params, *batch, group_size=group_size), 0.0
        return jnp.sum(jnp.where(batch[3], logps * weights, 0.0)) + 0.01 * aux

    return jax.jit(jax.value_and_grad(loss))(params)


def _assert_same(model, policy: str, group_size: int) -> None:
    base_loss, base_grads = _loss_and_grads(model, "none", group_size)
    loss, grads = _loss_and_grads(model, policy, group_size)
    assert float(loss) == float(base_loss)
    flat, base_flat = jax.tree.leaves(grads), jax.tree.leaves(base_grads)
    assert len(flat) == len(base_flat) and any(np.any(g != 0) for g in flat)
    for g, b in zip(flat, base_flat):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(b))


SAME_IN_A_CHILD = """
import sys
sys.path[:0] = sys.argv[1:3]
from flax import nnx
from rlbolt.models import Decoder, tiny_config
import test_remat as t
family, policy = sys.argv[3], sys.argv[4]
model = Decoder(tiny_config(**(t.MOE if family == "moe" else {})), rngs=nnx.Rngs(0))
for group_size in map(int, sys.argv[5].split(",")):
    t._assert_same(model, policy, group_size)
print("ok")
"""


def _same_in_a_child(family: str, policy: str, groups: tuple[int, ...]) -> None:
    """`_assert_same` for each group size, in a child process that compiles with the fusion emitters."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = run_on_cpu_devices(SAME_IN_A_CHILD, os.path.dirname(here), here, family, policy,
                             ",".join(map(str, groups)), devices=1, same_bits_across_programs=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]


def test_full_remat_gives_the_loss_and_gradients_of_none():
    """The default tier's cheap twin of the sweep below: dense model, unshared forward."""
    _same_in_a_child("dense", "full", (1,))


@pytest.mark.slow
@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_every_policy_gives_the_loss_and_gradients_of_none(policy, family):
    """Both training forwards: the unshared one (group 1) and the prompt-shared one (group G);
    the MoE loss carries the load-balancing term, whose routing leaves the checkpoint."""
    _same_in_a_child(family, policy, (1, G))


def _compiled_grad(policy: str, layers: int):
    """The compiled grad of a tiny model's summed logits, and how many checkpoints its forward holds."""
    model = Decoder(tiny_config(num_layers=layers, hidden_size=32, intermediate_size=64, vocab_size=64),
                    rngs=nnx.Rngs(0))
    model.remat = policy
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.zeros((2, 16), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(16), ids.shape)

    def loss(params):
        return jnp.sum(nnx.merge(graphdef, params)(ids, positions)[0][..., 0])

    jaxpr = str(jax.make_jaxpr(loss)(params))  # one checkpoint call (remat2) per layer
    checkpoints = len(re.findall(r"\bremat\d*\[|\bcheckpoint\[", jaxpr))
    return jax.jit(jax.grad(loss)).lower(params).compile(), checkpoints


def test_remat_is_in_the_compiled_program():
    """Full remat recomputes each layer's softmax in the backward: the compiled grad computes its
    exponentials twice per layer (forward, recomputation) where `none` computes them once and
    keeps them. (CPU's buffer assignment does not turn the recomputation into fewer temp bytes,
    measured: `memory_analysis()` is the same for both there, so the test counts the work.)"""
    layers = 3
    plain, plain_checkpoints = _compiled_grad("none", layers)
    full, full_checkpoints = _compiled_grad("full", layers)
    assert (plain_checkpoints, full_checkpoints) == (0, layers)
    exps = [len(re.findall(r"= f32\[[^\]]*\]\S* exponential\(", c.as_text())) for c in (plain, full)]
    assert exps[0] >= layers and exps[1] >= exps[0] + layers, exps


def test_a_bad_remat_value_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.remat.*'dots_saveable'") as error:
        load_config({"model": {"remat": "dots"}})
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"^model\.remat='dots' is not a remat policy; use one of \[") as error:
        check_remat("dots")
    assert "\n" not in str(error.value)
    model = Decoder(tiny_config(), rngs=nnx.Rngs(0))
    model.remat = "dots"
    with pytest.raises(ValueError, match=r"model\.remat"):
        model(jnp.zeros((1, 3), jnp.int32), jnp.arange(3)[None])


def test_the_policies_are_jaxs():
    assert checkpoint_policy("full") is None  # jax.checkpoint's default: save nothing but the inputs
    assert checkpoint_policy("dots_saveable") is jax.checkpoint_policies.dots_saveable
