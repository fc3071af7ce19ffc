"""The jitted log-prob forwards (old, reference, teacher logps) over packed rows.

`PackedLogps` has the call signature of the padded forward it replaces (`jax.jit` of
`rlbolt.models.logps.token_logps`), so the module swaps one for the other when `plan.packing`
is on. It packs the whole batch it is given on the host (one block per batch shard of the mesh),
then runs `packed_sequence_logps` jitted. Calls it cannot pack run the padded forward: router
replay (the recorded experts are in the padded token order), and arrays another process holds
part of (the host cannot read their masks).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from rlbolt.packing.forward import packed_sequence_logps
from rlbolt.packing.layout import PackingSpec, pack_columns, pack_sources, sample_lengths, source_slots

log = logging.getLogger(__name__)


class PackedLogps:
    """`(params, prompt_ids, prompt_mask, completion_ids, completion_mask, *, group_size, routing) -> logps [N, C]`.

    Args:
      graphdef: the model's `nnx.GraphDef`.
      padded: the padded jitted forward with the same signature (used where packing cannot apply).
      spec: the PackingSpec (`plan.packed_row_tokens`).
      sharding: the ShardingPlan the inputs are placed with, or None (host arrays).
      options: the logps options (temperature, chunk_size).
    """

    def __init__(self, graphdef: nnx.GraphDef, padded: Callable, spec: PackingSpec, sharding: Any = None,
                 **options: Any):
        self.padded, self.spec, self.sharding = padded, spec, sharding
        rows = {} if sharding is None else {"out_shardings": sharding.batch_sharding()}
        self._packed = jax.jit(functools.partial(_logps_only, graphdef, **options),
                               static_argnames=("row_tokens", "blocks"), **rows)

    def __call__(self, params: Any, prompt_ids: Any, prompt_mask: Any, completion_ids: Any, completion_mask: Any, *,
                 group_size: int = 1, routing: Any = None) -> jax.Array:
        """The completion tokens' logps [N, C], packed where possible.

        Args:
          params: the model's parameters.
          prompt_ids: [N, P] int32, left-padded.
          prompt_mask: [N, P] bool.
          completion_ids: [N, C] int32.
          completion_mask: [N, C] bool (an episode's sequence_mask).
          group_size: the padded forward's prompt sharing (moot when packed).
          routing: router replay's recorded experts (runs the padded forward), or None.
        """
        masks = (prompt_mask, completion_mask)
        readable = all(not isinstance(m, jax.Array) or m.is_fully_addressable for m in masks)
        if routing is not None or not readable:
            return self.padded(params, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=group_size,
                               **({} if routing is None else {"routing": routing}))
        pm, cm = (np.asarray(m) for m in masks)
        n = pm.shape[0]
        shards = 1 if self.sharding is None else self.sharding.batch_shards
        blocks = shards if n % shards == 0 else 1
        spec = PackingSpec(self.spec.row_tokens, blocks)  # rows as this batch needs (plan.packed_rows is the update's)
        width = pm.shape[1] + cm.shape[1]
        cols = pack_columns(sample_lengths(pm, cm), n, spec, width)
        placed = (cols["pack_rows"], cols["pack_starts"], pack_sources(pm, cm, cols, n, spec, width))
        if self.sharding is not None:
            placed = self.sharding.put_full(placed)
        return self._packed(params, prompt_ids, prompt_mask, completion_ids, completion_mask, *placed,
                            row_tokens=self.spec.row_tokens, blocks=blocks)

    def lower_packed(self, params: Any, prompt_ids: Any, prompt_mask: Any, completion_ids: Any, completion_mask: Any, *,
                     rows_per_block: int, blocks: int) -> Any:
        """The packed forward lowered for abstract inputs (`rlbolt plan`), `rows_per_block` packed rows per block.

        Args:
          params: the parameters (arrays or ShapeDtypeStructs).
          prompt_ids: [N, P] (a ShapeDtypeStruct).
          prompt_mask: [N, P].
          completion_ids: [N, C].
          completion_mask: [N, C].
          rows_per_block: R, packed rows per block.
          blocks: blocks the N samples are packed in (the batch shards).
        """
        n, completion = completion_ids.shape
        place = {} if self.sharding is None else {"sharding": self.sharding.batch_sharding()}
        rows = jax.ShapeDtypeStruct((n, rows_per_block), np.bool_, **place)
        starts = jax.ShapeDtypeStruct((n,), np.int32, **place)
        length = PackingSpec(self.spec.row_tokens).width(prompt_ids.shape[1] + completion)
        slots = source_slots(max(1, n // blocks), completion, length)  # the most a block can need
        sources = jax.ShapeDtypeStruct((n, slots), np.int32, **place)
        return self._packed.lower(params, prompt_ids, prompt_mask, completion_ids, completion_mask, rows, starts,
                                  sources, row_tokens=self.spec.row_tokens, blocks=blocks)


def _logps_only(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, pack_rows, pack_starts,
                pack_sources=None, *, row_tokens, blocks, temperature, chunk_size):
    logps, _ = packed_sequence_logps(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                     pack_rows, pack_starts, pack_sources, row_tokens=row_tokens, blocks=blocks,
                                     temperature=temperature, chunk_size=chunk_size)
    return logps


__all__ = ["PackedLogps"]
