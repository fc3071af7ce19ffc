"""The output projection, log-softmax and entropy of completion tokens, fused and chunked over tokens.

    logps, entropy = lm_head_logps(hidden, weight, targets, temperature=t, softcap=c, chunk_tokens=n)

A [B, T, V] float32 logits array is the largest tensor of RL post-training: at V = 152k (Qwen2.5)
and 32 x 1,024 tokens it alone is 20 GB, and autodiff of `log_softmax(hidden @ W)` keeps several
of them (the logits, the softmax, their cotangent). Here the projection runs over chunks of about
`chunk_tokens` tokens (every row's next `max(1, chunk_tokens // B)` positions: the batch axis is
never cut, so a batch sharded over devices stays so), and a custom VJP makes the backward pass
recompute the logits from the hidden states instead of storing them. What is kept between the
passes is one float per token (the log-partition, and the entropy when asked for); each pass holds
one or two [B, chunk, V] float32 blocks at a time.

The backward runs over blocks of vocabulary columns, every token at once (about half a forward
chunk of logits per block, `block_columns`; block j holds the columns j, j + k, j + 2k, ..., so a
vocabulary sharded over tp keeps an equal share of each block per device), not over token chunks: a block's columns of dW are
whole after one pass, so when the batch is sharded over devices each block is summed across them
once, into the weight's own sharding. Over token chunks every device carried a whole [H, V]
float32 partial sum of its own tokens until one all-reduce at the end (2 GiB per chip at
Qwen2.5-7B; benchmarks/RESULTS.md, "The lm_head's gradient in the weight's sharding").

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
    """log softmax(cap(hidden @ weight) / temperature) at `targets`, and the entropy, chunked over tokens.

    Jittable and differentiable with respect to `hidden` and `weight`.

    Args:
      hidden: [B, C, H] final-normed hidden states (the parameter dtype).
      weight: [H, V] the output projection (lm_head's kernel, or the tied embedding table transposed).
      targets: [B, C] int token ids whose log-probabilities are read.
      temperature: a Python number > 0; the logits are divided by it after soft-capping.
      softcap: the final logit soft-capping c (Gemma 2), or None.
      chunk_tokens: tokens per chunk, all rows together (each chunk is B x max(1, chunk_tokens // B)
        positions); 0 or None: one unchunked pass with ordinary autodiff.
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


def _chunk_forward(h, weight, targets, temperature, softcap, with_entropy):
    """One chunk: (logps, log-partition, entropy), each [B, steps] float32."""
    y, _ = _scaled_logits(h, weight, temperature, softcap)
    lse = jax.nn.logsumexp(y, axis=-1)
    logps = jnp.take_along_axis(y, targets[..., None], axis=-1)[..., 0] - lse
    if not with_entropy:
        return logps, lse, jnp.zeros_like(lse)
    logp_all = y - lse[..., None]
    return logps, lse, -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(hidden_chunks, weight, target_chunks, temperature, softcap, with_entropy):
    logps, _, entropy = _forward_all(hidden_chunks, weight, target_chunks, temperature, softcap, with_entropy)
    return logps, entropy


def _forward_all(hidden_chunks, weight, target_chunks, temperature, softcap, with_entropy):
    one = lambda args: _chunk_forward(args[0], weight, args[1], temperature, softcap, with_entropy)  # noqa: E731
    return jax.lax.map(one, (hidden_chunks, target_chunks))


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
    padded = jnp.pad(weight, ((0, 0), (0, width * k - vocab))).reshape(weight.shape[0], width, k)

    def one_block(carry, j):
        grad_weight, grad_hidden = carry
        w = jax.lax.dynamic_index_in_dim(padded, j, axis=2, keepdims=False)  # [H, width]
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
            grad_weight = jax.lax.dynamic_update_index_in_dim(grad_weight, block, j, axis=2)
        return (grad_weight, grad_hidden), None

    init = (jnp.zeros(padded.shape, jnp.float32) if want_weight else None,
            jnp.zeros(hidden_chunks.shape, jnp.float32) if want_hidden else None)
    (grad_weight, grad_hidden), _ = jax.lax.scan(one_block, init, jnp.arange(k, dtype=jnp.int32))
    if grad_weight is not None:
        grad_weight = grad_weight.reshape(weight.shape[0], width * k)[:, :vocab].astype(weight.dtype)
    return (None if grad_hidden is None else grad_hidden.astype(hidden_chunks.dtype), grad_weight, None)


def block_columns(vocab: int, tokens: int, chunk_tokens: int) -> int:
    """Vocabulary columns per block of the backward: about half of `chunk_tokens` x `vocab` logits over
    all `tokens` (half the forward's chunk: a block's pass holds four such float32 blocks at once, the
    logits, their softmax and the cotangent once per product, where a token chunk held about three),
    whole multiples of 128 (a TPU lane: a narrower block would be padded to it in memory anyway, and tp
    divides it), or the whole vocabulary when that is smaller.

    Args:
      vocab: V, the vocabulary size.
      tokens: the tokens of the call, all rows and padded positions together.
      chunk_tokens: the forward's tokens per chunk (every row's positions of one chunk).

    Returns:
      The block width, between 1 and `vocab`.
    """
    width = -(-vocab * chunk_tokens // max(2 * tokens, 1))
    return min(vocab, max(1, -(-width // 128)) * 128)


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
