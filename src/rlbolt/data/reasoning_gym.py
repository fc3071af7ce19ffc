"""Prompt rows from reasoning-gym's procedural tasks (`pip install 'rlbolt[tasks]'`).

`reasoning_gym.create_dataset(name, seed=, size=, **options)` generates `size` entries
`{question, answer, metadata}`; `reasoning_gym_rows` turns them into rlbolt prompt rows that also
name their task and options, so the task reward (`rlbolt.rewards.task_reward`) can rebuild the
task's scorer in a reward worker process from the row alone:

    {"question": str, "answer": str, "task": name, "task_options": {...}, "metadata": {...}}

reasoning-gym draws entry `i` of a dataset with seed `s` from `Random(s + i)`, so the dataset of
seed `s + 1` is that of seed `s` shifted by one entry: "another seed" must lie past the training
range. `reasoning_gym_splits` draws validation entries from seed `seed + train_size` on (the
next unused indices) and drops any whose question also appears in training (small tasks repeat).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["TASK_PREFIX", "is_task_spec", "reasoning_gym_rows", "reasoning_gym_splits", "task_name"]

TASK_PREFIX = "reasoning_gym:"


def is_task_spec(value: Any) -> bool:
    """Whether a `data.train` / `data.val` value names a reasoning-gym task (`reasoning_gym:chain_sum`)."""
    return isinstance(value, str) and value.startswith(TASK_PREFIX)


def task_name(spec: str) -> str:
    """`"reasoning_gym:chain_sum"` -> `"chain_sum"` (errors name the value and the expected form)."""
    name = spec[len(TASK_PREFIX):] if is_task_spec(spec) else ""
    if not name.strip():
        raise ValueError(f"task spec {spec!r} must be 'reasoning_gym:<dataset name>', e.g. 'reasoning_gym:chain_sum'")
    return name.strip()


def _module():
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("reasoning-gym tasks need the reasoning-gym package: pip install 'rlbolt[tasks]'") from None
    return reasoning_gym


def _create(name: str, seed: int, size: int, options: Mapping[str, Any]):
    rg = _module()
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"reasoning-gym task {name!r}: size={size!r} must be a positive int")
    reserved = sorted({"seed", "size"} & set(options))
    if reserved:
        raise ValueError(f"reasoning-gym task {name!r}: pass {reserved} as arguments, not inside the task options")
    try:
        return rg.create_dataset(name, seed=int(seed), size=size, **options)
    except TypeError as error:  # an option the task's config dataclass does not have
        raise ValueError(f"reasoning-gym task {name!r} rejects options {dict(options)}: {error}") from None
    except (ValueError, AssertionError) as error:  # unknown name, or the config's own validation
        raise ValueError(f"reasoning-gym task {name!r} with options {dict(options)}: {error}") from None


def _plain(value: Any) -> Any:
    """A JSON round trip where possible (rows are logged and checkpointed), else a deep copy."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return copy.deepcopy(value)


def reasoning_gym_rows(name: str, *, size: int, seed: int = 0, options: Mapping[str, Any] | None = None) -> list[dict]:
    """The entries of one reasoning-gym dataset as prompt rows.

    Args:
        name: the dataset name (`reasoning_gym.factory.DATASETS`), e.g. "chain_sum".
        size: how many rows.
        seed: the dataset seed (entry i is drawn from seed + i).
        options: the task's config fields, e.g. `{"min_terms": 2, "max_terms": 3}`.

    Returns:
        `size` rows `{question, answer, task, task_options, metadata}` (answer as a string).

    Raises:
        ImportError: reasoning-gym is not installed.
        ValueError: unknown task, a bad option or size (one line naming them).
    """
    options = dict(options or {})
    dataset = _create(name, seed, size, options)
    rows = []
    for index in range(size):
        entry = dataset[index]
        rows.append({"question": str(entry["question"]), "answer": str(entry["answer"]), "task": name,
                     "task_options": _plain(options), "metadata": _plain(entry.get("metadata") or {})})
    return rows


def reasoning_gym_splits(name: str, *, train_size: int, val_size: int, seed: int = 0,
                         options: Mapping[str, Any] | None = None) -> tuple[list[dict], list[dict]]:
    """Training rows and validation rows of one task, the validation rows from unused seeds.

    Args:
        name: the dataset name.
        train_size: training rows (entries of seeds seed .. seed + train_size - 1).
        val_size: validation rows drawn (from seed + train_size on); fewer come back when some
            repeat a training question.
        seed: the training seed.
        options: the task's config fields.

    Returns:
        (train rows, validation rows); no validation question is a training question.
    """
    train = reasoning_gym_rows(name, size=train_size, seed=seed, options=options)
    val = reasoning_gym_rows(name, size=val_size, seed=seed + train_size, options=options)
    seen = {row["question"] for row in train}
    return train, [row for row in val if row["question"] not in seen]
