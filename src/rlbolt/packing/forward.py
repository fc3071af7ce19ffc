"""Device side of padding-free packing: per-token log-probabilities over packed rows.

The padded forward runs each sample in a row of its own, `prompt | completion`, P + C tokens
wide. The packed forward scatters each sample's real tokens into its packed row
(`rlbolt.packing.layout`: `pack_rows`, `pack_starts`), with positions restarting at 0 and a
segment id per sample so attention never crosses samples (`Decoder(segment_ids=...)`), runs the
model over the packed tokens, then the chunked output projection over the states that predict a
completion token only (`pack_sources`: a prompt's states predict nothing that is trained or scored),
and puts each completion token's log-probability back to its [N, C] place. The losses, KL terms and metrics then see the
same [N, C] arrays as on the padded path, so every aggregation mode and mask (an episode's
environment tokens are context, never trained) is unchanged; only float rounding differs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.models.lm_head_logps import DEFAULT_LOGITS_CHUNK_TOKENS, lm_head_logps


def _block_layout(ids, mask, pack_rows, pack_starts, row_tokens):
    """One block's samples [m, T] -> packed (ids, positions, segments) [R, L] and each token's
    (packed row [m], packed column [m, T]); a padding token's column is L (outside the row)."""
    rank = jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1  # position within the sample
    row = jnp.argmax(pack_rows, axis=1).astype(jnp.int32)
    col = jnp.where(mask, pack_starts[:, None] + rank, row_tokens)
    rows = jnp.broadcast_to(row[:, None], col.shape)
    shape = (pack_rows.shape[1], row_tokens)
    segment = jnp.broadcast_to(jnp.arange(1, ids.shape[0] + 1, dtype=jnp.int32)[:, None], col.shape)

    def scatter(values):
        return jnp.zeros(shape, jnp.int32).at[rows, col].set(values.astype(jnp.int32), mode="drop")

    return scatter(ids), scatter(jnp.maximum(rank, 0)), scatter(segment), row, col


def packed_sequence_logps(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids: jax.Array, prompt_mask: jax.Array,
                          completion_ids: jax.Array, completion_mask: jax.Array, pack_rows: jax.Array,
                          pack_starts: jax.Array, pack_sources: jax.Array | None = None, *, row_tokens: int | None,
                          blocks: int = 1,
                          temperature: float = 1.0, with_entropy: bool = False,
                          chunk_size: int | None = DEFAULT_LOGITS_CHUNK_TOKENS) -> tuple[jax.Array, jax.Array | None]:
    """(logps [N, C], entropy [N, C] or None) of the completion tokens, computed over packed rows.

    Equal to `rlbolt.models.logps.sequence_logps` (to float32 rounding) for samples with at least
    one prompt token. Jittable and differentiable with respect to `params`.

    Args:
      graphdef: the model's `nnx.GraphDef`.
      params: the model's `nnx.State`.
      prompt_ids: [N, P] int32, left-padded.
      prompt_mask: [N, P] bool.
      completion_ids: [N, C] int32, right-padded.
      completion_mask: [N, C] bool: the tokens the forward runs (an episode's `sequence_mask`).
      pack_rows: [N, R] bool, each sample's packed row within its block (`pack_columns`).
      pack_starts: [N] int32, each sample's first column in that row.
      pack_sources: [N, S] int32 (`rlbolt.packing.layout.pack_sources`): the output projection runs over
        these predicting states only (m x S per block); None: over every packed token, or over the
        N x C gathered states where those are fewer.
      row_tokens: L, tokens per packed row; None: P + C.
      blocks: contiguous blocks the N samples were packed in apart (the batch shards).
      temperature: logits are divided by it before the log-softmax.
      with_entropy: also return the entropy.
      chunk_size: tokens per output-projection chunk (`model.logits_chunk_tokens`); 0 or None: unchunked.

    Returns:
      (logps [N, C] float32, entropy [N, C] float32 or None), 0 where completion_mask is False.
    """
    model = nnx.merge(graphdef, params)
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    length = p + c if row_tokens is None else int(row_tokens)
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
    n, r = ids.shape[0], pack_rows.shape[1]

    def by_block(x):
        return x.reshape(blocks, n // blocks, *x.shape[1:])

    layout = jax.vmap(lambda *a: _block_layout(*a, length))
    packed_ids, positions, segments, row, col = layout(by_block(ids), by_block(mask), by_block(pack_rows),
                                                       by_block(pack_starts))
    flat = (blocks * r, length)
    packed_ids, positions, segments = (x.reshape(flat) for x in (packed_ids, positions, segments))
    hidden, _ = model(packed_ids, positions, attention_mask=segments > 0, segment_ids=segments, return_hidden=True)
    # Completion token t of a sample sits at packed column col[:, P + t]; the column before predicts it.
    before = jnp.clip(col[:, :, p:] - 1, 0, length - 1)  # [blocks, m, C]
    mask = completion_mask.astype(bool)

    def gather(values):  # [blocks * R, L, ...] -> [N, C, ...]
        per_block = values.reshape(blocks, r, length, *values.shape[2:])
        picked = jax.vmap(lambda v, rw, cl: v[rw[:, None], cl])(per_block, row, before)
        return picked.reshape(n, c, *values.shape[2:])

    head = functools.partial(lm_head_logps, temperature=temperature, softcap=model.config.final_logit_softcapping,
                             chunk_tokens=chunk_size, with_entropy=with_entropy)
    if pack_sources is not None:  # over the predicting states of the forward tokens only, then back to [N, C]
        logps, entropy = _over_sources(head, hidden, packed_ids, pack_sources, mask, model.output_weight(), blocks)
    elif blocks * r * length <= n * c:  # the output projection over the packed tokens (each predicts its successor)
        targets = jnp.concatenate([packed_ids[:, 1:], jnp.zeros((flat[0], 1), jnp.int32)], axis=1)
        logps, entropy = (gather(x) for x in head(hidden, model.output_weight(), targets))
    else:  # fewer rows x completion slots than packed tokens (long prompts): over the predicting states only
        logps, entropy = head(gather(hidden), model.output_weight(), completion_ids.astype(jnp.int32))
    return jnp.where(mask, logps, 0.0), (jnp.where(mask, entropy, 0.0) if with_entropy else None)

def _over_sources(head, hidden, packed_ids, pack_sources, mask, weight, blocks):
    """(logps, entropy) [N, C] from the output projection over each block's `pack_sources` states.

    Block b's K = m x S sources list its forward tokens' predictors, samples in order, tokens in
    order, so forward token j of the block (row-major over its [m, C] mask) reads compact slot j."""
    n, c = mask.shape
    tokens = hidden.shape[0] * hidden.shape[1] // blocks  # R x L packed tokens per block
    sources = pack_sources.reshape(blocks, -1)  # [blocks, K]
    states = jnp.take_along_axis(hidden.reshape(blocks, tokens, -1), sources[..., None], axis=1)  # [blocks, K, H]
    # The token a state predicts is the packed token after it (the forward token itself).
    targets = jnp.take_along_axis(packed_ids.reshape(blocks, tokens), jnp.minimum(sources + 1, tokens - 1), axis=1)
    logps, entropy = head(states, weight, targets)  # [blocks, K]
    flat = mask.reshape(blocks, -1)
    slot = jnp.clip(jnp.cumsum(flat.astype(jnp.int32), axis=1) - 1, 0, sources.shape[1] - 1)

    def back(values):
        return jnp.take_along_axis(values, slot, axis=1).reshape(n, c)
    return back(logps), back(entropy)


__all__ = ["packed_sequence_logps"]
