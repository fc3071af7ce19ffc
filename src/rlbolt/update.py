"""The jitted optimizer update: gradient accumulation over train micro batches, then one step.

One device call per mini batch. The mini batch arrives split into its A train micro batches,
[A, M/A, ...] (`split_micro_batches`; A = grad_accum_steps), with the sample axis of each micro
batch spread over the mesh's batch shards, and a `lax.scan` sums the micro batches' gradients
and metrics. Before the scan every micro batch gets the mini-batch totals as columns, so a loss
normalised by them sums to exactly the full-mini-batch loss: accumulation changes float
rounding, not the update.

With a ShardingPlan the update compiles with explicit shardings: parameters, optimizer state and
frozen parameters arrive placed on their rule-given shardings and micro batches over data x
fsdp (jit compiles for those committed shardings); parameters and optimizer state leave on the
same shardings and the metrics replicated (`out_shardings`).

The update donates what it replaces (`donate`): the parameters and the optimizer state it is
given are deleted when it is called, and its outputs are written into their buffers (XLA's
input/output aliasing), so one copy of each is resident instead of two. The caller must not read
a donated input afterwards (the Trainer keeps published parameters alive in async mode by not
donating them; see `Trainer`). With float32 master weights (`rlbolt.master_weights`) the
gradients are accumulated in float32 and the new parameters are the masters' casts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rlbolt import master_weights
from rlbolt.batch import Batch
from rlbolt.distributed.stored_layouts import accumulator_layouts, constrain

DONATABLE = ("params", "opt_state")


def add_mini_batch_totals(mini: Batch) -> Batch:
    """Adds `mini_batch_num_tokens` and `mini_batch_num_samples` ([M] float32, broadcast)."""
    m = mini.num_samples
    tokens = jnp.sum(mini["completion_mask"]).astype(jnp.float32)
    return mini.with_columns(
        mini_batch_num_tokens=jnp.full((m,), tokens, jnp.float32),
        mini_batch_num_samples=jnp.full((m,), m, jnp.float32),
    )


def split_micro_batches(mini: Batch, grad_accum_steps: int) -> Batch:
    """[M, ...] -> [A, M/A, ...]: micro batch i is samples i*M/A .. (i+1)*M/A - 1 (host or device)."""
    a = grad_accum_steps
    return jax.tree.map(lambda x: x.reshape(a, x.shape[0] // a, *x.shape[1:]), mini)


def make_update_fn(training_step: Callable, optimizer: optax.GradientTransformation, grad_accum_steps: int, *,
                   frozen: Any = None, with_frozen: Callable | None = None, sharding: Any = None,
                   params: Any = None, opt_state: Any = None, donate: tuple[str, ...] = DONATABLE) -> Callable:
    """Returns jitted `update(params, opt_state, micro_batches) -> (params, opt_state, metrics)`.

    Args:
      training_step: `(params, micro_batch) -> (loss, metrics)`.
      optimizer: the optax transformation of the trainable params.
      grad_accum_steps: A, the leading axis of `micro_batches` ([A, M/A, ...], `split_micro_batches`).
      frozen: parameters the step uses but never trains (`RLModule.frozen_params`). They reach
        the executable as an argument of every call, so the executable holds no copy of them,
        and the gradient is taken with respect to `params` only, so none of theirs is formed.
      with_frozen: `(params, frozen) -> what training_step receives` (`RLModule.with_frozen`).
      sharding: a `rlbolt.distributed.ShardingPlan`; None compiles without explicit shardings.
      params: the placed parameters (their shardings are the update's, in and out).
      opt_state: the placed optimizer state (likewise).
      donate: which inputs the update donates (`DONATABLE`: "params", "opt_state"): a donated
        input is deleted by the call and its buffers hold the matching output. () donates nothing.

    Returns:
      The jitted update. `metrics` holds `loss`, `grad_norm` and the training step's own
      metrics, each summed over the micro batches (replicated device scalars: reading them is
      the caller's host sync). `.func` of the result is the jitted function itself (for
      lowering and memory analysis; it takes `frozen` as a fourth argument).
    """

    def loss(params: Any, micro: Batch, frozen: Any):
        return training_step(params if with_frozen is None else with_frozen(params, frozen), micro)

    grad_fn = jax.value_and_grad(loss, has_aux=True)
    stored_masters = None if opt_state is None else master_weights.masters_of(opt_state)
    layouts = None if params is None or sharding is None else accumulator_layouts(
        params, jax.tree.map(lambda p: p.dtype, params if stored_masters is None else stored_masters))

    def update(params: Any, opt_state: Any, micro: Batch, frozen: Any):
        a, m = micro["completion_mask"].shape[:2]
        tokens = jnp.sum(micro["completion_mask"]).astype(jnp.float32)
        micro = micro.with_columns(mini_batch_num_tokens=jnp.full((a, m), tokens, jnp.float32),
                                   mini_batch_num_samples=jnp.full((a, m), a * m, jnp.float32))
        first = jax.tree.map(lambda x: x[0], micro)
        out_shape = jax.eval_shape(grad_fn, params, first, frozen)
        masters = master_weights.masters_of(opt_state)
        if masters is not None:  # gradients summed in the masters' dtype (float32), not the params'
            out_shape = (out_shape[0], jax.eval_shape(lambda m: m, masters))
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape)
        zeros = (zeros[0], constrain(zeros[1], layouts))  # gradients in their parameters' stored layout

        def accumulate(total, micro_batch):
            step = grad_fn(params, micro_batch, frozen)
            (loss, metrics), grads = jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, step)
            return ((loss, metrics), constrain(grads, layouts)), None

        ((loss, metrics), grads), _ = jax.lax.scan(accumulate, zeros, micro)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = master_weights.apply(params, updates, opt_state)
        return params, opt_state, {**metrics, "loss": loss, "grad_norm": optax.global_norm(grads)}

    unknown = set(donate) - set(DONATABLE)
    if unknown:
        raise ValueError(f"make_update_fn(donate={donate!r}): {sorted(unknown)} cannot be donated; use a subset of {DONATABLE}")
    donated = {"donate_argnums": tuple(DONATABLE.index(name) for name in donate)}
    if sharding is None:
        jitted = jax.jit(update, **donated)
    else:  # inputs arrive placed (their committed shardings are the compiled ones); outputs pinned
        p, o = _shardings_of(params), _shardings_of(opt_state)
        jitted = jax.jit(update, out_shardings=(p, o, sharding.replicated), **donated)
    return functools.partial(jitted, frozen=frozen)


def _shardings_of(tree: Any) -> Any:
    """The sharding of every leaf: placed arrays and ShapeDtypeStructs of an abstract run alike
    (reading it from arrays only would leave an abstract state's out_shardings None, unpinned)."""
    return jax.tree.map(lambda x: getattr(x, "sharding", None) if isinstance(x, (jax.Array, jax.ShapeDtypeStruct))
                        else None, tree)


__all__ = ["DONATABLE", "add_mini_batch_totals", "make_update_fn", "split_micro_batches"]
