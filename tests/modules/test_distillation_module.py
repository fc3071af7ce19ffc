"""On-policy distillation in the ready modules: the teacher scores the student's sampled tokens
and each token's advantage is -kl_coef * (log student - log teacher) (+ the task's); with the
student as its own teacher nothing moves; a teacher of another vocabulary is refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from float_tolerance import EPS32, decoder_logps_tolerance
from module_helpers import G, TINY, jitted_token_logps, module_config, prompt_batch, setup_context, tiny_model

from rlbolt.config import ConfigError
from rlbolt.data import gsm8k_style_rows
from rlbolt.models import Decoder, tiny_config
from rlbolt.modules import GRPO
from rlbolt.modules.prompts import builtin_tokenizer


@pytest.fixture(scope="module")
def teacher(tokenizer):
    """Another tiny Decoder of the student's shape (seed 7); the tests only read it."""
    return Decoder(tiny_config(vocab_size=tokenizer.vocab_size, **TINY), rngs=nnx.Rngs(7))


def _module(teacher, model, tokenizer, **algorithm):
    module = GRPO(module_config("grpo", **algorithm), model=model, tokenizer=tokenizer, teacher=teacher)
    module.setup(setup_context())
    return module


def _advantaged(module, seed=0):
    params = module.init_params(jax.random.key(0))
    batch = module.on_rollout(params, prompt_batch(gsm8k_style_rows(2), seed))
    return params, module.on_advantage(module.compute_logps(params, batch))


@pytest.mark.slow  # ~14 s; the teacher's scoring stays in the default tier (test_distill_teacher_config, the distill recipe)
def test_the_student_as_its_own_teacher_gives_zero_advantages_and_no_update():
    tokenizer = builtin_tokenizer()
    student = tiny_model(tokenizer)
    module = GRPO(module_config("grpo"), model=student, tokenizer=tokenizer, teacher=student)
    module.setup(setup_context())
    params, batch = _advantaged(module)
    assert np.all(batch["advantages"] == 0.0)  # exactly: the same forward on the same tokens
    micro = batch.numeric().with_columns(mini_batch_num_tokens=np.full(batch.num_samples, batch["completion_mask"].sum()),
                                         mini_batch_num_samples=np.full(batch.num_samples, batch.num_samples))
    grads = jax.grad(lambda p: module.training_step(p, micro)[0])(params)
    assert all(float(np.abs(np.asarray(g)).max()) == 0.0 for g in jax.tree.leaves(grads))


def test_advantages_are_the_teachers_reverse_kl_by_hand(teacher, model, tokenizer):
    module = _module(teacher, model, tokenizer, distill_kl_coef=0.5)
    _, batch = _advantaged(module)
    mask = np.asarray(batch["completion_mask"], bool)
    want_teacher = np.asarray(jitted_token_logps(teacher, batch))
    seq = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]
    tolerance = decoder_logps_tolerance(teacher, seq)  # the module's teacher forward against a plain one
    np.testing.assert_allclose(batch["teacher_logps"][mask], want_teacher[mask], rtol=0, atol=tolerance)
    want = np.where(mask, -0.5 * (batch["old_logps"] - want_teacher), 0.0)
    np.testing.assert_allclose(batch["advantages"], want, rtol=0, atol=0.5 * tolerance + 8 * EPS32 * np.abs(want).max())
    assert np.abs(batch["advantages"]).max() > 1e-3  # the teacher differs, so the check above could fail
    assert batch["advantages"].shape == (2 * G, module.rollout_cfg.max_new_tokens)


def test_task_advantages_mix_in_with_their_weight(teacher, model, tokenizer):
    pure = _advantaged(_module(teacher, model, tokenizer))[1]
    mixed = _advantaged(_module(teacher, model, tokenizer, distill_task_coef=2.0))[1]
    mask = np.asarray(pure["completion_mask"], bool)
    task = np.asarray(GRPO.compute_advantages(None, pure))  # the group z-scores of the same rewards
    np.testing.assert_allclose(mixed["advantages"], np.where(mask, pure["advantages"] + 2.0 * task[:, None], 0.0),
                               atol=1e-5)


def test_a_teacher_of_another_vocabulary_is_refused_in_one_line(model, tokenizer):
    teacher = Decoder(tiny_config(vocab_size=tokenizer.vocab_size + 3, **TINY), rngs=nnx.Rngs(7))
    with pytest.raises(ConfigError, match="teacher's vocab_size .* is not the student's") as error:
        _module(teacher, model, tokenizer)
    assert "\n" not in str(error.value)
