"""PolicyModel: the policy's graph and the views of its parameters, plain or LoRA.

One object answers every question about the policy's parameters that `LMPolicyModule` and its
rollout ask, so no caller tests for LoRA:

    policy.init_params()             the trainable pytree (the model's Params, or only the adapters)
    policy.frozen() / join(p, f)     LoRA's frozen base (None without LoRA) and the join of the two
    policy.logps(lm, *inputs, ...)   the jitted logps forward on the training mesh (compute_logps)
    policy.forward(lm, inputs, ...)  the training forward: logps, entropy (and the MoE routing)
    policy.packed_forward(lm, batch, row_tokens)   the training forward over plan.packing's packed rows
    policy.rollout_params(lm)        what the engine samples with (LoRA: merged or adapters in the graph)
    policy.rollout_model(plan)       the model the engine is built from, on the rollout mesh
    policy.hf_model(p)               a plain Decoder holding the policy's trainable `p` (adapters merged)

`lm` is the language model's part of the parameters joined with the frozen base (`LMPolicyModule.
policy_params(full_params(params))`). The views themselves are `PlainWeights` or a `LoraPolicy`
(lora_policy.py), which answer the same calls. The helpers below move a batch's token columns onto the mesh
and its rows back; the scorers (scorers.py) use them too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlbolt.batch import Batch
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.models.decoder import Decoder
from rlbolt.models.logps import routed_token_logps, sequence_logps, token_logps
from rlbolt.modules.lora_policy import LoraPolicy
from rlbolt.modules.moe_routing import logps_and_mismatch
from rlbolt.packing import packed_sequence_logps


class PolicyModel:
    """The policy Decoder (or LoRA's adapted one over a frozen base) and its jitted logps forwards.

    Args:
      model: the Decoder as built and placed on the training mesh (LoRA: the base it adapts).
      lora: a LoraPolicy over `model` (`model.lora`), or None for a plain model.
      sharding: the training role's ShardingPlan, or None (one device).
      temperature: the temperature every logps forward is taken at (the sampler's).
      chunk_size: tokens per output-projection chunk (`model.logits_chunk_tokens`).
      record_routing: also build the logps forward that measures the MoE routing mismatch.
    """

    def __init__(self, model: Decoder, *, lora: LoraPolicy | None, sharding: ShardingPlan | None, temperature: float,
                 chunk_size: int | None, record_routing: bool = False):
        self.lora = lora
        self.weights: LoraPolicy | PlainWeights = PlainWeights(model) if lora is None else lora  # no caller tests for LoRA
        self.model = self.weights.policy_model  # LoRA: the adapted model (the float base is no longer held here)
        self.sharding = sharding
        self.options = {"temperature": temperature, "chunk_size": chunk_size}
        self.graphdef, _ = nnx.split(self.model)
        self.logps = jitted_logps(self.graphdef, sharding, **self.options)  # the reference's forward too
        self.logps_and_mismatch = None  # with rollout.record_routing: the logps and the routing mismatch
        if record_routing:
            self.logps_and_mismatch = jax.jit(
                functools.partial(logps_and_mismatch, self.graphdef, **self.options), static_argnames="group_size",
                **({} if sharding is None else {"out_shardings": (sharding.batch_sharding(), sharding.replicated,
                                                                  sharding.replicated)}))

    # -- the parameter views ------------------------------------------------------------------------
    def init_params(self) -> Any:
        """The trainable pytree: the model's parameters, or only the LoRA adapters."""
        return self.weights.init_params()

    def frozen(self) -> Any:
        """LoRA's base (trained never, differentiated never); None without LoRA."""
        return self.weights.frozen()

    def join(self, params: Any, frozen: Any) -> Any:
        """The adapters joined with the base into the adapted model's State; `params` without LoRA."""
        return self.weights.join(params, frozen)

    def identity(self) -> dict | None:
        """LoRA's base: its folder, a fingerprint of its weights and its quantisation; else None."""
        return self.weights.identity

    def hf_model(self, policy_params: Any) -> Decoder:
        """The policy as a plain Decoder holding its trainable `policy_params` (LoRA: the adapters,
        merged into the base)."""
        return self.weights.hf_model(policy_params)

    # -- the training forward -------------------------------------------------------------------------
    def forward(self, lm_params: Any, inputs: tuple, *, group_size: int, routed: bool = False,
                routing: tuple | None = None) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
        """(logps [N, C], entropy [N, C], aux) of the training forward over the token `inputs`.

        Args:
          lm_params: the language model's parameters (joined with the frozen base).
          inputs: prompt ids, prompt mask, completion ids, and the completion (or sequence) mask.
          group_size: G when each group's prompt runs once (1: unshared).
          routed: also return the MoE routing as `aux["router"]` (a router term needs it).
          routing: recorded experts to replay (`algorithm.router_replay`), or None.
        """
        if not routed:
            logps, entropy = sequence_logps(self.graphdef, lm_params, *inputs, with_entropy=True,
                                            group_size=group_size, **self.options)
            return logps, entropy, {}
        logps, entropy, experts, probs = routed_token_logps(self.graphdef, lm_params, *inputs, with_entropy=True,
                                                            group_size=group_size, routing=routing, **self.options)
        return logps, entropy, {"router": (experts, probs)}

    def packed_forward(self, lm_params: Any, batch: Batch, row_tokens: int) -> tuple[jax.Array, jax.Array]:
        """(logps [N, C], entropy [N, C]) of the training forward over `plan.packing`'s packed rows
        (`rlbolt.packing`; one packing block per batch shard).

        Args:
          lm_params: the language model's parameters (joined with the frozen base).
          batch: the micro batch with its token columns and `pack_rows` / `pack_starts` (and
            `pack_sources`: the output projection over the forward tokens' predictors only).
          row_tokens: tokens per packed row (`plan.packed_row_tokens`).
        """
        sources = batch["pack_sources"] if "pack_sources" in batch else None
        return packed_sequence_logps(self.graphdef, lm_params, *token_inputs(batch), batch["pack_rows"],
                                     batch["pack_starts"], sources, row_tokens=row_tokens, with_entropy=True,
                                     blocks=1 if self.sharding is None else self.sharding.batch_shards, **self.options)

    # -- the rollout's view ---------------------------------------------------------------------------
    @property
    def keeps_rollout_arrays(self) -> bool:
        """Whether the engine may keep the arrays it is given (False: LoRA's transient merged copy)."""
        return self.weights.keeps_rollout_arrays

    def rollout_params(self, lm_params: Any) -> Any:
        """What the engine samples with: `lm_params`, or LoRA's adapters merged into new kernels."""
        return self.weights.rollout_params(lm_params)

    def rollout_model(self, rollout: ShardingPlan | None) -> Decoder:
        """The model the engine is built from: on its own devices (placement), a view of it whose
        activation constraints name the rollout mesh (the arrays are shared, not copied)."""
        model = self.weights.rollout_model()
        if rollout is None or rollout is self.sharding:
            return model
        return rollout.shard_activations(nnx.merge(*nnx.split(model)))


class PlainWeights:
    """The parameter views of a plain model (what `LoraPolicy` answers for a LoRA one): every
    parameter trains, nothing is frozen, the engine samples with the parameters as they are.

    Args:
      model: the Decoder.
    """

    identity = None  # nothing frozen to identify
    keeps_rollout_arrays = True

    def __init__(self, model: Decoder):
        self.policy_model = model

    def init_params(self) -> nnx.State:
        """The trainable pytree: the model's `nnx.Param`s."""
        return nnx.state(self.policy_model, nnx.Param)

    def frozen(self) -> None:
        """Nothing is frozen."""
        return None

    def join(self, params: Any, frozen: None) -> Any:
        """`params` (nothing to join)."""
        return params

    def hf_model(self, params: nnx.State) -> Decoder:
        """The model holding `params`."""
        graphdef, _, rest = nnx.split(self.policy_model, nnx.Param, ...)
        return nnx.merge(graphdef, params, rest)

    def rollout_params(self, params: Any) -> Any:
        """`params` as they are."""
        return params

    def rollout_model(self) -> Decoder:
        """The model itself."""
        return self.policy_model


def jitted_logps(graphdef: nnx.GraphDef, sharding: ShardingPlan | None, *, temperature: float,
                 chunk_size: int | None) -> Callable[..., jax.Array]:
    """`token_logps` of `graphdef` jitted, its output rows split over `sharding`'s batch shards:
    called as `(params, *token inputs, group_size=G, routing=None)`."""
    rows = {} if sharding is None else {"out_shardings": sharding.batch_sharding()}
    return jax.jit(functools.partial(token_logps, graphdef, temperature=temperature, chunk_size=chunk_size),
                   static_argnames="group_size", **rows)


def forward_keys(batch: Batch) -> tuple[str, ...]:
    """The forward's token columns. An episode's forward attends over every real id (`sequence_mask`:
    sampled and environment ids), while the loss, KL and metrics use `completion_mask` (sampled ids
    only), so environment ids are context but never trained."""
    return ("prompt_ids", "prompt_mask", "completion_ids", "sequence_mask" if "sequence_mask" in batch else
            "completion_mask")


def token_inputs(batch: Batch) -> tuple:
    """The forward's token columns as device arrays (inside the jitted update)."""
    return tuple(jnp.asarray(batch[k]) for k in forward_keys(batch))


def rows_on_mesh(sharding: ShardingPlan | None, batch: Batch, keys: tuple[str, ...] | None = None) -> tuple:
    """This process's token columns (or the columns `keys`) as arrays split over the mesh's batch shards."""
    host = tuple(np.asarray(batch[k]) for k in (keys or forward_keys(batch)))
    return host if sharding is None else sharding.put_local(host)


def local_rows(sharding: ShardingPlan | None, x: Any) -> np.ndarray:
    """This process's rows of a forward's output, as float32 host values."""
    return np.asarray(x if sharding is None else sharding.local_rows(x), np.float32)
