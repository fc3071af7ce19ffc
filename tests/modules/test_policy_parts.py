"""LMPolicyModule as three objects (issue 35): no mixins, the scorers behind one `.logps(batch)`,
and `ref_params` (which `CPUOffload` swaps) reaching the reference scorer the logps stage uses."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from float_tolerance import decoder_logps_tolerance
from module_helpers import module_config, prompt_batch, setup_context

from rlbolt.data import gsm8k_style_rows
from rlbolt.models.logps import token_logps
from rlbolt.module import RLModule
from rlbolt.modules import DAPO, GRPO, GSPO, PPO, RLOO, DrGRPO, LMPolicyModule, ReinforcePP
from rlbolt.modules.scorers import ColocatedScorer


@pytest.mark.parametrize("cls", [LMPolicyModule, GRPO, DAPO, DrGRPO, RLOO, GSPO, PPO, ReinforcePP])
def test_every_ready_module_is_a_single_chain_of_classes_down_to_rlmodule(cls):
    assert all(len(c.__bases__) == 1 for c in cls.__mro__[:-1]), [c.__bases__ for c in cls.__mro__]
    assert LMPolicyModule.__bases__ == (RLModule,)


def test_ref_params_set_by_an_offload_is_what_the_reference_scores_with(model, tokenizer):
    module = GRPO(module_config("grpo", beta=0.04), model=model, tokenizer=tokenizer)
    module.setup(setup_context())
    assert list(module.scorers) == ["ref"] and isinstance(module.scorers["ref"], ColocatedScorer)
    assert module.scorers["ref"].forward is module.policy.logps  # one jitted forward: compiled once
    batch = module.on_rollout(module.init_params(jax.random.key(0)), prompt_batch(gsm8k_style_rows(2)))
    before = module.scorers["ref"].logps(batch)
    # As CPUOffload does between stages: a replacement tree (here every weight halved) is what scores.
    module.ref_params = jax.tree.map(lambda x: x * 0.5, module.ref_params)
    halved = jax.tree.map(lambda x: x * 0.5, nnx.state(model, nnx.Param))
    graphdef = nnx.graphdef(model)
    inputs = [np.asarray(batch[k]) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    expected = np.asarray(jax.jit(lambda p, *a: token_logps(graphdef, p, *a))(halved, *inputs))
    after = module.compute_logps(module.init_params(jax.random.key(0)), batch)["ref_logps"]
    seq = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]  # the module may share each prompt
    np.testing.assert_allclose(after, expected, rtol=0, atol=decoder_logps_tolerance(model, seq))
    assert np.abs(after - before)[batch["completion_mask"]].max() > 0  # the replacement was used


def test_setting_ref_params_without_a_reference_copy_is_refused_in_one_line(model, tokenizer):
    module = GRPO(module_config("grpo", beta=0.0), model=model, tokenizer=tokenizer)
    module.setup(setup_context())
    assert module.scorers == {} and module.ref_params is None
    with pytest.raises(AttributeError) as error:
        module.ref_params = {}
    message = str(error.value)
    assert "ref_params" in message and "algorithm.beta" in message and "\n" not in message
