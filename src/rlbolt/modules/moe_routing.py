"""Mixture-of-experts terms of the LM modules: the rollout's recorded routing as batch columns, the
load-balancing loss over completion tokens, router replay and the routing-mismatch metric.

Token order. A forward over `prompt | completion` runs, per MoE layer, N tokens in the order of
`rlbolt.models.logps.forward_routing`: rows x (P + C) unshared; with the prompt once per group of
G rows, the U = B / G prompts (U x P) then each row's completion without its last token
(B x (C - 1)). The tokens whose routing the rollout chose are the real prompt tokens and the
*fed* completion tokens: a real completion token followed by another (a row's last token, its
stop token or token C - 1, is never fed back, so it was never routed).

Columns (`rollout.record_routing`): `prompt_routing` [N, P, L, k] and `completion_routing`
[N, C, L, k], the experts of each token in each of the L MoE layers, uint8 when E <= 256 (else
int16); undefined (0) where a token was not routed.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from rlbolt.batch import register_column
from rlbolt.config import ConfigError
from rlbolt.models.moe import load_balancing_loss
from rlbolt.models.lm_head_logps import DEFAULT_LOGITS_CHUNK_TOKENS
from rlbolt.models.logps import forward_routing, routed_token_logps

ROUTING_COLUMNS = (
    register_column("prompt_routing", "[N, P, L, k]", "int32", "the experts the rollout chose per prompt token", by=__name__),
    register_column("completion_routing", "[N, C, L, k]", "int32", "the experts the rollout chose per completion token",
                    by=__name__),
)


def routing_columns(prompt_routing: np.ndarray, completion_routing: np.ndarray, prompt_width: int,
                    num_experts: int) -> dict[str, np.ndarray]:
    """The sampler's `last_routing` as batch columns, prompts left-padded to the batch's width.

    Args:
      prompt_routing: [N, P', L, k] experts of the sampler's prompt bucket (P' <= prompt_width).
      completion_routing: [N, C, L, k].
      prompt_width: P of the batch's `prompt_ids` (its prompts are left-padded to it).
      num_experts: E (chooses the column dtype).

    Returns:
      {"prompt_routing": [N, P, L, k], "completion_routing": [N, C, L, k]}.
    """
    dtype = np.uint8 if num_experts <= 256 else np.int16
    prompt_routing = np.asarray(prompt_routing)
    pad = prompt_width - prompt_routing.shape[1]
    if pad < 0:
        raise ValueError(f"routing_columns: the sampler's prompts are {prompt_routing.shape[1]} wide, more than the "
                         f"batch's prompt width {prompt_width}")
    prompt_routing = np.pad(prompt_routing, ((0, 0), (pad, 0), (0, 0), (0, 0)))
    return {"prompt_routing": prompt_routing.astype(dtype), "completion_routing": np.asarray(completion_routing).astype(dtype)}


def fed_completion(completion_mask: jax.Array) -> jax.Array:
    """[B, C] bool: completion tokens the sampler fed back (real and followed by a real token)."""
    mask = completion_mask.astype(bool)
    return mask & jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)


def routed_token_masks(prompt_mask: jax.Array, completion_mask: jax.Array, group_size: int = 1):
    """(routed [N], completion [N]) bool over the forward's N tokens (module docstring's order):
    tokens the rollout routed (real prompt tokens and fed completion tokens), and the fed
    completion tokens alone (what the load-balancing loss averages over)."""
    fed = fed_completion(completion_mask)
    prompts = prompt_mask.astype(bool)
    if group_size > 1:  # U x P prompt tokens, then B x (C - 1) completion tokens
        prompts, fed = prompts[::group_size].reshape(-1), fed[:, :-1].reshape(-1)
        return jnp.concatenate([prompts, fed]), jnp.concatenate([jnp.zeros_like(prompts), fed])
    return (jnp.concatenate([prompts, fed], axis=1).reshape(-1),  # rows x (P + C), row-major
            jnp.concatenate([jnp.zeros_like(prompts), fed], axis=1).reshape(-1))


def slot_mismatch(recorded: list[jax.Array], recomputed: list[jax.Array], mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mismatched, total) (token, layer, slot) counts: a slot of the recomputed routing is
    mismatched when its expert is not among the k the recorded routing chose for that token
    (the order of the k does not matter).

    Args:
      recorded: per MoE layer [N, k] int experts (the rollout's).
      recomputed: per MoE layer [N, k] int experts (a later forward's).
      mask: [N] bool tokens to count.

    Returns:
      ([] float32 mismatched slots, [] float32 counted slots).
    """
    w = mask.astype(jnp.float32)
    mismatched = jnp.zeros((), jnp.float32)
    for old, new in zip(recorded, recomputed):
        found = jnp.any(new.astype(jnp.int32)[:, :, None] == old.astype(jnp.int32)[:, None, :], axis=-1)  # [N, k]
        mismatched = mismatched + jnp.sum(jnp.where(found, 0.0, 1.0) * w[:, None])
    total = jnp.sum(w) * len(recorded) * (recorded[0].shape[-1] if recorded else 0)
    return mismatched, total


def completion_load_balancing(experts: list[jax.Array], probs: list[jax.Array], prompt_mask: jax.Array,
                              completion_mask: jax.Array, group_size: int = 1) -> jax.Array:
    """The load-balancing loss over the fed completion tokens of one forward's routing
    (`rlbolt.models.moe.load_balancing_loss`: E * sum_e f_e P_e over every MoE layer's tokens)."""
    _, completion = routed_token_masks(prompt_mask, completion_mask, group_size)
    return load_balancing_loss(probs, experts, completion)


def micro_batch_load_balancing(router: tuple[list[jax.Array], list[jax.Array]], batch: Mapping[str, jax.Array],
                               group_size: int, token_share: jax.Array) -> jax.Array:
    """One micro batch's load-balancing term in a mini batch's loss.

    The load-balancing loss is not a sum over tokens: each micro batch's counts its own fed
    completion tokens and enters weighted by its share of the mini batch's completion tokens.

    Args:
      router: the training forward's `(experts, probs)` (`aux["router"]`).
      batch: the micro batch (`prompt_mask`, `completion_mask`).
      group_size: G when each group's prompt runs once (1: unshared).
      token_share: this micro batch's completion tokens over the mini batch's.
    """
    balance = completion_load_balancing(*router, batch["prompt_mask"], batch["completion_mask"], group_size)
    return balance * token_share


def logps_and_mismatch(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, prompt_routing,
                       completion_routing, *, temperature: float, group_size: int = 1,
                       chunk_size: int | None = DEFAULT_LOGITS_CHUNK_TOKENS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The logps forward without replay, and how its routing differs from the rollout's recorded one.

    Returns:
      (logps [B, C] float32, mismatched slots [], counted slots []) (`slot_mismatch` over the
        routed tokens).
    """
    logps, _, experts, _ = routed_token_logps(graphdef, params, prompt_ids, prompt_mask, completion_ids,
                                              completion_mask, temperature=temperature, group_size=group_size,
                                              chunk_size=chunk_size)
    routed, _ = routed_token_masks(prompt_mask, completion_mask, group_size)
    recorded = forward_routing((prompt_routing, completion_routing), group_size)
    mismatched, total = slot_mismatch(recorded, experts, routed)
    return logps, mismatched, total


def routing_fields(aux_loss_coef: float, record: bool, replay: bool) -> list[str]:
    """The config fields of the routing features a run turns on, in this order: model.router_aux_loss_coef
    (> 0), rollout.record_routing, algorithm.router_replay. Empty: nothing records or replays routing
    (`rlbolt.models.scan_layers.stack_reason` then stores mixture-of-experts layers stacked).

    Args:
      aux_loss_coef: `model.router_aux_loss_coef`.
      record: `rollout.record_routing`.
      replay: `algorithm.router_replay`.
    """
    return [name for name, on in (("model.router_aux_loss_coef", aux_loss_coef > 0),
                                  ("rollout.record_routing", record), ("algorithm.router_replay", replay)) if on]


def check_router_settings(num_experts: int, aux_loss_coef: float, record: bool, replay: bool,
                          own_forward: str | None) -> None:
    """Refuses router settings the model or the module cannot honour, in one line naming the field.

    Args:
      num_experts: the model's E (0: dense).
      aux_loss_coef: `model.router_aux_loss_coef`.
      record: `rollout.record_routing`.
      replay: `algorithm.router_replay`.
      own_forward: the module class's name when it overrides the policy forward (PPO's trunk), else None.
    """
    fields = routing_fields(aux_loss_coef, record, replay)
    if not fields:
        return
    if not num_experts:
        raise ConfigError(f"{fields[0]} is set, but the model is dense (no mixture-of-experts layers); unset it or "
                          "train a mixture-of-experts model (e.g. Qwen3-MoE)")
    if own_forward is not None and (aux_loss_coef > 0 or replay):
        raise ConfigError(f"{fields[0]} is not wired into {own_forward}'s own forward; unset it or use an algorithm "
                          "on the shared LM forward (grpo, dapo, drgrpo, rloo, reinforcepp, gspo)")
