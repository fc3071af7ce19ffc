"""ColumnStore: the rows of every column of the dock, by sample, with a lock per column.

One array per put (a chunk), and per sample where its row is. A put takes only the locks of the
columns it writes, and only for dictionary updates; a read needs no lock (a sample's rows stay
put until every stage is done with it). Consecutive samples come back as slices of the chunks
that hold them: a view when one put wrote them all, the common case of a stage's dispatch.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rlbolt.batch import Batch
from rlbolt.producer.dock.selection import DockError


class _Column:
    __slots__ = ("lock", "chunks", "first", "live", "where")

    def __init__(self):
        self.lock = threading.Lock()
        self.chunks: list[np.ndarray | None] = []  # one array per put; freed when no row is live
        self.first: list[int | None] = []  # a chunk's first sample when its samples are consecutive
        self.live: list[int] = []
        self.where: dict[int, tuple[int, int]] = {}  # sample -> (chunk, row)


class ColumnStore:
    """Column name -> rows by sample index."""

    def __init__(self):
        self.columns: dict[str, _Column] = {}

    def names(self) -> set[str]:
        """The columns written so far."""
        return set(self.columns)

    def write(self, arrays: dict[str, np.ndarray], idx: np.ndarray, what: str) -> None:
        """Stores one row per index for each column; refuses (writing nothing) a double write."""
        cols = [(name, self.columns.setdefault(name, _Column())) for name in sorted(arrays)]
        keys = idx.tolist()
        for _, col in cols:  # sorted order: two writers sharing columns cannot deadlock
            col.lock.acquire()
        try:
            for name, col in cols:
                doubles = [i for i in keys if i in col.where]
                if doubles:
                    raise DockError(f"{what}: column {name!r} of sample(s) {few(doubles)} is already written "
                                    "(a double write); a stage adds columns, it never rewrites one")
            consecutive = bool(keys) and keys[-1] - keys[0] == len(keys) - 1 and bool((np.diff(idx) == 1).all())
            for name, col in cols:
                chunk = len(col.chunks)
                col.chunks.append(arrays[name])
                col.first.append(keys[0] if consecutive else None)
                col.live.append(len(keys))
                col.where.update(zip(keys, ((chunk, row) for row in range(len(keys)))))
        finally:
            for _, col in cols:
                col.lock.release()

    def gather(self, chosen: list[int], names: Sequence[str]) -> Batch:
        """The rows of `chosen` (in that order) for each column in `names`."""
        if not chosen:
            return Batch()
        out = {}
        consecutive = chosen == list(range(chosen[0], chosen[0] + len(chosen)))
        for name in names:
            col = self.columns[name]
            if consecutive:  # the usual case: a stage's dispatch of one batch, in order
                value = _consecutive_rows(col, chosen[0], len(chosen))
                if value is not None:
                    out[name] = value
                    continue
            locs = [col.where[i] for i in chosen]
            chunk_ids = np.fromiter((c for c, _ in locs), np.int64, len(locs))
            rows = np.fromiter((r for _, r in locs), np.int64, len(locs))
            if (chunk_ids == chunk_ids[0]).all():
                out[name] = col.chunks[chunk_ids[0]][rows]
                continue
            order = np.argsort(chunk_ids, kind="stable")
            parts = [col.chunks[c][rows[order][chunk_ids[order] == c]] for c in np.unique(chunk_ids)]
            out[name] = np.concatenate(parts)[np.argsort(order, kind="stable")]
        return Batch(out)

    def forget(self, indices: Sequence[int]) -> None:
        """Drops the rows of these samples; a chunk with no live row is freed."""
        for col in list(self.columns.values()):
            with col.lock:
                for i in indices:
                    loc = col.where.pop(i, None)
                    if loc is not None:
                        col.live[loc[0]] -= 1
                        if col.live[loc[0]] == 0:
                            col.chunks[loc[0]] = None


def _consecutive_rows(col: _Column, start: int, count: int) -> np.ndarray | None:
    """Rows of samples start..start+count-1 as slices of the chunks that hold them (a view when
    one chunk does); None when a chunk's samples are not consecutive."""
    parts, i, end = [], start, start + count
    while i < end:
        chunk, row = col.where[i]
        if col.first[chunk] is None:
            return None
        array = col.chunks[chunk]
        take = min(len(array) - row, end - i)  # rows row.. hold samples i.. (consecutive chunk)
        parts.append(array[row:row + take])
        i += take
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def as_arrays(columns: Mapping[str, Any], what: str) -> dict[str, np.ndarray]:
    """name -> NumPy array with a leading sample axis (a clear error otherwise)."""
    if not isinstance(columns, Mapping):
        raise DockError(f"{what}: columns must be a mapping name -> array, got {type(columns).__name__}")
    out = {}
    for name, value in columns.items():
        if not isinstance(name, str):
            raise DockError(f"{what}: column names must be strings, got {name!r}")
        arr = np.asarray(value)
        if arr.ndim == 0:
            raise DockError(f"{what}: column {name!r} is a scalar; every column needs a leading sample axis")
        out[name] = arr
    return out


def common_size(arrays: dict[str, np.ndarray], what: str) -> int:
    """The rows every column has (a clear error when they differ)."""
    sizes = {name: len(a) for name, a in arrays.items()}
    if len(set(sizes.values())) > 1:
        raise DockError(f"{what}: columns have different numbers of rows: {sizes}")
    return next(iter(sizes.values()), 0)


def few(items: list[int]) -> str:
    """The first five items, for an error message."""
    return str(items[:5])[:-1] + (", ...]" if len(items) > 5 else "]")
