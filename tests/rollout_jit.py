"""Jitted reference forwards for the tests (the rollout, agents, modules and model comparisons).

`token_logps` and `forward_logits` compute exactly what `rlbolt.rollout.token_logps` and a
`Decoder` call compute, as one compiled program instead of op by op (eagerly, every primitive of
every new shape is its own XLA compile). The jits are module-level with the GraphDef static, so
calls with one model's layout and one set of shapes compile once per test module.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from rlbolt.models.lm_head_logps import DEFAULT_LOGITS_CHUNK_TOKENS
from rlbolt.rollout import token_logps as _token_logps


@functools.partial(jax.jit, static_argnums=0, static_argnames=("temperature", "chunk_size", "group_size"))
def _token_logps_jit(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, routing, *,
                     temperature, chunk_size, group_size):
    return _token_logps(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature=temperature, chunk_size=chunk_size, group_size=group_size, routing=routing)


def token_logps(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, *, temperature=1.0,
                chunk_size=DEFAULT_LOGITS_CHUNK_TOKENS, group_size=1, routing=None):
    """`rlbolt.rollout.token_logps` (same arguments; a `Decoder` with `params=None` too), jitted."""
    if params is None:
        graphdef, params = nnx.split(graphdef)
    return _token_logps_jit(graphdef, params, prompt_ids, prompt_mask, completion_ids, completion_mask, routing,
                            temperature=float(temperature), chunk_size=chunk_size, group_size=group_size)


@functools.partial(jax.jit, static_argnums=0)
def _forward_jit(graphdef, params, ids, positions, attention_mask):
    return nnx.merge(graphdef, params)(ids, positions, attention_mask=attention_mask)[0]


def forward_logits(model, ids, positions, attention_mask):
    """`model(ids, positions, attention_mask=attention_mask)[0]` (the logits), jitted."""
    graphdef, params = nnx.split(model)
    return _forward_jit(graphdef, params, ids, positions, attention_mask)
