"""`algorithm.distill_teacher`: a teacher larger than the student, read from a folder the test
writes (a Hugging Face model folder holding the student's tokenizer files); another tokenizer, a
folder without one, and a missing folder are each refused in one line naming the field."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from float_tolerance import decoder_logps_tolerance
from module_helpers import TINY, jitted_token_logps, prompt_batch, setup_context

from rlbolt.config import ConfigError
from rlbolt.data import CharTokenizer, HFTokenizer
from rlbolt.data.char_tokenizer_files import save_char_tokenizer
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.hf_io import save_hf
from rlbolt.modules import GRPO

ALPHABET = "0123456789="
# The teacher is larger than the student (TINY: width 32, one layer): nothing may assume one shape.
TEACHER = dict(hidden_size=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=12, intermediate_size=96)


def _teacher_folder(path, alphabet=ALPHABET, seed=7, tokenizer=True):
    """A small teacher saved as a Hugging Face folder, with (or without) a character tokenizer."""
    vocab = len(alphabet) + 3
    teacher = Decoder(tiny_config(vocab_size=vocab, **TEACHER), rngs=nnx.Rngs(seed))
    save_hf(teacher, teacher.config, path)
    if tokenizer:
        save_char_tokenizer(CharTokenizer(alphabet), path)
    return path, teacher


def _student(teacher_path, student_tokenizer_folder, **algorithm):
    config = {"algorithm": {"name": "grpo", "distill_teacher": str(teacher_path), **algorithm},
              "model": {"tokenizer": str(student_tokenizer_folder), "tiny": TINY},
              "rollout": {"max_new_tokens": 4, "stop_at_eos": False},
              "data": {"prompt_field": "prompt", "max_prompt_tokens": 5, "use_chat_template": False},
              "reward": {"executor": "thread"}}
    module = GRPO(config, reward=lambda completion, sample: 0.0)
    module.setup(setup_context())
    return module


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory):
    """The seed-7 teacher's folder, written once: the first test's teacher, the other tests' student
    tokenizer (no test writes into it)."""
    return _teacher_folder(tmp_path_factory.mktemp("distill") / "teacher")


ROWS = [{"prompt": "3141=", "answer": "3141"}, {"prompt": "2718=", "answer": "2718"}]


def test_the_teacher_folder_is_read_and_scores_the_students_tokens(teacher_folder):
    folder, teacher = teacher_folder
    module = _student(folder, folder)  # the student uses the teacher's tokenizer files
    assert isinstance(module.tokenizer, HFTokenizer) and module.tokenizer.encode("31=") == [6, 4, 13]
    assert module.teacher.config == teacher.config and module.teacher.config.num_layers > module.model.config.num_layers
    params = module.init_params(jax.random.key(0))
    batch = module.compute_logps(params, module.on_rollout(params, prompt_batch(ROWS)))
    # Independent of the module: the in-memory teacher's forward on the same token columns.
    want = jitted_token_logps(teacher, batch)
    seq = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]  # the module's forward against a plain one
    np.testing.assert_allclose(batch["teacher_logps"], np.asarray(want), rtol=0,
                               atol=decoder_logps_tolerance(teacher, seq))
    assert not np.allclose(batch["teacher_logps"], batch["old_logps"], atol=1e-3)  # a different model


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, teacher_folder):
    student_folder, _ = teacher_folder
    # Same vocabulary size, other ids: "=" first, then the digits.
    other, _ = _teacher_folder(tmp_path / "other", alphabet="=0123456789")
    with pytest.raises(ConfigError, match=r"algorithm.distill_teacher=.*other: its tokenizer is not the student") as e:
        _student(other, student_folder)
    assert "\n" not in str(e.value)
    bigger, _ = _teacher_folder(tmp_path / "bigger", alphabet=ALPHABET + "+")
    with pytest.raises(ConfigError, match=r"its tokenizer is not the student's \(15 vs 14 ids"):
        _student(bigger, student_folder)


def test_a_missing_teacher_folder_is_refused_in_one_line(tmp_path, teacher_folder):
    student_folder, _ = teacher_folder
    with pytest.raises(ConfigError, match=r"algorithm.distill_teacher=.*nowhere does not exist; give a local") as e:
        _student(tmp_path / "nowhere", student_folder)
    assert "\n" not in str(e.value)


def test_a_teacher_folder_without_a_tokenizer_is_refused_in_one_line(tmp_path, teacher_folder):
    student_folder, _ = teacher_folder
    bare, _ = _teacher_folder(tmp_path / "bare", tokenizer=False)
    with pytest.raises(ConfigError, match=r"algorithm.distill_teacher=.*bare: its tokenizer cannot be read") as e:
        _student(bare, student_folder)
    assert "\n" not in str(e.value)
