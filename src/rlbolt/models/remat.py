"""Activation rematerialisation per decoder layer: which of a layer's activations the backward keeps.

Without remat the backward keeps every intermediate of every layer (the attention scores and
softmax of each query chunk, the MLP's gate|up, ...). With a policy each layer's forward runs
under `jax.checkpoint` (`nnx.remat`): the backward keeps only what the policy saves and recomputes
the rest from the layer's input, one layer at a time. Gradients are those of `none` (the same ops
run again), at the price of about one more forward of each layer.

    none                                nothing recomputed (the default)
    full                                keep only each layer's input (jax.checkpoint_policies.nothing_saveable)
    dots_saveable                       keep every matmul's output, recompute the element-wise rest
    dots_with_no_batch_dims_saveable    keep the weight products (projections, MLP), recompute attention
    offload                             as dots_with_no_batch_dims_saveable, the kept products moved to
                                        host memory (pinned_host) until the backward needs them
"""

from __future__ import annotations

from typing import Callable

import jax

from rlbolt.config.sections import REMAT_POLICIES  # the choices of model.remat


def check_remat(name: str) -> str:
    """`name` when it is one of REMAT_POLICIES.

    Raises:
      ValueError: one line naming model.remat and the valid choices.
    """
    if name not in REMAT_POLICIES:
        raise ValueError(f"model.remat={name!r} is not a remat policy; use one of {list(REMAT_POLICIES)}")
    return name


def checkpoint_policy(name: str) -> Callable | None:
    """The `jax.checkpoint` policy of a REMAT_POLICIES name other than none (None: save nothing).

    Args:
      name: one of REMAT_POLICIES except "none".

    Returns:
      The policy callable, or None for "full" (jax.checkpoint's default: keep only the inputs).
    """
    policies = jax.checkpoint_policies
    return {"full": None,
            "dots_saveable": policies.dots_saveable,
            "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
            "offload": policies.offload_dot_with_no_batch_dims("device", "pinned_host")}[check_remat(name)]
