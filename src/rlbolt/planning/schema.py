"""The batches each executable of a step takes, declared as ShapeDtypeStructs with their shardings.

The trained batch is the numeric columns of a GRPO-family global batch (what `Trainer` places:
`Batch.numeric()`), split [A, M/A, ...] with the sample axis over the batch shards; the logps
forward takes the four token inputs; the rollout takes one prompt row per group and a key per sample.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import ShapeDtypeStruct as S

from rlbolt.batch import Batch
from rlbolt.distributed.sharding import ShardingPlan

# column -> (per-sample shape: "P" prompt width, "C" completion width, dtype)
TRAIN_COLUMNS: dict[str, tuple[tuple[str, ...], object]] = {
    "prompt_ids": (("P",), jnp.int32),
    "prompt_mask": (("P",), jnp.bool_),
    "completion_ids": (("C",), jnp.int32),
    "completion_mask": (("C",), jnp.bool_),
    "sampler_logps": (("C",), jnp.float32),
    "old_logps": (("C",), jnp.float32),
    "rewards": ((), jnp.float32),
    "advantages": ((), jnp.float32),
    "group_ids": ((), jnp.int32),
    "policy_version": ((), jnp.int32),
}
REFERENCE_COLUMNS = {"ref_logps": (("C",), jnp.float32)}


def _shape(dims: tuple[str, ...], prompt: int, completion: int) -> tuple[int, ...]:
    return tuple(prompt if d == "P" else completion for d in dims)


def train_batch(accum: int, micro: int, prompt: int, completion: int, *, reference: bool,
                sharding: ShardingPlan | None = None, packed_rows: int | None = None,
                packed_sources: int | None = None) -> Batch:
    """The update's micro batches [A, M/A, ...] (sample axis 1 over the batch shards when `sharding`).

    Args:
      accum: A, gradient-accumulation steps.
      micro: samples per micro batch.
      prompt: P, the padded prompt width.
      completion: C, the completion width.
      reference: whether `ref_logps` is a column (beta > 0).
      sharding: the training ShardingPlan, or None.
      packed_rows: plan.packing: R, the packed rows per batch shard (adds `pack_rows` [A, M/A, R] and
        `pack_starts` [A, M/A], `rlbolt.packing`); None: padded rows.
      packed_sources: plan.packing: S, `pack_sources` entries per sample (adds `pack_sources`
        [A, M/A, S]: the output projection over the completion tokens' predictors,
        `rlbolt.packing.source_slots`); None: without that column.
    """
    columns = {**TRAIN_COLUMNS, **(REFERENCE_COLUMNS if reference else {})}
    place = None if sharding is None else sharding.batch_sharding(1)
    batch = Batch({name: S((accum, micro, *_shape(dims, prompt, completion)), dtype, sharding=place)
                   for name, (dims, dtype) in columns.items()})
    if packed_rows is None:
        return batch
    batch = batch.with_columns(pack_rows=S((accum, micro, packed_rows), jnp.bool_, sharding=place),
                               pack_starts=S((accum, micro), jnp.int32, sharding=place))
    if packed_sources is None:
        return batch
    return batch.with_columns(pack_sources=S((accum, micro, packed_sources), jnp.int32, sharding=place))


def logps_inputs(rows: int, prompt: int, completion: int, sharding: ShardingPlan | None = None) -> tuple[S, S, S, S]:
    """(prompt_ids, prompt_mask, completion_ids, completion_mask) of one logps micro batch."""
    place = None if sharding is None else sharding.batch_sharding()
    return (S((rows, prompt), jnp.int32, sharding=place), S((rows, prompt), jnp.bool_, sharding=place),
            S((rows, completion), jnp.int32, sharding=place), S((rows, completion), jnp.bool_, sharding=place))


def rollout_inputs(rows: int, group: int, prompt: int, sharding: ShardingPlan | None = None) -> tuple[S, S, S]:
    """(prompt_ids [U, P], prompt_mask [U, P], rng_keys [B, 2] uint32) of one sampler call of B rows
    in groups of `group` (U = B / group prefilled prompts)."""
    place = None if sharding is None else sharding.batch_sharding()
    unique = rows // group
    return (S((unique, prompt), jnp.int32, sharding=place), S((unique, prompt), jnp.bool_, sharding=place),
            S((rows, 2), jnp.uint32, sharding=place))


def abstract_key() -> S:
    """A PRNG key's ShapeDtypeStruct (what `init_params(rng)` is given in an abstract run)."""
    return jax.eval_shape(lambda: jax.random.PRNGKey(0))


__all__ = ["REFERENCE_COLUMNS", "TRAIN_COLUMNS", "abstract_key", "logps_inputs", "rollout_inputs", "train_batch"]
