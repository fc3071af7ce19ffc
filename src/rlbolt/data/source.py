"""PromptSource: a random-access, epoch-aware view of the training prompts.

The data position is one integer: the global prompt counter. Counter k reads prompt
`k % len` of epoch `k // len`, shuffled per epoch with grain's seeded index shuffle, so a
checkpoint restores the data stream from that single number (no iterator state to pickle), a
step may straddle an epoch boundary, and DAPO-style refills simply read further.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grain


class PromptSource:
    """Prompts addressed by a global counter.

    Args:
      rows: a sequence of dict rows (or a grain `MapDataset` of dicts), e.g. `{"prompt": ..., "answer": ...}`.
      shuffle: reshuffle every epoch (seeded; epoch e uses seed + e).
      seed: the shuffle seed.
    """

    def __init__(self, rows: Sequence[Mapping[str, Any]] | grain.MapDataset, *, shuffle: bool = True, seed: int = 0):
        ds = rows if isinstance(rows, grain.MapDataset) else grain.MapDataset.source(rows)
        self.num_prompts = len(ds)
        if self.num_prompts == 0:
            raise ValueError("train_data is empty: give at least prompts_per_step prompt rows")
        self._ds = ds.shuffle(seed=seed) if shuffle else ds

    def __len__(self) -> int:
        return self.num_prompts

    def take(self, position: int, count: int) -> list[dict[str, Any]]:
        """The rows at counters [position, position + count), each with a `prompt_index` field
        (its counter, unique across the run: the samples' group id)."""
        rows = []
        for k in range(position, position + count):
            row = self._ds[k]
            if not isinstance(row, Mapping):
                raise TypeError(f"train_data rows must be dicts (column -> value); row {k % self.num_prompts} is {type(row).__name__}")
            rows.append({**row, "prompt_index": k})
        return rows

    def epoch(self, position: int) -> float:
        """Epochs consumed at a counter position."""
        return position / self.num_prompts
