"""The dock's selection rules as pure functions: which pending samples a `get` takes, and how
the taken samples are ordered so the micro batches cut from them carry balanced lengths.

Nothing here locks or waits; `ExperienceDock.get` calls the choice under its per-stage lock, a
consumer balances what it took (`balanced`), and the property tests drive them directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np


class DockError(ValueError):
    """A call the dock cannot serve (unknown stage or column, missing sample, double write, ...)."""


@dataclasses.dataclass
class Choice:
    """What a scan of the pending samples found.

    Attributes:
      indices: the chosen samples, in dock order (batch order, then index order).
      unready: pending samples in scope that are not ready yet and could still be chosen
        (waiting for them may grow the choice).
      full: no more samples can be added: `n` reached, or the next ready group does not fit.
    """

    indices: list[int]
    unready: int
    full: bool


def choose(units: Iterable[Sequence[int]], is_ready: Callable[[int], bool], n: int | None) -> Choice:
    """Takes ready units (a sample, or a whole group's pending samples) in order, up to n samples.

    Args:
      units: candidate units in dock order; each is a list of sample indices taken together.
      is_ready: whether a sample's required columns are all written.
      n: the most samples to take (None: no limit).

    Returns:
      The Choice. A unit that is not fully ready is skipped (counted in `unready`); the first
      ready unit that would overshoot `n` ends the scan (units are never split or reordered).
    """
    chosen: list[int] = []
    unready = 0
    for unit in units:
        if not all(is_ready(i) for i in unit):
            unready += len(unit)
            continue
        if n is not None and len(chosen) + len(unit) > n:
            return Choice(chosen, unready, True)
        chosen.extend(unit)
        if n is not None and len(chosen) == n:
            return Choice(chosen, unready, True)
    return Choice(chosen, unready, False)


def balanced_order(unit_lengths: Sequence[float], units_per_bin: int) -> list[list[int]]:
    """Splits equal-size units into bins of `units_per_bin` with near-equal total length.

    Greedy (longest first, into the lightest bin that still has room), then swaps between the
    heaviest and the lightest bin while a swap narrows their gap. When it stops, no such swap
    exists, which bounds the result: heaviest - lightest <= longest unit - shortest unit.

    Args:
      unit_lengths: [U] lengths (U must be a multiple of units_per_bin).
      units_per_bin: units per bin (a micro batch's samples, or its groups).

    Returns:
      The bins as lists of unit positions, each ascending; bins ordered by their first position.
    """
    lengths = np.asarray(unit_lengths, np.float64)
    if units_per_bin < 1 or len(lengths) % units_per_bin:
        raise DockError(f"balance: {len(lengths)} units cannot fill bins of {units_per_bin}")
    num_bins = len(lengths) // units_per_bin
    if num_bins <= 1:
        return [list(range(len(lengths)))] if len(lengths) else []
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    totals = np.zeros(num_bins)
    for u in sorted(range(len(lengths)), key=lambda u: (-lengths[u], u)):
        open_bins = [b for b in range(num_bins) if len(bins[b]) < units_per_bin]
        b = min(open_bins, key=lambda b: (totals[b], b))
        bins[b].append(u)
        totals[b] += lengths[u]
    for _ in range(50 * len(lengths)):  # each swap lowers sum(totals^2); integer lengths end it
        hi, lo = int(np.argmax(totals)), int(np.argmin(totals))
        gap = totals[hi] - totals[lo]
        best, best_d = None, 0.0
        for a in bins[hi]:
            for b in bins[lo]:
                d = lengths[a] - lengths[b]
                if 0 < d < gap and min(d, gap - d) > min(best_d, gap - best_d):
                    best, best_d = (a, b), d
        if best is None:
            break
        a, b = best
        bins[hi][bins[hi].index(a)], bins[lo][bins[lo].index(b)] = b, a
        totals[hi] -= best_d
        totals[lo] += best_d
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def balance_units(units: Sequence[Sequence[int]], lengths: Sequence[float], micro: int) -> list[int]:
    """The positions 0..N-1 of the chosen samples, reordered into balanced micro batches.

    Args:
      units: the chosen samples grouped into units (singletons, or whole groups), as positions
        into the chosen list.
      lengths: [N] per-sample lengths.
      micro: samples per micro batch. Full micro batches are balanced; a short remainder (a
        choice cut by a time-out) keeps its order at the end.

    Returns:
      A permutation of range(N).
    """
    sizes = {len(u) for u in units}
    if len(sizes) > 1 or (sizes and micro % next(iter(sizes))):
        raise DockError(f"balanced: micro={micro} with whole groups needs equal group sizes that divide it; "
                        f"got group sizes {sorted(sizes)}")
    size = next(iter(sizes), 1)
    per_bin = micro // size
    full_units = (len(units) // per_bin) * per_bin
    head, tail = units[:full_units], units[full_units:]
    weights = [float(sum(lengths[i] for i in u)) for u in head]
    order = [i for b in balanced_order(weights, per_bin) for u in b for i in head[u]] if head else []
    return order + [i for u in tail for i in u]


def sample_lengths(batch, name: str) -> np.ndarray:
    """[N] lengths of the taken samples from the column `name`: numbers, or an [N, L] mask's row sums."""
    if name not in batch:
        raise DockError(f"balanced: the lengths column {name!r} is not among the taken samples' columns "
                        f"{sorted(batch)}; pass lengths=<a column of them>")
    values = np.asarray(batch[name])
    return values.reshape(len(values), -1).sum(axis=1) if values.ndim > 1 else values


def balanced(taken: Any, micro: int, *, lengths: str = "completion_mask", whole_groups: bool = False) -> Any:
    """What a `get` took, reordered so consecutive micro batches of `micro` samples carry
    near-equal total lengths (heaviest - lightest <= the longest unit - the shortest, a unit being
    a sample, or with `whole_groups` a group: the samples of one batch key sharing a group id,
    which move whole).

    Args:
      taken: a `Taken` from `ExperienceDock.get`.
      micro: samples per micro batch (with whole_groups, a multiple of the group size).
      lengths: the column giving a sample's length: [N] numbers, or an [N, L] mask (its row sums).
      whole_groups: keep each group inside one micro batch.

    Returns:
      The same `Taken` type, its batch, indices and keys permuted alike.

    Raises:
      DockError: micro < 1, the lengths column is missing, or unequal groups that do not divide micro.
    """
    if isinstance(micro, bool) or not isinstance(micro, (int, np.integer)) or micro < 1:
        raise DockError(f"balanced: micro={micro!r} must be a positive micro batch size")
    batch, idx = taken
    if len(idx) == 0:
        return taken
    n = len(idx)
    if whole_groups:
        groups = np.asarray(batch["group_ids"]) if "group_ids" in batch else np.arange(n)
        units: dict[tuple, list[int]] = {}
        for p in range(n):
            units.setdefault((taken.keys[p], groups[p].item()), []).append(p)
        unit_list = list(units.values())
    else:
        unit_list = [[p] for p in range(n)]
    order = balance_units(unit_list, sample_lengths(batch, lengths), micro)
    return type(taken)(batch.select(np.asarray(order)), idx[order], [taken.keys[p] for p in order], taken.timed_out)
