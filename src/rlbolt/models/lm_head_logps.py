"""The output projection, log-softmax and entropy of completion tokens, fused, over vocabulary blocks.

    logps, entropy = lm_head_logps(hidden, weight, targets, temperature=t, softcap=c, chunk_tokens=n)

A [B, T, V] float32 logits array is the largest tensor of RL post-training: at V = 152k (Qwen2.5)
and 32 x 1,024 tokens it alone is 20 GB, and autodiff of `log_softmax(hidden @ W)` keeps several
of them (the logits, the softmax, their cotangent). Here both passes run over blocks of vocabulary
columns, every token at once, each block about `chunk_tokens` x V logits in the forward and half that
in the backward (`block_columns`;
block j holds the columns j, j + k, j + 2k, ..., so a vocabulary sharded over tp keeps an equal
share of each block per device), and a custom VJP makes the backward pass recompute the logits
from the hidden states instead of storing them. The forward keeps an online log-sum-exp per token;
what is kept between the passes is one float per token (the log-partition, and the entropy when
asked for); each pass holds a few [tokens, block] float32 arrays at a time. The batch axis is
never cut, so a batch sharded over devices stays so.

Over vocabulary blocks, not token chunks, for two reasons. A block's columns of dW are whole after
one pass, so when the batch is sharded over devices each block is summed across them once, into
the weight's own sharding; over token chunks every device carried a whole [H, V] float32 partial
sum of its own tokens until one all-reduce at the end (2 GiB per chip at Qwen2.5-7B;
benchmarks/RESULTS.md, "The lm_head's gradient in the weight's sharding"). And the weight is read
a block at a time: a forward over token chunks read all of [H, V] in every chunk, which a chip
whose weight is split over fsdp gathered whole (1 GiB per chip at Qwen2.5-7B).

With logits y = cap(h W) / t (cap: Gemma 2's final soft-capping `c * tanh(z / c)`), p = softmax(y),
log p_v = y_v - logsumexp(y), the token's log-prob is log p_target and the entropy is
H = -sum_v p_v log p_v. Their gradients with respect to y are

    d log p_target / d y_v = [v = target] - p_v
    d H / d y_v            = -p_v (log p_v + H)

then d/dz = d/dy / t times (1 - (cap(z) / c)^2) under soft-capping, and dh = dz W^T (summed
over the vocabulary blocks in float32), dW = h^T dz (each block's columns in float32). Matmuls run in the parameter dtype and
logits are upcast to float32, as `Decoder.logits` does, so bfloat16 parameters give the logits
the sampler saw.

`chunk_tokens` 0 or None computes the plain unchunked expression with ordinary autodiff (the
reference the tests compare against, and the "off" setting of `model.logits_chunk_tokens`).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero

# Tokens per chunk: each block holds chunk x V x 4 bytes, one or two at a time (benchmarks/vocab_memory.py).
# 1,024, not 512: on CPU a [tokens, 576] x [576, V] product runs at ~150 GFLOP/s with 1,024 rows and ~127
# with 512, and each chunk adds a pass over the [H, V] gradient; the SmolLM2-shape update at 512 new
# tokens was 0.67 s (9%) faster per micro batch (RESULTS.md, real shapes).
DEFAULT_LOGITS_CHUNK_TOKENS = 1024


def check_chunk_tokens(value, where: str = "chunk_tokens") -> int | None:
    """`value` as a chunk size: a non-negative int, or None; 0 and None mean unchunked.

    Raises:
      ValueError: one line naming `where`, the value and the fix.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{where}={value!r} must be a whole number of tokens >= 1 per output-projection chunk, "
                         f"or 0 / null for no chunking (default {DEFAULT_LOGITS_CHUNK_TOKENS})")
    return int(value)


def lm_head_logps(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *, temperature: float = 1.0,
                  softcap: float | None = None, chunk_tokens: int | None = DEFAULT_LOGITS_CHUNK_TOKENS,
                  with_entropy: bool = False) -> tuple[jax.Array, jax.Array]:
    """log softmax(cap(hidden @ weight) / temperature) at `targets`, and the entropy, over vocabulary blocks.

    Jittable and differentiable with respect to `hidden` and `weight`.

    Args:
      hidden: [B, C, H] final-normed hidden states (the parameter dtype).
      weight: [H, V] the output projection (lm_head's kernel, or the tied embedding table transposed).
      targets: [B, C] int token ids whose log-probabilities are read.
      temperature: a Python number > 0; the logits are divided by it after soft-capping.
      softcap: the final logit soft-capping c (Gemma 2), or None.
      chunk_tokens: sets the vocabulary block: about this many tokens (all rows together) x V logits
        per forward block, half that per backward block (`block_columns`); 0 or None: one unchunked
        pass with ordinary autodiff.
      with_entropy: also return the entropy of each position's distribution (else zeros).

    Returns:
      (logps [B, C] float32, entropy [B, C] float32).
    """
    chunk_tokens = check_chunk_tokens(chunk_tokens)
    temperature = float(temperature)
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0 (greedy sampling trains at temperature 1)")
    softcap = None if softcap is None else float(softcap)
    targets = targets.astype(jnp.int32)
    if not chunk_tokens:
        return _unchunked(hidden, weight, targets, temperature, softcap, with_entropy)
    b, c, h = hidden.shape
    steps = max(1, min(c, chunk_tokens // b))  # positions of every row per chunk
    n_chunks = -(-c // steps)
    pad = n_chunks * steps - c
    # [n_chunks, B, steps, ...]: the scan runs over chunks; padded positions read token 0 and are cut off.
    hidden_chunks = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(b, n_chunks, steps, h).swapaxes(0, 1)
    target_chunks = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n_chunks, steps).swapaxes(0, 1)
    logps, entropy = _fused(hidden_chunks, weight, target_chunks, temperature, softcap, with_entropy)
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n_chunks * steps)[:, :c]  # noqa: E731
    return unchunk(logps), unchunk(entropy)


def _scaled_logits(h, weight, temperature, softcap):
    """(y = cap(h W) / t [..., V] float32, cap(h W) or None): the second feeds the soft-cap's derivative."""
    z = jnp.dot(h, weight).astype(jnp.float32)  # the parameter dtype's product, upcast (Decoder.logits)
    capped = None
    if softcap is not None:
        z = capped = softcap * jnp.tanh(z / softcap)
    return z / temperature, capped


def _unchunked(hidden, weight, targets, temperature, softcap, with_entropy):
    y, _ = _scaled_logits(hidden, weight, temperature, softcap)
    logp_all = jax.nn.log_softmax(y, axis=-1)
    logps = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]
    if not with_entropy:
        return logps, jnp.zeros_like(logps)
    return logps, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(hidden_chunks, weight, target_chunks, temperature, softcap, with_entropy):
    logps, _, entropy = _forward_all(hidden_chunks, weight, target_chunks, temperature, softcap, with_entropy)
    return logps, entropy


def _forward_all(hidden_chunks, weight, target_chunks, temperature, softcap, with_entropy):
    """(logps, log-partition, entropy), each [n, B, s] float32, over vocabulary blocks of every token
    at once (each a whole chunk's logits, the backward's twice), with an online log-sum-exp; with one
    block (few tokens), the one-pass expression per token chunk.

    Per token it carries the running maximum m, s = sum_v exp(y_v - m), u = sum_v exp(y_v - m)(y_v - m)
    and the target's logit; a new maximum m' rescales s by r = exp(m - m') and u to r (u + (m - m') s).
    Then log-partition = m + log s and entropy = log s - u / s. The weight is read one block of columns
    at a time: over token chunks each chunk read all of [H, V], which a chip whose weight is split over
    fsdp gathered whole in every chunk (1 GiB per chip at Qwen2.5-7B: benchmarks/RESULTS.md).
    """
    vocab = weight.shape[-1]
    tokens = hidden_chunks.size // hidden_chunks.shape[-1]
    # Blocks of a whole chunk's logits (the backward's are half: it holds more arrays per block).
    width = block_columns(vocab, tokens, 2 * hidden_chunks.shape[1] * hidden_chunks.shape[2])
    k = -(-vocab // width)
    if k == 1:  # one block holds the vocabulary (few tokens): the one-pass expression per token chunk
        return jax.lax.map(lambda a: _one_pass(a[0], weight, a[1], temperature, softcap, with_entropy),
                           (hidden_chunks, target_chunks))
    padded = _vocab_blocks(weight, width, k)
    shape = hidden_chunks.shape[:-1]

    def one_block(carry, j):
        top, total, spread, picked = carry
        w = _block(padded, j)  # [H, width]
        y, _ = _scaled_logits(hidden_chunks, w, temperature, softcap)  # [n, B, s, width]
        ids = jnp.arange(width, dtype=jnp.int32) * k + j
        y = jnp.where(ids < vocab, y, -jnp.inf)  # the padding columns are no token
        new_top = jnp.maximum(top, jnp.max(y, axis=-1))  # finite: column j < V is in every block
        rescale = jnp.exp(top - new_top)
        shift = jnp.where(jnp.isfinite(top), top - new_top, 0.0)  # 0 before the first block
        centred = y - new_top[..., None]
        e = jnp.exp(centred)
        total_new = total * rescale + jnp.sum(e, axis=-1)
        if with_entropy:
            spread = rescale * (spread + shift * total) + jnp.sum(jnp.where(ids < vocab, e * centred, 0.0), axis=-1)
        picked = picked + jnp.sum(jnp.where(ids == target_chunks[..., None], y, 0.0), axis=-1)
        return (new_top, total_new, spread, picked), None

    zeros = jnp.zeros(shape, jnp.float32)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), zeros, zeros, zeros)
    (top, total, spread, picked), _ = jax.lax.scan(one_block, init, jnp.arange(k, dtype=jnp.int32))
    lse = top + jnp.log(total)
    entropy = jnp.log(total) - spread / total if with_entropy else zeros
    return picked - lse, lse, entropy


def _one_pass(h, weight, targets, temperature, softcap, with_entropy):
    """(logps, log-partition, entropy) of one token chunk over the whole vocabulary at once."""
    y, _ = _scaled_logits(h, weight, temperature, softcap)
    lse = jax.nn.logsumexp(y, axis=-1)
    logps = jnp.take_along_axis(y, targets[..., None], axis=-1)[..., 0] - lse
    if not with_entropy:
        return logps, lse, jnp.zeros_like(lse)
    logp_all = y - lse[..., None]
    return logps, lse, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


def _vocab_blocks(weight, width, k):
    """[H, V] as [H, width, k] (zero columns past V): block j is the strided columns j, j + k, ...;
    one block (k = 1): the weight itself, no padded copy."""
    if k == 1:
        return weight
    return jnp.pad(weight, ((0, 0), (0, width * k - weight.shape[-1]))).reshape(weight.shape[0], width, k)


def _block(padded, j):
    """Block j of `_vocab_blocks`' result, [H, width]."""
    if padded.ndim == 2:
        return padded
    return jax.lax.dynamic_index_in_dim(padded, j, axis=2, keepdims=False)


def _fused_fwd(hidden_chunks, weight, target_chunks, temperature, softcap, with_entropy):
    # Symbolic zeros: each argument comes as (value, perturbed), so the backward forms only the
    # gradients asked for (a frozen lm_head or tied table, as under LoRA, gets no [H, V] product).
    wanted = (hidden_chunks.perturbed, weight.perturbed)
    hidden_chunks, weight, target_chunks = hidden_chunks.value, weight.value, target_chunks.value
    logps, lse, entropy = _forward_all(hidden_chunks, weight, target_chunks, temperature, softcap, with_entropy)
    # Kept for the backward: the inputs (already alive) and one or two floats per token.
    return (logps, entropy), (hidden_chunks, weight, target_chunks, lse, entropy, wanted)


def _fused_bwd(temperature, softcap, with_entropy, residuals, cotangents):
    *arrays, (want_hidden, want_weight) = residuals
    # The barrier keeps XLA from merging the recomputed logits with the forward's (one jit holds both
    # passes): merged, a single-chunk call would keep the forward's logits alive into the backward.
    hidden_chunks, weight, target_chunks, lse_chunks, entropy_chunks = jax.lax.optimization_barrier(tuple(arrays))
    g_logps, g_entropy = (None if isinstance(g, SymbolicZero) else g for g in cotangents)
    if not with_entropy:
        g_entropy = None
    if (g_logps is None and g_entropy is None) or not (want_hidden or want_weight):
        return None, None, None
    compute = jnp.result_type(hidden_chunks.dtype, weight.dtype)  # the dtype of the forward's product
    vocab = weight.shape[-1]
    tokens = hidden_chunks.size // hidden_chunks.shape[-1]
    # Over vocabulary blocks of every token at once, each block's logits about half the forward's chunk
    # of tokens x V: a block's dW columns are whole after one pass, so a batch sharded over devices sums
    # each block once across them, into the weight's own sharding, instead of carrying a whole [H, V]
    # float32 partial sum through every token chunk. Block j is the strided columns j, j + k, j + 2k, ...
    # ([H, V] seen as [H, width, k]): a vocabulary sharded over tp in contiguous pieces puts an equal
    # share of every block on each tp device, so no block is gathered or computed twice.
    width = block_columns(vocab, tokens, hidden_chunks.shape[1] * hidden_chunks.shape[2])
    k = -(-vocab // width)
    padded = _vocab_blocks(weight, width, k)

    def one_block(carry, j):
        grad_weight, grad_hidden = carry
        w = _block(padded, j)  # [H, width]
        y, capped = _scaled_logits(hidden_chunks, w, temperature, softcap)  # [n, B, s, width]
        logp_all = y - lse_chunks[..., None]
        p = jnp.exp(logp_all)
        ids = jnp.arange(width, dtype=jnp.int32) * k + j
        grad_y = jnp.zeros_like(y)
        if g_logps is not None:
            grad_y = jnp.where(ids == target_chunks[..., None], g_logps[..., None], 0.0) - p * g_logps[..., None]
        if g_entropy is not None:
            grad_y = grad_y - p * (logp_all + entropy_chunks[..., None]) * g_entropy[..., None]
        grad_z = grad_y / temperature
        if softcap is not None:
            grad_z = grad_z * (1.0 - jnp.square(capped / softcap))
        grad_z = jnp.where(ids < vocab, grad_z, 0.0).astype(compute)  # the padding columns are no token
        if want_hidden:  # grad_z w^T as one contraction over the block (no transposed copy of the table)
            grad_hidden = grad_hidden + jnp.einsum("nbsv,hv->nbsh", grad_z, w, preferred_element_type=jnp.float32)
        if want_weight:
            block = jnp.einsum("nbsh,nbsv->hv", hidden_chunks, grad_z, preferred_element_type=jnp.float32)
            grad_weight = (block if padded.ndim == 2
                           else jax.lax.dynamic_update_index_in_dim(grad_weight, block, j, axis=2))
        return (grad_weight, grad_hidden), None

    init = (jnp.zeros(padded.shape, jnp.float32) if want_weight else None,
            jnp.zeros(hidden_chunks.shape, jnp.float32) if want_hidden else None)
    (grad_weight, grad_hidden), _ = jax.lax.scan(one_block, init, jnp.arange(k, dtype=jnp.int32))
    if grad_weight is not None:
        grad_weight = grad_weight.reshape(weight.shape[0], width * k)[:, :vocab].astype(weight.dtype)
    return (None if grad_hidden is None else grad_hidden.astype(hidden_chunks.dtype), grad_weight, None)


def block_columns(vocab: int, tokens: int, chunk_tokens: int) -> int:
    """Vocabulary columns per block of both passes: about half of `chunk_tokens` x `vocab` logits over
    all `tokens` (half a chunk: a backward block's pass holds four such float32 blocks at once, the
    logits, their softmax and the cotangent once per product, where a token chunk held about three),
    whole multiples of 128 (a TPU lane: a narrower block would be padded to it in memory anyway, and tp
    divides it), or the whole vocabulary when that is smaller.

    Args:
      vocab: V, the vocabulary size.
      tokens: the tokens of the call, all rows and padded positions together.
      chunk_tokens: `model.logits_chunk_tokens`: a block holds about chunk_tokens / 2 x vocab logits.

    Returns:
      The block width, between 1 and `vocab`.
    """
    width = -(-vocab * chunk_tokens // max(2 * tokens, 1))
    return min(vocab, max(1, -(-width // 128)) * 128)


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
