"""Per-token log-probabilities of completions, with the vocabulary projection done in token chunks.

A [B, T, V] float32 logits array is the largest tensor in RL post-training (B=32, T=2k,
V=150k is 39 GB), so the final hidden states go through the output projection about
`chunk_size` tokens at a time (`rlbolt.models.lm_head_logps`: a fused projection + log-softmax
whose own backward recomputes each chunk's logits), and the full logits never exist at once.
`chunk_size` is `model.logits_chunk_tokens`; 0 or None runs the plain unchunked expression.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.models.lm_head_logps import DEFAULT_LOGITS_CHUNK_TOKENS, lm_head_logps
from rlbolt.models.moe import pop_routing, record_routing, replay_routing
from rlbolt.models.shared_prefix import grouped_completion_hidden


def left_pad_positions(mask: jnp.ndarray) -> jnp.ndarray:
    """RoPE positions for left-padded rows: `cumsum(mask) - 1` clipped at 0.

    Args:
      mask: [B, T] bool, True for real tokens.

    Returns:
      [B, T] int32; the first real token of each row is at position 0.
    """
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)


def forward_routing(routing: tuple[jnp.ndarray, jnp.ndarray], group_size: int = 1) -> list[jnp.ndarray]:
    """A rollout's recorded experts in the token order of the forward `completion_hidden` runs.

    Args:
      routing: (prompt [B, P, L, k], completion [B, C, L, k]) int experts per MoE layer
        (`NativeSampler(record_routing=True).last_routing`).
      group_size: G of the forward (> 1: prompts once per group, then completions without their last token).

    Returns:
      Per MoE layer [N, k]: N = B * (P + C) for G = 1, U * P + B * (C - 1) for G > 1.
    """
    prompt, completion = (jnp.asarray(r, jnp.int32) for r in routing)
    if group_size > 1:
        u, p, layers, k = prompt[::group_size].shape
        flat = jnp.concatenate([prompt[::group_size].reshape(u * p, layers, k),
                                completion[:, :-1].reshape(-1, layers, k)], axis=0)
    else:
        flat = jnp.concatenate([prompt, completion], axis=1)
        flat = flat.reshape(-1, *flat.shape[2:])
    return [flat[:, j] for j in range(flat.shape[1])]


def completion_hidden(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size=1,
                      routing=None):
    """Hidden states that predict each completion token: [B, C, H], and the output weight [H, V].

    `group_size` G > 1: rows come in groups of G consecutive rows with one prompt, and each
    group's prompt runs once (`rlbolt.models.shared_prefix`); 1 runs every row's prompt.
    `routing`: None, or the rollout's experts (prompt, completion) for router replay (`forward_routing`).
    """
    return _model_hidden(nnx.merge(graphdef, params), prompt_ids, prompt_mask, completion_ids, completion_mask,
                         group_size, routing)


def _model_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size, routing):
    """`completion_hidden` on a merged model."""
    if routing is not None:
        replay_routing(model, forward_routing(routing, group_size))
    weight = model.output_weight()
    if group_size > 1:
        return grouped_completion_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                         group_size), weight
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1).astype(jnp.int32)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(bool)
    hidden, _ = model(ids, left_pad_positions(mask), attention_mask=mask, return_hidden=True)
    p, c = prompt_ids.shape[1], completion_ids.shape[1]
    # Position P-1+c predicts completion token c (the last prompt token predicts the first).
    return jax.lax.dynamic_slice_in_dim(hidden, p - 1, c, axis=1), weight


def output_softcap(graphdef, params) -> float | None:
    """The model's final logit soft-capping (Gemma 2), which `chunked_logps` must apply; None: off."""
    return nnx.merge(graphdef, params).config.final_logit_softcapping


def chunked_logps(hidden, weight, targets, temperature, chunk_size, with_entropy, softcap=None):
    """`log_softmax(cap(hidden @ weight) / temperature)` gathered at targets, and the entropy (zeros
    unless `with_entropy`), about `chunk_size` tokens at a time (`rlbolt.models.lm_head_logps`).

    `softcap`: the final logit soft-capping c (`c * tanh(logits / c)`, applied before the
    temperature as the sampler does) or None; pass `output_softcap(graphdef, params)`.
    `chunk_size`: tokens per chunk, all rows together; 0 or None: unchunked.
    """
    return lm_head_logps(hidden, weight, targets, temperature=temperature, softcap=softcap, chunk_tokens=chunk_size,
                         with_entropy=with_entropy)


def token_logps_and_entropy(graphdef: nnx.GraphDef | nnx.Module, params: nnx.State | None, prompt_ids: jnp.ndarray,
                            prompt_mask: jnp.ndarray, completion_ids: jnp.ndarray, completion_mask: jnp.ndarray, *,
                            temperature: float = 1.0, chunk_size: int | None = DEFAULT_LOGITS_CHUNK_TOKENS,
                            group_size: int = 1, routing: tuple[jnp.ndarray, jnp.ndarray] | None = None,
                            ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Log-probabilities and entropies of completion tokens under the temperature-scaled policy.

    Pure and jittable; differentiable w.r.t. `params`. The sequence is `prompt | completion`,
    prompts left-padded, completions right-padded; positions are `left_pad_positions(mask)`.

    Args:
      graphdef: the model's `nnx.GraphDef` (from `nnx.split(model)`), or a `Decoder` with
        `params=None` for eager convenience.
      params: the model's `nnx.State` (the second result of `nnx.split(model)`).
      prompt_ids: [B, P] int32, left-padded.
      prompt_mask: [B, P] bool.
      completion_ids: [B, C] int32, right-padded.
      completion_mask: [B, C] bool.
      temperature: logits are divided by it before log_softmax (must match the sampler's).
      chunk_size: tokens per output-projection chunk, all rows together (every row's next
        max(1, chunk_size // B) positions); each pass then holds about two chunk_size x V float32
        blocks instead of [B, C, V]. 0 or None: unchunked (`model.logits_chunk_tokens`).
      group_size: G > 1 when rows come in groups of G consecutive rows with the same prompt:
        each group's prompt then runs once (same results to float32 rounding; B % G == 0).
      routing: mixture-of-experts models: None routes as the router decides; the rollout's
        (prompt [B, P, L, k], completion [B, C, L, k]) experts force that routing (router replay).

    Returns:
      (logps [B, C] float32, entropy [B, C] float32), both 0 where completion_mask is False.
    """
    if params is None:
        graphdef, params = nnx.split(graphdef)
    hidden, weight = completion_hidden(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                      group_size, routing)
    logps, entropy = chunked_logps(hidden, weight, completion_ids.astype(jnp.int32), temperature, chunk_size, True,
                                   output_softcap(graphdef, params))
    mask = completion_mask.astype(bool)
    return jnp.where(mask, logps, 0.0), jnp.where(mask, entropy, 0.0)


def token_logps(graphdef: nnx.GraphDef | nnx.Module, params: nnx.State | None, prompt_ids: jnp.ndarray,
                prompt_mask: jnp.ndarray, completion_ids: jnp.ndarray, completion_mask: jnp.ndarray, *,
                temperature: float = 1.0, chunk_size: int | None = DEFAULT_LOGITS_CHUNK_TOKENS, group_size: int = 1,
                routing: tuple[jnp.ndarray, jnp.ndarray] | None = None) -> jnp.ndarray:
    """Log-probabilities of completion tokens; `token_logps_and_entropy` without the entropy work.

    Args:
      graphdef: the model's `nnx.GraphDef`, or a `Decoder` with `params=None`.
      params: the model's `nnx.State`.
      prompt_ids: [B, P] int32, left-padded.
      prompt_mask: [B, P] bool.
      completion_ids: [B, C] int32, right-padded.
      completion_mask: [B, C] bool.
      temperature: logits are divided by it before log_softmax.
      chunk_size: tokens per output-projection chunk, all rows together; 0 or None: unchunked.
      group_size: G > 1 runs each group's prompt once (see `token_logps_and_entropy`).
      routing: the rollout's experts for router replay (see `token_logps_and_entropy`); None: off.

    Returns:
      [B, C] float32 log-probabilities, 0 where completion_mask is False.
    """
    if params is None:
        graphdef, params = nnx.split(graphdef)
    hidden, weight = completion_hidden(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                      group_size, routing)
    logps, _ = chunked_logps(hidden, weight, completion_ids.astype(jnp.int32), temperature, chunk_size, False,
                             output_softcap(graphdef, params))
    return jnp.where(completion_mask.astype(bool), logps, 0.0)


def sequence_logps(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, *,
                   temperature: float, with_entropy: bool, group_size: int = 1,
                   chunk_size: int | None = DEFAULT_LOGITS_CHUNK_TOKENS):
    """(logps [B, C], entropy [B, C] or None) of the completion tokens: `token_logps_and_entropy`
    when the entropy is wanted, else `token_logps` (jittable; `group_size`, `chunk_size` as there).
    The one function the LM modules' logps and training forwards call."""
    if with_entropy:
        return token_logps_and_entropy(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                       temperature=temperature, group_size=group_size, chunk_size=chunk_size)
    return token_logps(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                       temperature=temperature, group_size=group_size, chunk_size=chunk_size), None


def token_logps_and_routing(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids: jnp.ndarray,
                            prompt_mask: jnp.ndarray, completion_ids: jnp.ndarray, completion_mask: jnp.ndarray, *,
                            temperature: float = 1.0, chunk_size: int | None = DEFAULT_LOGITS_CHUNK_TOKENS,
                            group_size: int = 1, routing: tuple[jnp.ndarray, jnp.ndarray] | None = None,
                            ) -> tuple[jnp.ndarray, list[jnp.ndarray], list[jnp.ndarray]]:
    """`token_logps` of a mixture-of-experts model plus the routing its forward used, for the
    load-balancing loss (`rlbolt.models.moe.load_balancing_loss`) and the routing-mismatch metric.

    Args:
      graphdef: the model's `nnx.GraphDef`.
      params: the model's `nnx.State`.
      prompt_ids: [B, P] int32, left-padded.
      prompt_mask: [B, P] bool.
      completion_ids: [B, C] int32, right-padded.
      completion_mask: [B, C] bool.
      temperature: as in `token_logps`.
      chunk_size: as in `token_logps`.
      group_size: as in `token_logps`.
      routing: as in `token_logps`.

    Returns:
      (logps [B, C] float32, experts: per MoE layer [N, k] int32, probs: per MoE layer [N, E]
        float32), N in the forward's token order (that of `forward_routing(routing, group_size)`).
    """
    logps, _, experts, probs = routed_token_logps(
        graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature=temperature,
        with_entropy=False, chunk_size=chunk_size, group_size=group_size, routing=routing)
    return logps, experts, probs


def routed_token_logps(graphdef: nnx.GraphDef, params: nnx.State, prompt_ids: jnp.ndarray, prompt_mask: jnp.ndarray,
                       completion_ids: jnp.ndarray, completion_mask: jnp.ndarray, *,
                       temperature: float = 1.0, with_entropy: bool = False,
                       chunk_size: int | None = DEFAULT_LOGITS_CHUNK_TOKENS,
                       group_size: int = 1, routing: tuple[jnp.ndarray, jnp.ndarray] | None = None,
                       ) -> tuple[jnp.ndarray, jnp.ndarray | None, list[jnp.ndarray], list[jnp.ndarray]]:
    """`sequence_logps` of a mixture-of-experts model plus the routing its forward used: what the LM
    modules' training and logps forwards call when a router term is on (aux loss, replay, mismatch).

    Args:
      graphdef: the model's `nnx.GraphDef`.
      params: the model's `nnx.State`.
      prompt_ids: [B, P] int32, left-padded.
      prompt_mask: [B, P] bool.
      completion_ids: [B, C] int32, right-padded.
      completion_mask: [B, C] bool.
      temperature: as in `token_logps_and_entropy`.
      with_entropy: also return the entropy (else None).
      chunk_size: as in `token_logps_and_entropy`.
      group_size: as in `token_logps_and_entropy`.
      routing: as in `token_logps_and_entropy`.

    Returns:
      (logps [B, C], entropy [B, C] or None, experts per MoE layer [N, k] int32, router
        probabilities per MoE layer [N, E] float32), N in the order of `forward_routing`.
    """
    model = nnx.merge(graphdef, params)
    record_routing(model)
    hidden, weight = _model_hidden(model, prompt_ids, prompt_mask, completion_ids, completion_mask, group_size,
                                   routing)
    experts, probs = pop_routing(model)
    logps, entropy = chunked_logps(hidden, weight, completion_ids.astype(jnp.int32), temperature, chunk_size,
                                   with_entropy, model.config.final_logit_softcapping)
    mask = completion_mask.astype(bool)
    return (jnp.where(mask, logps, 0.0), jnp.where(mask, entropy, 0.0) if with_entropy else None, experts, probs)
