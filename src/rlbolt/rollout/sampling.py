"""One token per row from a step's logits: the sampling options (`SamplingParams`), top-k /
top-p filtering and the Gumbel-max draw `argmax(logits / temperature + g)`.

The Gumbel noise `g` comes from the caller (`rlbolt.rollout.sampler` draws it per sample and
step), so these functions hold no RNG state and a token depends only on its row.
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


def sample_tokens(logits: jnp.ndarray, noise: jnp.ndarray | None, sp: SamplingParams):
    """Draws one token per row (greedy when `sp.temperature` is 0).

    Args:
      logits: [B, V] float32 logits of the next token.
      noise: [B, V] Gumbel(0, 1) noise; None when greedy.
      sp: the sampling options.

    Returns:
      (tokens [B] int32, logps [B] float32): the drawn tokens and their log-probabilities under
      the softmax of logits / temperature (of the logits when greedy), before top-k / top-p.
    """
    if sp.temperature == 0:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
    else:
        scaled = logits / sp.temperature
        logp_all = jax.nn.log_softmax(scaled, axis=-1)
        tokens = jnp.argmax(_filter_top_k_top_p(scaled, sp.top_k, sp.top_p) + noise, axis=-1).astype(jnp.int32)
    return tokens, jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]


def gumbel_noise(rng_keys: jax.Array, sp: SamplingParams, vocab: int, upfront: bool):
    """The Gumbel noise of each row's key at each decode step: `noise_at(step, idx=None)` gives
    [B, V] (or the rows `idx`), None when greedy. Step s of a row draws from fold_in(key, s), so a
    token depends only on its own key and step.

    Args:
      rng_keys: [B, 2] uint32 raw threefry keys.
      sp: the sampling options (temperature 0: greedy, no noise; max_new_tokens: the steps).
      vocab: V.
      upfront: draw every step's noise at once ([B, C, V]; cheaper when it fits) instead of per step.
    """
    keys = jax.random.wrap_key_data(rng_keys, impl="threefry2x32")

    def draw(key, step):
        return jax.random.gumbel(jax.random.fold_in(key, step), (vocab,), jnp.float32)

    if sp.temperature == 0:
        return lambda step, idx=None: None
    if upfront:
        every = jax.vmap(lambda k: jax.vmap(lambda s: draw(k, s))(jnp.arange(sp.max_new_tokens)))(keys)  # [B, C, V]

        def at_step(step, idx=None):
            noise = jax.lax.dynamic_index_in_dim(every, step, axis=1, keepdims=False)
            return noise if idx is None else jnp.take(noise, idx, axis=0)
        return at_step
    return lambda step, idx=None: jax.vmap(draw, in_axes=(0, None))(
        keys if idx is None else jnp.take(keys, idx, axis=0), step)


def is_stop_token(tokens: jax.Array, sp: SamplingParams) -> jax.Array:
    """Whether each sampled token is one of `sp.stop_token_ids` (all False when there are none)."""
    if not sp.stop_token_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(sp.stop_token_ids, jnp.int32))
