"""A frozen model on devices of its own: the reference (`placement.reference: {devices: [a, b]}`) or
on-policy distillation's teacher (`placement.teacher`).

    ref = PlacedReference(model, train_plan, reference_plan, temperature=t)
    ref.params                       the frozen copy, only on the reference devices (placed once)
    ref.logps(batch)                 [N, C] float32 host rows: the forward runs on the reference mesh

It is one of `LMPolicyModule.scorers` (modules/scorers.py: the same `.logps(batch)` as a colocated one).

The copy is made once, at set-up, from the model's initial parameters: each leaf is cut on the
training devices as the reference mesh wants it and every shard copied to the device that holds
that part (`rlbolt.distributed.placement.WeightSync`; a plain `device_put` when the reference
mesh's fsdp x tp does not divide the training devices). Nothing of it stays on the training
devices. A model that is not on the training devices (a teacher read from its folder straight onto
its own devices) is passed with `train_plan=None` and placed with one `device_put` per leaf (none
when its arrays are there already). The forward runs a view of the model whose activation constraints name the reference
mesh (the view shares the model's structure, not its arrays): the logps micro batch is put on
the reference mesh, and this process's rows come back to the host, where the advantage stage
reads them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx

from rlbolt.batch import Batch
from rlbolt.distributed.mesh import MeshError
from rlbolt.distributed.placement import WeightSync
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.models.lm_head_logps import DEFAULT_LOGITS_CHUNK_TOKENS
from rlbolt.models.logps import token_logps
from rlbolt.modules.policy_model import forward_keys



class PlacedReference:
    """A frozen copy of `model`'s parameters and its logps forward, both on `plan`'s devices (a
    `rlbolt.modules.scorers.LogpsScorer`).

    Args:
      model: the policy model (an `rlbolt.models.Decoder`) holding the initial parameters.
      train_plan: the training role's ShardingPlan (where `model`'s arrays live), or None when they
        are not on the training devices.
      plan: the role's ShardingPlan (devices disjoint from training's).
      temperature: the temperature the logps are taken at (the sampler's).
      chunk_size: tokens per output-projection chunk (`model.logits_chunk_tokens`); 0 or None: unchunked.
    """

    on_train_devices = False  # the copy is on the role's own devices: not in the training memory plan

    def __init__(self, model: nnx.Module, train_plan: ShardingPlan | None, plan: ShardingPlan, *, temperature: float,
                 chunk_size: int | None = DEFAULT_LOGITS_CHUNK_TOKENS):
        self.plan = plan
        view = nnx.merge(*nnx.split(model))  # same arrays, its own static activation settings
        plan.shard_activations(view)
        self.graphdef = nnx.split(view)[0]
        del view
        self.params = _move(nnx.state(model, nnx.Param), train_plan, plan)
        self._forward = jax.jit(functools.partial(token_logps, self.graphdef, temperature=temperature,
                                                  chunk_size=chunk_size),
                                out_shardings=plan.batch_sharding())

    def logps(self, batch: Batch, group_size: int = 1) -> np.ndarray:
        """The reference logps [N, C] (float32 host rows, this process's share) of `batch`, with
        `self.params` (which `CPUOffload` may have swapped for a device copy of its host copy).

        Args:
          batch: a logps micro batch holding the token columns.
          group_size: ignored: the forward on the role's own mesh runs every row's prompt (unshared).
        """
        # An episode's forward attends over every real id (sequence_mask), as the colocated scorers do.
        inputs = self.plan.put_local(tuple(np.asarray(batch[k]) for k in forward_keys(batch)))
        return np.asarray(self.plan.local_rows(self._forward(self.params, *inputs)), np.float32)


    def lower(self, *inputs: Any) -> Any:
        """The forward lowered for abstract token columns on this role's mesh (`rlbolt plan`).

        Args:
          *inputs: (prompt_ids, prompt_mask, completion_ids, completion_mask) ShapeDtypeStructs placed
            on `self.plan`'s batch sharding.
        """
        return self._forward.lower(self.params, *inputs)


def _move(params: Any, source: ShardingPlan | None, target: ShardingPlan) -> Any:
    abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
    if source is None or abstract:  # abstract (rlbolt plan): the shapes take the role's shardings, nothing moves
        return jax.block_until_ready(target.place(params))
    try:
        sync = WeightSync(source, target)
    except MeshError:  # shards cannot be cut on the training devices first: one device_put per leaf
        return target.place(params)
    return jax.block_until_ready(sync(params))
