"""reasoning-gym rows: fields, the task's options, determinism, validation from unused seeds."""

import json
import pickle
import re

import pytest

pytest.importorskip("reasoning_gym")

from rlbolt.data.reasoning_gym import (  # noqa: E402
    is_task_spec,
    reasoning_gym_rows,
    reasoning_gym_splits,
    task_name,
)

OPTIONS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def _expression(question: str) -> str:
    return re.search(r"([-\d][\d +\-]*\d)\s*=\s*$", question).group(1)


def test_chain_sum_rows_hold_the_question_its_sum_and_the_task():
    rows = reasoning_gym_rows("chain_sum", size=20, seed=5, options=OPTIONS)
    assert len(rows) == 20
    for row in rows:
        assert set(row) == {"question", "answer", "task", "task_options", "metadata"}
        assert row["task"] == "chain_sum" and row["task_options"] == OPTIONS
        expression = _expression(row["question"])
        terms = re.findall(r"\d+", expression)
        assert 2 <= len(terms) <= 3 and all(len(t) <= 2 for t in terms)  # the options were applied
        assert int(row["answer"]) == eval(expression)  # noqa: S307 - digits and +/- only (hand reference)
    assert json.loads(json.dumps(rows)) == rows and pickle.loads(pickle.dumps(rows)) == rows


def test_rows_are_deterministic_and_prefix_stable():
    a = reasoning_gym_rows("chain_sum", size=10, seed=3, options=OPTIONS)
    assert a == reasoning_gym_rows("chain_sum", size=10, seed=3, options=OPTIONS)
    assert a[:4] == reasoning_gym_rows("chain_sum", size=4, seed=3, options=OPTIONS)
    assert a != reasoning_gym_rows("chain_sum", size=10, seed=4, options=OPTIONS)


def test_the_next_seed_is_the_same_dataset_shifted_so_validation_starts_past_training():
    """Why validation does not use seed + 1: entry i of seed s is entry i - 1 of seed s + 1."""
    s0 = reasoning_gym_rows("chain_sum", size=5, seed=7, options=OPTIONS)
    s1 = reasoning_gym_rows("chain_sum", size=5, seed=8, options=OPTIONS)
    assert [(r["question"], r["answer"]) for r in s0[1:]] == [(r["question"], r["answer"]) for r in s1[:4]]
    train, val = reasoning_gym_splits("chain_sum", train_size=30, val_size=10, seed=7, options=OPTIONS)
    assert len(train) == 30 and 0 < len(val) <= 10
    assert not {r["question"] for r in val} & {r["question"] for r in train}
    past = reasoning_gym_rows("chain_sum", size=10, seed=37, options=OPTIONS)  # seeds 37..46: after 7..36
    assert [r["question"] for r in val] == [r["question"] for r in past if r in val]
    assert all(r in past for r in val)


def test_small_task_spaces_drop_repeated_questions_from_validation():
    tiny = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}  # at most 100 questions
    train, val = reasoning_gym_splits("chain_sum", train_size=150, val_size=40, seed=0, options=tiny)
    assert len(val) < 40  # some were training questions
    assert not {r["question"] for r in val} & {r["question"] for r in train}


def test_bad_task_names_options_and_sizes_are_one_line_errors():
    with pytest.raises(ValueError, match="'no_such_task'") as error:
        reasoning_gym_rows("no_such_task", size=2)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"rejects options \{'max_termz': 3\}"):
        reasoning_gym_rows("chain_sum", size=2, options={"max_termz": 3})
    with pytest.raises(ValueError, match="max_terms must be >= min_terms"):
        reasoning_gym_rows("chain_sum", size=2, options={"min_terms": 4, "max_terms": 2})
    with pytest.raises(ValueError, match="size=0 must be a positive int"):
        reasoning_gym_rows("chain_sum", size=0)
    with pytest.raises(ValueError, match=r"pass \['seed'\] as arguments"):
        reasoning_gym_rows("chain_sum", size=2, options={"seed": 1})


def test_task_spec_spelling():
    assert is_task_spec("reasoning_gym:chain_sum") and not is_task_spec("rows.jsonl") and not is_task_spec(None)
    assert task_name("reasoning_gym:chain_sum") == "chain_sum"
    for bad in ("reasoning_gym:", "chain_sum", "reasoning_gym:  "):
        with pytest.raises(ValueError, match="must be 'reasoning_gym:<dataset name>'"):
            task_name(bad)
