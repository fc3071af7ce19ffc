"""Mixed precision: float32 master weights and moments behind low-precision parameters.

With `model.param_dtype: bfloat16` the parameters the forward, the backward, the rollout and the
exports see are bfloat16. Alone, that makes AdamW's moments bfloat16 too, and an update smaller
than half a bfloat16 ulp of a weight (8 significant bits: |update| < |w| / 512) rounds away:
with a small learning rate most weights never move. `with_master_weights` keeps what serious
trainers keep instead:

    optimizer state   MasterWeightsState(masters: float32 copy of the params, inner: the optimizer's
                      own state over the masters, so AdamW's moments are float32 too)
    one update        gradients (taken with respect to the bfloat16 params, accumulated in float32)
                      -> the optimizer over the masters -> masters += updates in float32
                      -> params = the masters cast to the params' dtype (`apply`)

The bfloat16 params stay the single source of what every forward runs on: they equal the
masters' casts after every update. The masters live in the optimizer state, so checkpoints save
them (a resumed run continues bit for bit) while Hugging Face exports and published weights keep
the model's dtype. float32 parameters get no wrapper: `wrap` returns the optimizer unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

MODES = ("auto", "none")


class MasterWeightsState(NamedTuple):
    """The optimizer state of `with_master_weights`.

    Attributes:
      masters: the parameters in `dtype` (a pytree shaped like the params).
      inner: the wrapped optimizer's state, built over the masters.
    """

    masters: Any
    inner: Any


def with_master_weights(inner: optax.GradientTransformation, dtype: Any = jnp.float32) -> optax.GradientTransformation:
    """Wraps `inner` so that it runs on `dtype` master copies of the parameters.

    Args:
      inner: the optimizer (its state, e.g. AdamW's moments, takes the masters' dtype).
      dtype: the masters' dtype.

    Returns:
      A transformation whose state is `MasterWeightsState`. Its `update(grads, state, params)`
      returns the updates in `dtype` and the state with the updated masters; the new params are
      `apply(params, updates, state)` (the masters cast), not `params + updates`.
    """

    def init(params: Any) -> MasterWeightsState:
        masters = jax.tree.map(lambda p: p.astype(_master_dtype(p, dtype)), params)
        return MasterWeightsState(masters, inner.init(masters))

    def update(grads: Any, state: MasterWeightsState, params: Any = None) -> tuple[Any, MasterWeightsState]:
        del params  # the masters are the parameters the optimizer sees
        grads = jax.tree.map(lambda g, m: g.astype(m.dtype), grads, state.masters)
        updates, inner_state = inner.update(grads, state.inner, state.masters)
        return updates, MasterWeightsState(optax.apply_updates(state.masters, updates), inner_state)

    return optax.GradientTransformation(init, update)


def _master_dtype(p: Any, dtype: Any) -> Any:
    """`dtype` for floating parameters narrower than it; every other leaf keeps its own dtype."""
    if jnp.issubdtype(p.dtype, jnp.floating) and jnp.dtype(p.dtype).itemsize < jnp.dtype(dtype).itemsize:
        return dtype
    return p.dtype


def needs_masters(params: Any, dtype: Any = jnp.float32) -> bool:
    """Whether any floating parameter is narrower than `dtype` (e.g. bfloat16 under float32).

    Args:
      params: the parameters (arrays or ShapeDtypeStructs: only dtypes are read).
      dtype: the masters' dtype.
    """
    return any(_master_dtype(p, dtype) != p.dtype for p in jax.tree.leaves(params))


def wrap(optimizer: optax.GradientTransformation, params: Any, mode: str) -> optax.GradientTransformation:
    """The optimizer a run trains with under `mode` (`model.master_weights`).

    Args:
      optimizer: the module's optimizer (after the callbacks wrapped it).
      params: the trainable parameters (arrays or ShapeDtypeStructs: only dtypes are read).
      mode: "auto" (float32 masters when a floating parameter is narrower than float32) or
        "none" (the optimizer runs on the parameters themselves).

    Raises:
      ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"master_weights={mode!r}; allowed: {MODES} (auto: float32 masters for bfloat16 params)")
    return with_master_weights(optimizer) if mode == "auto" and needs_masters(params) else optimizer


def masters_of(opt_state: Any) -> Any:
    """The master weights inside `opt_state` (None when the optimizer has none).

    Args:
      opt_state: an optimizer state (a `MasterWeightsState` when the run has masters).
    """
    return opt_state.masters if isinstance(opt_state, MasterWeightsState) else None


def apply(params: Any, updates: Any, opt_state: Any) -> Any:
    """The parameters after an update: the masters of the new `opt_state` cast to the params'
    dtypes, or `params + updates` (`optax.apply_updates`) when there are no masters.

    Args:
      params: the parameters before the update (their dtypes are kept).
      updates: the optimizer's updates (used only without masters).
      opt_state: the optimizer state after the update.
    """
    masters = masters_of(opt_state)
    if masters is None:
        return optax.apply_updates(params, updates)
    return jax.tree.map(lambda p, m: m.astype(p.dtype), params, masters)


__all__ = ["MODES", "MasterWeightsState", "apply", "masters_of", "needs_masters", "with_master_weights", "wrap"]
