"""One token per row from a step's logits: the sampling options (`SamplingParams`), top-k /
top-p filtering and the draw itself: inverse-CDF sampling from two uniforms per row and step.

The uniforms come from the caller (`step_uniforms`, one key per sample folded with the step), so
these functions hold no RNG state and a token depends only on its row. Two uniforms per row
replace the Gumbel-max draw's one Gumbel per vocabulary entry: at V = 49,152 that noise was ~20 ms
of a ~120 ms decode step on CPU (same distribution; different tokens for the same key).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling options (part of the compile key).

    Attributes:
      max_new_tokens: C, completion length (static).
      temperature: 0 means greedy.
      top_k: keep the k most likely tokens; 0 disables.
      top_p: nucleus sampling mass; 1.0 disables.
      stop_token_ids: a row stops after sampling any of these.
      pad_id: written after a row stops and used to left-pad prompts.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    pad_id: int = 0

    def validate(self, vocab_size: int) -> "SamplingParams":
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1.")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        if not 0 <= self.top_k <= vocab_size:
            raise ValueError(f"top_k={self.top_k} must be in [0, vocab_size={vocab_size}] (0 disables).")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 disables).")
        bad = [t for t in self.stop_token_ids + (self.pad_id,) if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids/pad_id {bad} are outside the vocabulary [0, {vocab_size}).")
        return self


def _filter_top_k_top_p(scaled: jnp.ndarray, top_k: int, top_p: float) -> jnp.ndarray:
    """Sets logits outside the top-k / nucleus set to -inf (HF order: top-k, then top-p). [B, V]."""
    if top_k > 0:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    if top_p < 1.0:
        sorted_desc = -jnp.sort(-scaled, axis=-1)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the top token always stays.
        kept = jnp.where(mass_before < top_p, sorted_desc, jnp.inf)
        threshold = jnp.min(kept, axis=-1, keepdims=True)
        scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
    return scaled


# Inverse-CDF sampling runs in two levels over blocks of this many vocabulary entries: a block by
# the blocks' masses, then a token inside it (each level a short cumulative sum).
_CDF_BLOCK = 512


def sample_tokens(logits: jnp.ndarray, uniforms: jnp.ndarray | None, sp: SamplingParams, *,
                  vocab_axis: int = 1) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Draws one token per row (greedy when `sp.temperature` is 0).

    Args:
      logits: [B, V] float32 logits of the next token, or [V, B] with `vocab_axis=0` (what
        `Decoder.next_token_logits` gives with tied embeddings: the same draw, no transpose).
      uniforms: [B, 2] uniform [0, 1) draws of each row (`step_uniforms`); None when greedy.
      sp: the sampling options.
      vocab_axis: the axis of `logits` that indexes the vocabulary: 1 (or -1), or 0.

    Returns:
      (tokens [B] int32, logps [B] float32): the drawn tokens and their log-probabilities under
        the softmax of logits / temperature (of the logits when greedy), before top-k / top-p.
    """
    vocab_axis = 1 if vocab_axis == -1 else vocab_axis
    if vocab_axis not in (0, 1) or logits.ndim != 2:
        raise ValueError(f"sample_tokens: logits must be 2-D with vocab_axis 0 or 1 (-1), got shape {logits.shape} "
                         f"and vocab_axis={vocab_axis}")
    if vocab_axis == 0 and (sp.top_k > 0 or sp.top_p < 1.0):  # the filters sort rows: [B, V]
        logits, vocab_axis = logits.T, 1
    scaled = logits if sp.temperature == 0 else logits / sp.temperature
    shifted = scaled - jnp.max(scaled, axis=vocab_axis, keepdims=True)
    weights = jnp.exp(shifted)  # the unnormalized probabilities, max 1
    if sp.temperature == 0:
        tokens = jnp.argmax(logits, axis=vocab_axis).astype(jnp.int32)
    else:
        kept = weights
        if sp.top_k > 0 or sp.top_p < 1.0:
            kept = jnp.where(_filter_top_k_top_p(scaled, sp.top_k, sp.top_p) == -jnp.inf, 0.0, weights)
        tokens = _inverse_cdf(kept, uniforms, vocab_axis)
    picked = jnp.take_along_axis(shifted, jnp.expand_dims(tokens, vocab_axis), axis=vocab_axis)
    logps = jnp.squeeze(picked, vocab_axis) - jnp.log(jnp.sum(weights, axis=vocab_axis))
    return tokens, logps


def _inverse_cdf(weights: jnp.ndarray, uniforms: jnp.ndarray, vocab_axis: int = 1) -> jnp.ndarray:
    """Token i of each row with probability weights[i] / sum(weights): a block of `_CDF_BLOCK`
    entries by its share of the mass (uniforms[:, 0]), then a token inside it by its share of the
    block (uniforms[:, 1]). Two levels keep float32's resolution relative to the block, so a rare
    token in a block of rare ones is drawn at its own rate. Weights >= 0, some > 0 per row: [B, V],
    or [V, B] with `vocab_axis=0` (only the small per-block arrays are transposed then).
    """
    vocab = weights.shape[vocab_axis]
    size = min(_CDF_BLOCK, vocab)
    count = -(-vocab // size)
    extra = count * size - vocab
    if vocab_axis == 1:
        blocks = jnp.pad(weights, ((0, 0), (0, extra))).reshape(weights.shape[0], count, size)  # [B, count, size]
        block = _first_above(blocks.sum(axis=-1), uniforms[:, 0])  # [B]
        inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, size]
    else:
        blocks = jnp.pad(weights, ((0, extra), (0, 0))).reshape(count, size, weights.shape[1])  # [count, size, B]
        block = _first_above(blocks.sum(axis=1).T, uniforms[:, 0])
        inside = jnp.take_along_axis(blocks, block[None, None, :], axis=0)[0].T
    return (block * size + _first_above(inside, uniforms[:, 1])).astype(jnp.int32)


def _first_above(mass: jnp.ndarray, u: jnp.ndarray) -> jnp.ndarray:
    """Per row, the first index whose cumulative mass exceeds u * total ([B, N] mass >= 0, [B] u
    in [0, 1)); never an index of zero mass, which float rounding at the top could otherwise pick.
    """
    cumulative = jnp.cumsum(mass, axis=-1)
    index = jnp.sum(cumulative <= u[:, None] * cumulative[:, -1:], axis=-1)
    last_positive = mass.shape[-1] - 1 - jnp.argmax(mass[:, ::-1] > 0, axis=-1)
    return jnp.minimum(index, last_positive)


def step_uniforms(rng_keys: jax.Array, sp: SamplingParams):
    """The two uniform draws of each row's key at each decode step: `at(step, idx=None)` gives
    [B, 2] (or the rows `idx`), None when greedy. Step s of a row draws from fold_in(key, s), so a
    token depends only on its own key and step. All steps are drawn up front ([B, C, 2]: small).

    Args:
      rng_keys: [B, 2] uint32 raw threefry keys.
      sp: the sampling options (temperature 0: greedy, no draws; max_new_tokens: the steps).
    """
    if sp.temperature == 0:
        return lambda step, idx=None: None
    keys = jax.random.wrap_key_data(rng_keys, impl="threefry2x32")
    draw = lambda key, step: jax.random.uniform(jax.random.fold_in(key, step), (2,), jnp.float32)  # noqa: E731
    every = jax.vmap(lambda k: jax.vmap(lambda s: draw(k, s))(jnp.arange(sp.max_new_tokens)))(keys)  # [B, C, 2]

    def at(step, idx=None):
        drawn = jax.lax.dynamic_index_in_dim(every, step, axis=1, keepdims=False)
        return drawn if idx is None else jnp.take(drawn, idx, axis=0)
    return at


def is_stop_token(tokens: jax.Array, sp: SamplingParams) -> jax.Array:
    """Whether each sampled token is one of `sp.stop_token_ids` (all False when there are none)."""
    if not sp.stop_token_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(sp.stop_token_ids, jnp.int32))
