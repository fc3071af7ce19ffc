"""Metric names: one lowercase, ``/``-separated vocabulary for every writer and dashboard.

The namespaces rlbolt's modules and callbacks emit (``<fn>`` is a reward function's name,
``<task>`` an eval task's):

    reward/mean, reward/std           group-pooled reward of the global batch
    reward/<fn>/mean                  one reward function's mean, before weighting
    advantage/mean, advantage/std, advantage/*
    kl                                KL estimate to the reference policy
    entropy                           mean per-token entropy of the policy
    clip_frac                         fraction of tokens whose ratio was clipped
    response_length/mean, response_length/max, response_length/clip_ratio
                                      completion tokens; clip_ratio = share that hit the limit
    staleness/mean, staleness/max     current policy version - sample version (async mode)
    loss, grad_norm, lr
    time/rollout, time/logps, time/reward, time/update, time/weight_sync, time/data_wait,
    time/step                         seconds spent per stage in one global step
    time/dock_wait/<stage>, time/dock_waits/<stage>, throughput/dock/<stage>/samples_per_s
                                      the ExperienceDock's per-stage counters for the step
    throughput/tokens_per_s, throughput/samples_per_s, throughput/mfu
    val/<task>/accuracy, val/<task>/pass@<k>   validation (Evaluation callback)

These are conventions, not a registry: any name that passes ``namespaced`` may be logged.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["namespaced", "normalize_name"]

V = TypeVar("V")

# Characters a name may hold after normalisation: TensorBoard tags, W&B keys and jsonl keys
# all accept these without escaping.
_ALLOWED = re.compile(r"^[a-z0-9_@.\-]+(/[a-z0-9_@.\-]+)*$")
_SEPARATORS = re.compile(r"[\\:]+")
_SPACES = re.compile(r"\s+")
_SLASHES = re.compile(r"/{2,}")


def normalize_name(name: str) -> str:
    """Normalises one metric name: lowercase, ``/`` as the only separator.

    ``"Reward/Mean"`` -> ``"reward/mean"``; ``"time:rollout"`` and ``"time\\rollout"`` ->
    ``"time/rollout"``; spaces become ``_``; repeated and edge slashes are dropped.

    Args:
        name: the raw name.

    Returns:
        The normalised name.

    Raises:
        TypeError: if ``name`` is not a string.
        ValueError: if the name is empty or holds characters outside ``[a-z0-9_@.-/]``.
    """
    if not isinstance(name, str):
        raise TypeError(f"metric name {name!r} is a {type(name).__name__}; metric names are strings")
    out = _SPACES.sub("_", name.strip().lower())
    out = _SEPARATORS.sub("/", out)
    out = _SLASHES.sub("/", out).strip("/")
    if not out:
        raise ValueError(f"metric name {name!r} is empty after normalisation; give it a name like 'reward/mean'")
    if not _ALLOWED.match(out):
        bad = sorted({c for c in out if not re.match(r"[a-z0-9_@.\-/]", c)})
        raise ValueError(
            f"metric name {name!r} holds {''.join(bad)!r}; use lowercase letters, digits, '_', '-', "
            "'.', '@' and '/' as the namespace separator (e.g. 'reward/format/mean')")
    return out


def namespaced(metrics: Mapping[str, V], prefix: str | None = None) -> dict[str, V]:
    """Checks and normalises every name of a metrics mapping; values pass through untouched.

    Args:
        metrics: name -> value (values are not read, so device arrays are not synced).
        prefix: optional namespace put in front of every name (``prefix="val"`` turns
            ``"gsm8k/accuracy"`` into ``"val/gsm8k/accuracy"``).

    Returns:
        A new dict with normalised names, in the input order.

    Raises:
        ValueError: on a bad name, or when two names normalise to the same one.
    """
    head = normalize_name(prefix) + "/" if prefix else ""
    out: dict[str, V] = {}
    origin: dict[str, Any] = {}
    for name, value in metrics.items():
        clean = head + normalize_name(name)
        if clean in out:
            raise ValueError(
                f"metric names {origin[clean]!r} and {name!r} both normalise to {clean!r}; "
                "rename one of them")
        out[clean] = value
        origin[clean] = name
    return out
