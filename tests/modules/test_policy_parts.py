"""LMPolicyModule as three objects (issue 35): no mixins, the scorers behind one `.logps(batch)`,
and `ref_params` (which `CPUOffload` swaps) reaching the reference scorer the logps stage uses."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from float_tolerance import decoder_logps_tolerance
from module_helpers import module_config, setup_context

from rlbolt.batch import Batch
from rlbolt.models.logps import token_logps
from rlbolt.module import RLModule
from rlbolt.modules import DAPO, GRPO, GSPO, PPO, RLOO, DrGRPO, LMPolicyModule, ReinforcePP
from rlbolt.modules.scorers import ColocatedScorer


def _token_batch(vocab: int, n: int = 4, p: int = 6, c: int = 5) -> Batch:
    """A logps micro batch by hand (no sampler to compile): one group of `n` samples of a left-padded
    prompt (the layout a shared-prompt forward checks), ragged completions."""
    rng = np.random.default_rng(0)
    prompt_mask = np.repeat((np.arange(p) >= 2)[None, :], n, axis=0)
    completion_mask = np.arange(c)[None, :] < np.array([5, 3, 1, 4])[:, None]
    prompt = np.where(prompt_mask[0], rng.integers(2, vocab, p), 0).astype(np.int32)
    return Batch(prompt_ids=np.repeat(prompt[None, :], n, axis=0), prompt_mask=prompt_mask, completion_ids=rng.integers(2, vocab, (n, c)).astype(np.int32),
                 completion_mask=completion_mask, sampler_logps=np.zeros((n, c), np.float32))


@pytest.mark.parametrize("cls", [LMPolicyModule, GRPO, DAPO, DrGRPO, RLOO, GSPO, PPO, ReinforcePP])
def test_every_ready_module_is_a_single_chain_of_classes_down_to_rlmodule(cls):
    assert all(len(c.__bases__) == 1 for c in cls.__mro__[:-1]), [c.__bases__ for c in cls.__mro__]
    assert LMPolicyModule.__bases__ == (RLModule,)


def test_ref_params_set_by_an_offload_is_what_the_reference_scores_with(model, tokenizer):
    module = GRPO(module_config("grpo", beta=0.04), model=model, tokenizer=tokenizer)
    module.setup(setup_context())
    assert list(module.scorers) == ["ref"] and isinstance(module.scorers["ref"], ColocatedScorer)
    assert module.scorers["ref"].forward is module.policy.logps  # one jitted forward: compiled once
    batch = _token_batch(tokenizer.vocab_size)
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
