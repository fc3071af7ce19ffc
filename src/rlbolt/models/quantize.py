"""A quantised frozen base for QLoRA (Dettmers et al. 2023, arXiv 2305.14314), through qwix.

qwix's post-training quantisation (`qwix.PtqProvider` + `qwix.quantize_model`) replaces the
kernels of the four projections of every layer (q|k|v, o, gate|up, down) by quantised values and
scales and intercepts their matmuls; the LoRA adapters (`rlbolt.models.lora`), the embeddings,
norms and lm_head stay in floating point, and the adapters' own matmuls are left alone (the rule
matches the projection's own module path only). 4-bit types use blocks of 64 inputs per scale,
as QLoRA does; int8 uses one scale per output column.

Apply it after `apply_lora`, so the adapters' modules are part of the quantised model:

    adapted = quantize_base(apply_lora(model, lora, rngs=rngs), "nf4")
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from qwix._src.providers.ptq import WithAux  # the quantised-kernel container (not re-exported by qwix)

from rlbolt.models.decoder import Decoder

# Module paths as qwix writes them ("layers/0/attn/qkv_proj"); matched in full, so the adapters'
# modules ("layers/0/attn/qkv_proj/lora/q") are not quantised.
PROJECTIONS = r"layers/\d+/(attn/(qkv_proj|o_proj)|mlp/(gate_up_proj|down_proj))"
BLOCK = 64  # inputs per scale for 4-bit types (QLoRA's block size)


def quantize_base(model: Decoder, qtype: str) -> Decoder:
    """A copy of `model` whose projection kernels qwix stores as `qtype` (PTQ weights).

    Args:
      model: a Decoder, usually with LoRA adapters already applied.
      qtype: "int8" (per output column scales), "int4" or "nf4" (a scale per 64 inputs).

    Returns:
      The quantised Decoder (qwix intercepts its `run`, which every pass goes through); `model` is not modified, but the
      arrays it does not quantise (embeddings, norms, adapters) are shared, not copied.

    Raises:
      ValueError: a 4-bit type on a model whose projection input widths are not multiples of 64.
    """
    c = model.config
    tile = None
    if qtype in ("int4", "nf4"):
        widths = {"hidden_size": c.hidden_size, "num_heads * head_dim": c.q_size, "intermediate_size": c.intermediate_size}
        bad = {name: w for name, w in widths.items() if w % BLOCK}
        if bad:
            raise ValueError(f"quantize={qtype!r} uses blocks of {BLOCK} inputs, but {bad} are not multiples of {BLOCK}; "
                             "use quantize=int8 for this model")
        tile = BLOCK
    provider = qwix.PtqProvider([qwix.QuantizationRule(module_path=PROJECTIONS, weight_qtype=qtype, tile_size=tile)])
    ids = jnp.zeros((1, 1), jnp.int32)
    # Intercept `Decoder.run`, the entry of every pass (the plain forward and the prompt-shared
    # ones); one forward converts the kernels.
    quantized = qwix.quantize_model(model, provider, Decoder._forward, ids, ids, attention_mask=None, cache=None,
                                    return_hidden=False, methods=("run",))
    unused = provider.get_unused_rules()
    if unused:  # the decoder's layout moved and the rule no longer matches: never train unquantised silently
        raise RuntimeError(f"qwix rule {PROJECTIONS!r} matched no module of the decoder")
    return quantized


def dequantize_model(model: Decoder) -> Decoder:
    """A plain Decoder (no interception) with every qwix-quantised kernel dequantised to float.

    The adapters and all other arrays are kept as they are, so the result computes what `model`
    computes up to the float rounding of its matmuls: what a merged export of a QLoRA policy holds.

    Args:
      model: a Decoder from `quantize_base` (not modified).

    Returns:
      A new Decoder of the unquantised class.
    """
    plain = nnx.clone(model)
    plain.__class__ = getattr(type(model), "_unquantized_type", type(model))  # undo qwix's class swap
    for _, module in plain.iter_modules():
        kernel = vars(module).get("kernel")
        if isinstance(kernel, WithAux):
            qarray = jax.tree.map(lambda v: v[...], kernel.array, is_leaf=lambda v: isinstance(v, nnx.Variable))
            axes = kernel.array.qvalue.get_metadata().get("out_sharding")
            module.kernel = nnx.Param(qwix.dequantize(qarray).astype(model.config.dtype), out_sharding=axes,
                                      eager_sharding=False)
    return plain
