"""The reference role on devices of its own, as the LM module sees it (in-process, one device).

The 8-device checks (where the copy lives, its bytes, the forward on the reference mesh, a fit
equal to colocated) are in tests/distributed/test_placement.py. Here: what a LoRA module does
with such a placement, where the reference is the frozen base with the adapters off.
"""

from __future__ import annotations


import jax
import pytest

from rlbolt.distributed import MeshError, MeshSpec, ShardingPlan
from rlbolt.modules import GRPO
from rlbolt.plan import BatchPlan
from rlbolt.setup_context import SetupContext

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)
LORA = {"rank": 2, "alpha": 4, "targets": ["q", "v"]}


def _trainer_with_reference_apart():
    """A stand-in trainer whose reference plan is not the training plan (as a placement with a
    reference range of its own gives; one device here, which is enough for the module's choice)."""
    train = ShardingPlan(MeshSpec().build(jax.devices()[:1]))
    reference = ShardingPlan(MeshSpec().build(jax.devices()[:1]))
    plans = {"train": train, "rollout": train, "reference": reference}
    return SetupContext(BatchPlan(2, 2), shardings=plans)


def _lora_module(beta):
    return GRPO({"model": {"tiny": TINY, "lora": LORA}, "algorithm": {"beta": beta},
                 "rollout": {"max_new_tokens": 4}, "reward": {"executor": "thread", "weights": {"digits": 1.0}}})


def test_lora_with_a_reference_on_its_own_devices_is_refused_in_one_line():
    with pytest.raises(MeshError) as error:
        _lora_module(beta=0.04).setup(_trainer_with_reference_apart())
    message = str(error.value)
    assert "placement.reference" in message and "model.lora" in message and "use reference: train" in message
    assert "\n" not in message


def test_lora_without_a_kl_term_needs_no_reference_and_sets_up():
    module = _lora_module(beta=0.0)
    module.setup(_trainer_with_reference_apart())
    assert module.ref_params is None and module.scorers == {}


def test_a_placed_scorer_attends_over_an_episodes_environment_ids_as_a_colocated_one():
    # Episodes: the forward sees every real id (sequence_mask: sampled and environment ids) while only
    # sampled ids are trained (completion_mask). A placed reference used to feed completion_mask, so
    # its logps after an environment reply differed from the colocated reference's.
    import numpy as np
    from flax import nnx

    from rlbolt.models.config import tiny_config
    from rlbolt.models.decoder import Decoder
    from rlbolt.modules.reference import PlacedReference
    from float_tolerance import decoder_logps_tolerance
    from module_helpers import jitted_token_logps

    config = tiny_config(vocab_size=32)
    model = Decoder(config, rngs=nnx.Rngs(0))
    plan = ShardingPlan(MeshSpec().build(jax.devices()[:1]))
    rng = np.random.default_rng(0)
    batch = {"prompt_ids": rng.integers(1, 32, (2, 4)).astype(np.int32), "prompt_mask": np.ones((2, 4), bool),
             "completion_ids": rng.integers(1, 32, (2, 6)).astype(np.int32)}
    batch["sequence_mask"] = np.ones((2, 6), bool)
    batch["completion_mask"] = np.array([[1, 1, 0, 0, 1, 1]] * 2, bool)  # ids 2-3: the environment's reply
    placed = PlacedReference(model, None, plan, temperature=1.0).logps(batch)
    # jitted (one program for both masks): eagerly every primitive of the forward compiles alone
    full = np.asarray(jitted_token_logps(model, batch, mask="sequence_mask"))  # temperature 1.0
    sampled_only = np.asarray(jitted_token_logps(model, batch))
    tol = decoder_logps_tolerance(model, seq_len=10)
    np.testing.assert_allclose(placed[:, 4:], full[:, 4:], rtol=0, atol=tol)
    assert np.abs(sampled_only[:, 4:] - full[:, 4:]).max() > 100 * tol  # the masks give different logps there
