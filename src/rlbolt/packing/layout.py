"""Host side of padding-free packing: which packed row each sample sits in, and where it starts.

A padded micro batch costs rows x the longest sequence; a packed one lays each sample's real
tokens (its prompt's, then its completion's or episode's) end to end in rows of `row_tokens`
tokens, so the tokens set the cost. The layout travels with the batch as three columns:

    pack_rows     [N, R] bool   True at the packed row (0..R-1, within its block) sample i sits in
    pack_starts   [N]    int32  the column of the row where sample i's first real token lands
    pack_sources  [N, S] int32  per block, the packed index of each forward token's predicting state
                                (`pack_sources`: the output projection runs over these only)

R, the rows per block, is the width of `pack_rows`, so it is a static shape under jit; `plan.packed_rows`
fixes it (one compiled shape), else it follows each step's need. A micro
batch's samples are cut into `blocks` contiguous blocks (one per batch shard of the mesh) and each
block is packed into rows of its own, so a shard's rows hold its own samples only.

Samples are placed first-fit decreasing (longest first, ties by index; each into the first row
with room): deterministic, and within 11/9 OPT + 6/9 rows (Dosa 2007). R is the most rows any
block of the step needs, rounded up to keep three binary digits (1..8 exact, then 10, 12, 14,
16, 20, ...), so a run compiles the update for a few row counts, not one per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

PACKING_MODES = ("off", "on")


class PackingError(ValueError):
    """A batch that cannot be packed as configured (the message names the field and the fix)."""


@dataclass(frozen=True)
class PackingSpec:
    """How the update and the log-prob forwards pack samples into rows.

    Attributes:
      row_tokens: tokens per packed row; None: the padded width (prompt + completion), so any
        sample fits.
      blocks: contiguous sample blocks per micro batch packed apart (the mesh's batch shards).
      rows: packed rows per block, fixed (`plan.packed_rows`); None: as many as needed, bucketed.
    """

    row_tokens: int | None = None
    blocks: int = 1
    rows: int | None = None

    def width(self, padded_width: int) -> int:
        """The packed row length L.

        Args:
          padded_width: the padded rows' width P + C.
        """
        return padded_width if self.row_tokens is None else int(self.row_tokens)


def packing_spec(plan: Any, sharding: Any = None) -> PackingSpec | None:
    """The PackingSpec of a BatchPlan (`plan.packing`, `plan.packed_row_tokens`, `plan.packed_rows`).

    Args:
      plan: the BatchPlan.
      sharding: the training ShardingPlan (one block per batch shard), or None (one block).

    Returns:
      The PackingSpec, or None when packing is off.
    """
    if plan.packing != "on":
        return None
    return PackingSpec(plan.packed_row_tokens, 1 if sharding is None else sharding.batch_shards,
                       plan.packed_rows)


def sample_lengths(prompt_mask: np.ndarray, forward_mask: np.ndarray) -> np.ndarray:
    """Real tokens per sample.

    Args:
      prompt_mask: [..., P] bool.
      forward_mask: [..., C] bool, the tokens the forward runs (completion_mask or sequence_mask).

    Returns:
      [...] int64.
    """
    return np.asarray(prompt_mask, bool).sum(-1) + np.asarray(forward_mask, bool).sum(-1)


def first_fit_decreasing(lengths: np.ndarray, row_tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Places items of `lengths` into rows of `row_tokens`: longest first, each in the first row with room.

    Args:
      lengths: [m] int tokens per sample (0 allowed: it sits at its row's end, taking no room).
      row_tokens: L, each row's capacity.

    Returns:
      (row [m] int32, start [m] int32, rows used); samples keep their index order within a row.

    Raises:
      PackingError: a sample longer than `row_tokens` (names plan.packed_row_tokens).
    """
    lengths = np.asarray(lengths, np.int64)
    too_long = np.flatnonzero(lengths > row_tokens)
    if too_long.size:
        i = int(too_long[0])
        raise PackingError(f"plan.packed_row_tokens={row_tokens} is shorter than sample {i}'s {int(lengths[i])} tokens "
                           "(prompt + completion); raise it to at least the longest sample, or set it to null "
                           "(the padded width)")
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    free: list[int] = []
    row = np.zeros(len(lengths), np.int32)
    for i in order:
        for r, room in enumerate(free):
            if room >= lengths[i]:
                break
        else:
            r = len(free)
            free.append(row_tokens)
        free[r] -= int(lengths[i])
        row[i] = r
    start = np.zeros(len(lengths), np.int32)
    for r in range(len(free)):
        members = np.flatnonzero(row == r)  # index order inside the row
        start[members] = np.concatenate([[0], np.cumsum(lengths[members])[:-1]]).astype(np.int32)
    return row, start, max(len(free), 1)


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to keep its top three binary digits (a handful of compiled shapes).

    Args:
      rows: the rows a step needs (>= 1).
    """
    if rows <= 8:
        return max(rows, 1)
    step = 1 << (rows.bit_length() - 3)
    return -(-rows // step) * step


def pack_columns(lengths: np.ndarray, micro_size: int, spec: PackingSpec, padded_width: int) -> dict[str, np.ndarray]:
    """`pack_rows` and `pack_starts` for samples laid out in micro batches of `micro_size`.

    Samples [k * micro_size, (k + 1) * micro_size) form micro batch k; each micro batch is cut into
    `spec.blocks` contiguous blocks, each packed on its own (`first_fit_decreasing`).

    Args:
      lengths: [N] real tokens per sample (`sample_lengths`); N a multiple of micro_size.
      micro_size: samples per micro batch (a multiple of spec.blocks).
      spec: the PackingSpec.
      padded_width: the padded row width P + C (spec.row_tokens None packs into rows this long).

    Returns:
      {"pack_rows": [N, R] bool, "pack_starts": [N] int32}.
    """
    lengths = np.asarray(lengths, np.int64)
    n, blocks = len(lengths), spec.blocks
    if micro_size <= 0 or n % micro_size or micro_size % blocks:
        raise PackingError(f"packing: {n} samples do not split into micro batches of {micro_size} over {blocks} "
                           "batch shard(s); make plan.train_micro_batch_size a multiple of the batch shards")
    block = micro_size // blocks
    placed = [first_fit_decreasing(lengths[s:s + block], spec.width(padded_width)) for s in range(0, n, block)]
    needed = max((used for _, _, used in placed), default=1)
    if spec.rows is not None and needed > spec.rows:
        raise PackingError(f"plan.packed_rows={spec.rows} is fewer than the {needed} rows a micro batch block needs "
                           f"at {spec.width(padded_width)} tokens a row; raise plan.packed_rows (or set it to null)")
    rows = bucket_rows(needed) if spec.rows is None else spec.rows
    pack_rows = np.zeros((n, rows), bool)
    row = np.concatenate([r for r, _, _ in placed]) if placed else np.zeros(0, np.int32)
    pack_rows[np.arange(n), row] = True
    starts = np.concatenate([s for _, s, _ in placed]) if placed else np.zeros(0, np.int32)
    return {"pack_rows": pack_rows, "pack_starts": starts.astype(np.int32)}


def source_slots(block: int, completion: int, length: int, *, rows: int | None = None,
                 forward_tokens: int | None = None) -> int:
    """S, the `pack_sources` entries per sample: one static shape for a step's micro batches.

    With the rows per block fixed it is data-free, min(R * L, m * C) over m; else the most forward
    tokens any block holds, rounded up to three binary digits (`bucket_rows`), over m. Without
    `forward_tokens` it is the most a block can hold (m * C): the shape `rlbolt plan` compiles.

    Args:
      block: m, samples per packed block.
      completion: C, the completion (forward mask) width.
      length: L, tokens per packed row.
      rows: R, `plan.packed_rows` when fixed; None: bucketed.
      forward_tokens: the most forward tokens a block of this batch holds (rows None), or None for the
        worst case.
    """
    if rows is not None:
        slots = min(rows * length, block * completion)
    else:
        slots = bucket_rows((block * completion if forward_tokens is None else forward_tokens) or 1)
    return max(1, -(-slots // block))


def pack_sources(prompt_mask: np.ndarray, forward_mask: np.ndarray, columns: dict[str, np.ndarray], micro_size: int,
                 spec: PackingSpec, padded_width: int) -> np.ndarray:
    """`pack_sources` [N, S] int32: where in its block's packed rows each forward token's predicting state sits.

    The output projection needs only the hidden states that predict a forward token (the column
    before it), not every packed token (prompts included). Per block of m samples, the m x S entries
    (row-major) list the flat packed index `row * L + column - 1` of each forward token's predictor,
    samples in index order, tokens in order; the rest are 0 (read, never used). S is one static shape
    for the step (`source_slots`).

    Args:
      prompt_mask: [N, P] bool.
      forward_mask: [N, C] bool, the tokens the forward runs (completion_mask or sequence_mask).
      columns: `pack_columns`' {"pack_rows", "pack_starts"} for the same samples.
      micro_size: samples per micro batch.
      spec: the PackingSpec.
      padded_width: P + C.
    """
    prompt_len = np.asarray(prompt_mask, bool).sum(-1)
    forward = np.asarray(forward_mask, bool)
    n, c = forward.shape
    length, block = spec.width(padded_width), micro_size // spec.blocks
    needed = None if spec.rows is not None else max((int(forward[s:s + block].sum()) for s in range(0, n, block)),
                                                    default=1)
    per_sample = source_slots(block, c, length, rows=spec.rows, forward_tokens=needed)
    row = np.argmax(columns["pack_rows"], axis=1)
    out = np.zeros((n, per_sample), np.int32)
    for s in range(0, n, block):
        i, t = np.nonzero(forward[s:s + block])  # sample-major, tokens in order
        i = i + s
        rank = np.cumsum(forward[s:s + block], axis=1)[i - s, t] - 1  # the token's place among its sample's own
        before = np.clip(columns["pack_starts"][i] + prompt_len[i] + rank - 1, 0, length - 1)
        out[s:s + block].reshape(-1)[:len(i)] = row[i] * length + before
    return out


def with_pack_columns(batch: Any, micro_size: int, spec: PackingSpec) -> Any:
    """`batch` (a host `rlbolt.batch.Batch`) with `pack_rows` and `pack_starts` for micro batches of `micro_size`.

    A sample's real tokens are its prompt's and its forward mask's: `sequence_mask` (an episode's
    sampled and environment ids) when the batch has it, else `completion_mask`.

    Args:
      batch: the host batch (prompt_ids, prompt_mask, completion_ids and the masks).
      micro_size: samples per micro batch (consecutive samples; `plan.train_micro_batch_size`).
      spec: the PackingSpec.
    """
    forward = batch["sequence_mask"] if "sequence_mask" in batch else batch["completion_mask"]
    prompt = np.asarray(batch["prompt_mask"])
    width = prompt.shape[1] + np.shape(forward)[1]
    columns = pack_columns(sample_lengths(prompt, forward), micro_size, spec, width)
    sources = pack_sources(prompt, forward, columns, micro_size, spec, width)
    return batch.with_columns({**columns, "pack_sources": sources})


__all__ = ["PACKING_MODES", "PackingError", "PackingSpec", "bucket_rows", "first_fit_decreasing", "pack_columns",
           "pack_sources", "packing_spec", "sample_lengths", "source_slots", "with_pack_columns"]
