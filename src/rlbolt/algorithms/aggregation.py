"""Reducing a per-token loss ``[N, C]`` to the scalar a micro batch differentiates.

The contract with the trainer: a mini batch is split into train micro batches, the loss of
each is differentiated, and the micro-batch gradients are SUMMED (never averaged). So every
mode divides by totals over the whole mini batch, which the trainer passes in as
``num_tokens_total`` (sum of completion_mask over the mini batch) and ``num_samples_total``
(its sample count). Then ``sum over micro batches of aggregate_loss(micro)`` equals
``aggregate_loss(mini batch)`` exactly, for any micro size, and so do the gradients.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from rlbolt.algorithms.masked import check_token_shapes


class LossAggregation(str, enum.Enum):
    """How per-token losses are weighted into one scalar.

    - ``token-mean``: every valid token in the mini batch weighs the same (DAPO's
      token-level loss, arXiv 2503.14476 Eq. 12).
    - ``seq-mean-token-mean``: mean over each sequence's tokens, then over sequences (the
      original GRPO objective, arXiv 2402.03300 Eq. 3; long sequences' tokens weigh less).
    - ``seq-mean-token-sum``: sum over each sequence's tokens, mean over sequences.
    - ``seq-mean-token-sum-norm``: token sum divided by a constant, the generation budget
      (Dr.GRPO, arXiv 2503.20783 Sec. 3.2: no length bias).

    Parsing accepts underscores too (``"token_mean"``); anything else raises a ValueError
    listing the allowed values.
    """

    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str):
            normalised = value.strip().lower().replace("_", "-")
            for member in cls:
                if member.value == normalised:
                    return member
        allowed = ", ".join(repr(member.value) for member in cls)
        raise ValueError(f"loss aggregation {value!r} is not one of: {allowed}")


def aggregate_loss(
    per_token: jax.Array,
    mask: jax.Array,
    mode: LossAggregation | str,
    *,
    num_tokens_total: jax.Array | int,
    num_samples_total: jax.Array | int,
    max_completion_length: int | None = None,
) -> jax.Array:
    """Reduces a micro batch's per-token loss with mini-batch normalisers.

    With ``l`` the loss, ``m`` the mask, ``T`` = num_tokens_total, ``S`` = num_samples_total
    and ``L`` = max_completion_length:

    - token-mean: ``sum(l m) / T``
    - seq-mean-token-mean: ``sum_i [sum_t l m / sum_t m]_i / S`` (a row with an empty mask
      adds 0)
    - seq-mean-token-sum: ``sum(l m) / S``
    - seq-mean-token-sum-norm: ``sum(l m) / (S L)``

    Args:
        per_token: ``[n, C]`` float per-token loss of this micro batch.
        mask: ``[n, C]`` bool completion mask of this micro batch.
        mode: a ``LossAggregation`` or its string value (static: a Python value under jit).
        num_tokens_total: valid tokens in the whole mini batch (scalar; 0 is treated as 1).
        num_samples_total: samples in the whole mini batch (scalar; 0 is treated as 1).
        max_completion_length: the generation budget L, required by
            ``seq-mean-token-sum-norm``; pass the configured maximum, not this batch's padded
            width, so every micro batch uses the same constant.

    Returns:
        A float32 scalar; summing it over the micro batches gives the mini-batch loss.
    """
    mode = LossAggregation(mode)
    mask = jnp.asarray(mask, bool)
    check_token_shapes("per_token loss", per_token, mask)
    # where, not multiply: a NaN/inf on a padding token must not leak into the sum.
    masked = jnp.where(mask, per_token.astype(jnp.float32), 0.0)
    num_samples = jnp.maximum(jnp.asarray(num_samples_total, jnp.float32), 1.0)
    if mode is LossAggregation.TOKEN_MEAN:
        num_tokens = jnp.maximum(jnp.asarray(num_tokens_total, jnp.float32), 1.0)
        return jnp.sum(masked) / num_tokens
    if mode is LossAggregation.SEQ_MEAN_TOKEN_MEAN:
        lengths = jnp.maximum(jnp.sum(mask, axis=1).astype(jnp.float32), 1.0)
        return jnp.sum(jnp.sum(masked, axis=1) / lengths) / num_samples
    if mode is LossAggregation.SEQ_MEAN_TOKEN_SUM:
        return jnp.sum(masked) / num_samples
    if max_completion_length is None or max_completion_length <= 0:
        raise ValueError(
            "loss aggregation 'seq-mean-token-sum-norm' needs max_completion_length > 0 "
            f"(got {max_completion_length}); pass the rollout's max completion length so every "
            "micro batch divides by the same constant"
        )
    return jnp.sum(masked) / (num_samples * float(max_completion_length))
