"""The embedding lookup on a mesh, without gathering the table, its gradient formed in the table's shards.

    x = embed_lookup(table, ids, stored=..., read=..., rows=...)

Read as every fsdp weight is (the table [V, H] gathered over fsdp to [V / tp, H] on every chip, then
`jnp.take`), the lookup holds the whole table per chip in the forward (twice at the peak: the gathered
table and a copy in the gather's layout), and autodiff's backward scatter-adds every chip's token
cotangents into another whole [V / tp, H], all-reduced whole (the TPU compile of the update): at
Qwen2.5-1.5B (151,936 x 1,536, bf16) 0.43 GiB each, at Gemma-3-12B (262,144 x 3,840) 1.9 GiB each, where
the chip's shard is 1/fsdp of that (benchmarks/RESULTS.md, "The embedding table read whole").

Here both passes run under a `jax.shard_map` over the whole mesh, each chip touching only its shard
[V / tp, H / fsdp] of the table (its stored sharding, `stored`):

- forward: the ids are all-gathered over the axis that shards the table's hidden axis (fsdp, which
  also splits the rows), each chip looks every id of its fsdp group up in its shard (ids outside its
  vocabulary range, tp, read zeros, summed over tp: exact), and an `all_to_all` returns each chip its
  own tokens with all H columns (the same bytes as the activations);
- backward: the transpose: the cotangents' columns go to the chip holding them (`all_to_all`), each
  chip scatter-adds the ids of its vocabulary range into a float32 [V / tp, H / fsdp] zero block (other
  ids dropped), sums it over the axes whose chips hold other tokens of the same shard (data, expert,
  context: the table is replicated over them) and casts it to the table's dtype.

The forward's values are the plain lookup's, bit for bit; the gradient's are the same sums in another
order (float32 accumulation, one rounding to the table's dtype). A layout it does not cover (a table
axis over several mesh axes, the vocabulary over a batch axis, rows that do not divide the batch
shards) takes the plain lookup and autodiff.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P


def embed_lookup(table: jax.Array, ids: jax.Array, *, stored: NamedSharding | None, read: NamedSharding | None,
                 rows: NamedSharding | None) -> jax.Array:
    """`table[ids]` read in `read`; its backward forms the table's gradient in `stored`, shard by shard.

    Args:
      table: [V, H] the embedding table.
      ids: [B, T] int token ids in [0, V).
      stored: the table's own sharding (its gradient's), e.g. P("tp", "fsdp"); None: plain lookup.
      read: the sharding the table is read in, e.g. P("tp", None); None: the table as it lies.
      rows: the [B, T, H] activations' sharding (rows over the batch axes, tokens over context, hidden
        whole); None: plain lookup.

    Returns:
      [B, T, H] the rows of `table`, in the table's dtype.
    """
    axes = _layout(table.shape, ids.shape, stored, rows)
    if axes is None:
        if read is not None:
            table = jax.lax.with_sharding_constraint(table, read)
        return jnp.take(table, ids, axis=0)
    return _lookup(table, ids, read, stored.mesh, *axes)


def _one_axis(entry) -> str | None | bool:
    """A spec entry as one mesh axis name, None, or False when it names several axes."""
    if entry is None or isinstance(entry, str):
        return entry
    names = tuple(entry)
    return names[0] if len(names) == 1 else (None if not names else False)


def _layout(table_shape, ids_shape, stored, rows):
    """(vocab axis, hidden axis, row spec, axes to sum over) of a covered layout, else None."""
    if stored is None or rows is None or stored.mesh != rows.mesh:
        return None
    mesh = stored.mesh
    spec = tuple(stored.spec) + (None,) * (2 - len(stored.spec))
    vocab, hidden = _one_axis(spec[0]), _one_axis(spec[1])
    row_spec = tuple(rows.spec)[:2] + (None,) * (2 - len(tuple(rows.spec)[:2]))
    batch = row_spec[0] if isinstance(row_spec[0], tuple) else (() if row_spec[0] is None else (row_spec[0],))
    tokens = row_spec[1] if isinstance(row_spec[1], tuple) else (() if row_spec[1] is None else (row_spec[1],))
    split = tuple(batch) + tuple(tokens)  # axes over which the chips hold different tokens
    if vocab is False or hidden is False or (vocab is not None and vocab in split) or hidden in tokens:
        return None
    shards = [math.prod(mesh.shape[a] for a in batch), math.prod(mesh.shape[a] for a in tokens)]
    if ids_shape[0] % shards[0] or ids_shape[1] % shards[1]:
        return None  # rows the activations leave to XLA (a one-row probe): the plain path
    if (vocab is not None and table_shape[0] % mesh.shape[vocab]
            or hidden is not None and table_shape[1] % mesh.shape[hidden]):
        return None
    summed = tuple(a for a in split if a != hidden and mesh.shape[a] > 1)
    return vocab, hidden, P(*row_spec), summed


def _lookup(table, ids, read, mesh, vocab, hidden, row_spec, summed):
    hidden_splits_rows = hidden is not None and hidden in tuple(jax.tree.leaves(tuple(row_spec)))

    v_shard = table.shape[0] // (1 if vocab is None else mesh.shape[vocab])

    def in_range(ids):  # the chip's vocabulary rows: ids - its first row, v_shard (out of range) elsewhere
        if vocab is None:
            return ids
        local = ids - jax.lax.axis_index(vocab) * v_shard
        return jnp.where((local >= 0) & (local < v_shard), local, v_shard)

    def local_rows(table, ids):  # one chip: its [V / tp, H / fsdp] shard, ids [b, t] -> rows [b, t, H]
        if hidden_splits_rows:
            ids = jax.lax.all_gather(ids, hidden, axis=0, tiled=True)  # every token of the hidden axis' group
        local = in_range(ids)
        rows = jnp.take(table, local, axis=0, mode="fill", fill_value=0)  # out of range: zeros
        if vocab is not None:
            rows = jax.lax.psum(rows, vocab)  # one chip holds each row, the others add zeros: exact
        if hidden_splits_rows:  # back to the chip's own tokens, all columns
            return jax.lax.all_to_all(rows, hidden, split_axis=0, concat_axis=2, tiled=True)
        if hidden is not None:
            return jax.lax.all_gather(rows, hidden, axis=2, tiled=True)
        return rows

    @jax.custom_vjp
    def lookup(table, ids):  # the table is never gathered: each chip looks its ids up in its shard
        return jax.shard_map(local_rows, mesh=mesh, in_specs=(P(vocab, hidden), row_spec),
                             out_specs=P(*row_spec, None), check_vma=False)(table, ids)

    def fwd(table, ids):
        return lookup(table, ids), (ids, jnp.zeros((0,), table.dtype))

    def local_grad(ids, g):  # one chip: ids [b, t], g [b, t, H] -> its [V / tp, H / fsdp] shard, float32
        if hidden is not None:
            if hidden_splits_rows:  # its columns of every token of the hidden axis' group
                g = jax.lax.all_to_all(g, hidden, split_axis=2, concat_axis=0, tiled=True)
                ids = jax.lax.all_gather(ids, hidden, axis=0, tiled=True)
            else:  # the cotangents are whole on each chip of the axis: take its columns
                width = table.shape[1] // mesh.shape[hidden]
                g = jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(hidden) * width, width, axis=2)
        local = in_range(ids)  # v_shard: dropped below
        grad = jnp.zeros((v_shard, g.shape[-1]), jnp.float32)
        grad = grad.at[local.reshape(-1)].add(g.reshape(-1, g.shape[-1]).astype(jnp.float32), mode="drop")
        return jax.lax.psum(grad, summed) if summed else grad

    def bwd(residuals, g):
        ids, dtype_of = residuals
        grad = jax.shard_map(local_grad, mesh=mesh, in_specs=(row_spec, P(*row_spec, None)),
                             out_specs=P(vocab, hidden), check_vma=False)(ids, g)
        return grad.astype(dtype_of.dtype), None

    lookup.defvjp(fwd, bwd)
    return lookup(table, ids)
