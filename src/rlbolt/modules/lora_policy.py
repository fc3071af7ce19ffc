"""LoraPolicy: what an LM module needs to train LoRA adapters on a frozen (optionally quantised) base.

One copy of the base exists. The policy forward is the adapted graph over `base + adapters`; the
KL reference is the graph without adapters over the same `base` arrays (the base "with adapters
off"), so beta > 0 costs a forward pass and no memory. The sampler either rolls out with the
adapters merged into a transient copy of the targeted kernels (`rollout="merged"`, the default:
faster on the benchmark workload, benchmarks/RESULTS.md; the copy is dropped after the rollout)
or applies them on the fly (`rollout="adapters"`: no copy; the default with a quantised base).

    lora = LoraPolicy(model, LoraConfig(rank=8, alpha=16, targets=("q", "v")), rngs=nnx.Rngs(0), path=folder)
    trainable = lora.adapters                  # what init_params returns; the optimizer sees only these
    full = lora.join(trainable, lora.base)     # what the policy forward runs on
"""

from __future__ import annotations

import os
from typing import Any

import jax
from flax import nnx

from rlbolt.models.decoder import Decoder
from rlbolt.models.lora import LoraConfig, adapted_denses, apply_lora, merge_adapters
from rlbolt.utils.fingerprint import fingerprint


class LoraPolicy:
    """A base Decoder with LoRA adapters: the frozen base, the adapter layout, their joins.

    Args:
      model: the base Decoder (its arrays become the frozen base; with `lora.quantize` the float
        kernels are replaced by qwix-quantised ones and this model's kernels are no longer used).
      lora: rank, alpha, targets, quantisation.
      rngs: initialises the adapters' A matrices.
      path: the base's folder (recorded in checkpoints; None for a random tiny base).

    Attributes:
      config: the LoraConfig.
      graphdef: the adapted model's GraphDef (base + adapters): the policy.
      base_graphdef: the GraphDef without adapters: the reference (adapters off).
      base: the frozen base (nnx.State): shared by the policy, the reference and the sampler.
      adapters: the initial adapters (nnx.State of nnx.LoRAParam): B = 0, so policy = base.
      policy_model: the adapted Decoder holding `base` and `adapters` (the sampler's template).
      identity: `{"path", "fingerprint", "quantize"}`: checkpoints record it, resume checks it.
    """

    def __init__(self, model: Decoder, lora: LoraConfig, *, rngs: nnx.Rngs, path: str | os.PathLike | None):
        self.config = lora
        # The fingerprint is of the weights as loaded (before quantisation): the base's identity.
        self.identity = {"path": os.path.abspath(path) if path else None,
                         "fingerprint": fingerprint(nnx.state(model, nnx.Param)), "quantize": lora.quantize}
        adapted = apply_lora(model, lora, rngs=rngs)
        if lora.quantize:
            from rlbolt.models.quantize import quantize_base

            adapted = quantize_base(adapted, lora.quantize)
        self.graphdef, self.adapters, self.base = nnx.split(adapted, nnx.LoRAParam, ...)
        self.policy_model = adapted
        plain = nnx.clone(adapted)
        for _, dense in adapted_denses(plain):
            dense.lora = None
        self.base_graphdef = nnx.graphdef(plain)

    def join(self, adapters: nnx.State, base: nnx.State) -> nnx.State:
        """One State of the adapted model from its two parts (no array is copied; jittable)."""
        return nnx.merge_state(base, adapters)

    def merged_model(self, adapters: nnx.State) -> Decoder:
        """The policy as a plain Decoder: `W + (alpha / r) A B` in every targeted kernel.

        A quantised base is dequantised first, so the result computes what the trained policy
        computes (up to float rounding): what `rlbolt export` writes.
        """
        adapted = nnx.merge(self.graphdef, self.base, adapters)
        if self.config.quantize:
            from rlbolt.models.quantize import dequantize_model

            adapted = dequantize_model(adapted)
        return merge_adapters(adapted)

    # -- the parameter views a PolicyModel asks for (modules/policy_model.py; `PlainWeights` answers
    # the same for a plain model) ---------------------------------------------------------------------
    def init_params(self) -> nnx.State:
        """The trainable pytree: the adapters only."""
        return self.adapters

    def frozen(self) -> nnx.State:
        """The base: trained never, differentiated never."""
        return self.base

    def hf_model(self, adapters: nnx.State) -> Decoder:
        """The policy as a plain Decoder (`merged_model`)."""
        return self.merged_model(adapters)

    # -- rollout: merged weights vs adapters on the fly (benchmarks/RESULTS.md) ------------------------
    @property
    def merge_for_rollout(self) -> bool:
        """Whether the sampler runs merged kernels (a transient copy) rather than the adapters."""
        return self.config.rollout == "merged"

    @property
    def keeps_rollout_arrays(self) -> bool:
        """Whether the engine may keep the arrays it is given (not LoRA's transient merged copy)."""
        return not self.merge_for_rollout

    def rollout_model(self) -> Decoder:
        """The Decoder the sampler is built from."""
        return nnx.merge(self.base_graphdef, self.base) if self.merge_for_rollout else self.policy_model

    def rollout_params(self, full: nnx.State) -> nnx.State:
        """What the sampler runs on: the adapted State, or its adapters merged into new kernels."""
        if not self.merge_for_rollout:
            return full
        if not hasattr(self, "_merge"):
            self._merge = jax.jit(lambda s: nnx.state(merge_adapters(nnx.merge(self.graphdef, s)), nnx.Param))
        return self._merge(full)

    def adapted_model(self, adapters: nnx.State) -> Decoder:
        """The adapted Decoder holding the base and these adapters (for the PEFT export)."""
        return nnx.merge(self.graphdef, self.base, adapters)


class LoraHooks:
    """The RLModule parameter hooks of a module whose `self.lora` is a `LoraPolicy` (or None:
    nothing frozen): the demo's module. `LMPolicyModule` asks its `PolicyModel` instead."""

    lora: LoraPolicy | None = None

    def frozen_params(self) -> Any:
        """With LoRA, the base (trained never, differentiated never); else None."""
        return self.lora.base if self.lora is not None else None

    def with_frozen(self, params: Any, frozen: Any) -> Any:
        """With LoRA, the adapters joined with the base into the adapted model's State."""
        return self.lora.join(params, frozen) if self.lora is not None else params

    def frozen_identity(self) -> dict | None:
        """With LoRA: the base's folder, a fingerprint of its weights and its quantisation."""
        return self.lora.identity if self.lora is not None else None
