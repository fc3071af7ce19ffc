"""The jitted optimizer update: gradient accumulation over train micro batches, then one step.

One device call per mini batch: the mini batch [M, ...] is reshaped to [A, M/A, ...] and a
`lax.scan` sums the micro batches' gradients and metrics (A = grad_accum_steps). Before the scan
every micro batch gets the mini-batch totals as columns, so a loss normalised by them sums to
exactly the full-mini-batch loss: accumulation changes float rounding, not the update.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rlbolt.batch import Batch


def add_mini_batch_totals(mini: Batch) -> Batch:
    """Adds `mini_batch_num_tokens` and `mini_batch_num_samples` ([M] float32, broadcast)."""
    m = mini.num_samples
    tokens = jnp.sum(mini["completion_mask"]).astype(jnp.float32)
    return mini.with_columns(
        mini_batch_num_tokens=jnp.full((m,), tokens, jnp.float32),
        mini_batch_num_samples=jnp.full((m,), m, jnp.float32),
    )


def make_update_fn(training_step: Callable, optimizer: optax.GradientTransformation, grad_accum_steps: int, *,
                   frozen: Any = None, with_frozen: Callable | None = None) -> Callable:
    """Returns jitted `update(params, opt_state, mini_batch) -> (params, opt_state, metrics)`.

    `metrics` holds `loss`, `grad_norm` and the training step's own metrics, each summed over
    the micro batches (device scalars: reading them is the caller's host sync).

    Args:
      training_step: `(params, micro_batch) -> (loss, metrics)`.
      optimizer: the optax transformation of the trainable params.
      grad_accum_steps: train micro batches per mini batch.
      frozen: parameters the step uses but never trains (`RLModule.frozen_params`). They reach
        the executable as an argument of every call, so the executable holds no copy of them,
        and the gradient is taken with respect to `params` only, so none of theirs is formed.
      with_frozen: `(params, frozen) -> what training_step receives` (`RLModule.with_frozen`).
    """

    def loss(params: Any, micro: Batch, frozen: Any):
        return training_step(params if with_frozen is None else with_frozen(params, frozen), micro)

    grad_fn = jax.value_and_grad(loss, has_aux=True)

    def update(params: Any, opt_state: Any, mini: Batch, frozen: Any):
        mini = add_mini_batch_totals(mini)
        micro = jax.tree.map(lambda x: x.reshape(grad_accum_steps, x.shape[0] // grad_accum_steps, *x.shape[1:]), mini)
        first = jax.tree.map(lambda x: x[0], micro)
        out_shape = jax.eval_shape(grad_fn, params, first, frozen)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)

        def accumulate(total, micro_batch):
            return jax.tree.map(jnp.add, total, grad_fn(params, micro_batch, frozen)), None

        ((loss, metrics), grads), _ = jax.lax.scan(accumulate, zeros, micro)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)}

    # No donation: callbacks (checkpoints, offload) may still hold the previous state's arrays.
    # `.func` of the result is the jitted function itself (for lowering and memory analysis).
    return functools.partial(jax.jit(update), frozen=frozen)
