"""The output projection, log-softmax and entropy of completion tokens, fused and chunked over tokens.

    logps, entropy = lm_head_logps(hidden, weight, targets, temperature=t, softcap=c, chunk_tokens=n)

A [B, T, V] float32 logits array is the largest tensor of RL post-training: at V = 152k (Qwen2.5)
and 32 x 1,024 tokens it alone is 20 GB, and autodiff of `log_softmax(hidden @ W)` keeps several
of them (the logits, the softmax, their cotangent). Here the projection runs over chunks of about
`chunk_tokens` tokens (every row's next `max(1, chunk_tokens // B)` positions: the batch axis is
never cut, so a batch sharded over devices stays so), and a custom VJP makes the backward pass
recompute each chunk's logits from the hidden states instead of storing them. What is kept
between the passes is one float per token (the log-partition, and the entropy when asked for);
each pass holds one or two [B, chunk, V] float32 blocks at a time.

With logits y = cap(h W) / t (cap: Gemma 2's final soft-capping `c * tanh(z / c)`), p = softmax(y),
log p_v = y_v - logsumexp(y), the token's log-prob is log p_target and the entropy is
H = -sum_v p_v log p_v. Their gradients with respect to y are

    d log p_target / d y_v = [v = target] - p_v
    d H / d y_v            = -p_v (log p_v + H)

then d/dz = d/dy / t times (1 - (cap(z) / c)^2) under soft-capping, and dh = dz W^T,
dW = sum over chunks of h^T dz (accumulated in float32). Matmuls run in the parameter dtype and
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

    def one_chunk(grad_weight, args):
        h, targets, lse, entropy, g_lp, g_ent = args  # [B, s, H], then [B, s] each (None: a zero cotangent)
        y, capped = _scaled_logits(h, weight, temperature, softcap)
        logp_all = y - lse[..., None]
        p = jnp.exp(logp_all)
        grad_y = jnp.zeros_like(y)
        if g_lp is not None:
            vocab = jnp.arange(y.shape[-1], dtype=jnp.int32)
            grad_y = jnp.where(vocab == targets[..., None], g_lp[..., None], 0.0) - p * g_lp[..., None]
        if g_ent is not None:
            grad_y = grad_y - p * (logp_all + entropy[..., None]) * g_ent[..., None]
        grad_z = grad_y / temperature
        if softcap is not None:
            grad_z = grad_z * (1.0 - jnp.square(capped / softcap))
        grad_z = grad_z.astype(compute)
        # grad_z W^T as one contraction over V (no transposed copy of the table is formed).
        grad_h = jnp.einsum("bsv,hv->bsh", grad_z, weight).astype(hidden_chunks.dtype) if want_hidden else None
        if want_weight:
            grad_weight = grad_weight + jnp.einsum("bsh,bsv->hv", h, grad_z, preferred_element_type=jnp.float32)
        return grad_weight, grad_h

    init = jnp.zeros(weight.shape, jnp.float32) if want_weight else None
    grad_weight, grad_hidden = jax.lax.scan(
        one_chunk, init, (hidden_chunks, target_chunks, lse_chunks, entropy_chunks, g_logps, g_entropy))
    return grad_hidden, None if grad_weight is None else grad_weight.astype(weight.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
