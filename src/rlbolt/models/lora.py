"""LoRA adapters on the decoder's projections (Hu et al. 2021, arXiv 2106.09685, eq. 3).

A targeted projection computes `x W + (alpha / r) * (x A) B` with the base kernel W frozen,
A [in, r] and B [r, out] trainable (`nnx.LoRAParam`), B zero at the start so the adapted model
begins as the base. Targets are named like Hugging Face's modules: q, k, v, o, gate, up, down.

The decoder fuses q|k|v into one kernel (`attn.qkv_proj`) and gate|up into another
(`mlp.gate_up_proj`). Each target still gets its own (A, B) pair, with B covering only that
target's columns of the fused output: LoRA on "q" alone adds `s * (x A_q) B_q` to the first
`num_heads * head_dim` columns and leaves k and v untouched. So a target set means here exactly
what it means to PEFT on the unfused model (same parameter count, same function), and the
adapters export one-to-one to PEFT's `q_proj.lora_A` / `lora_B` tensors.

Why not qwix's `LoraProvider`: it attaches one (A, B) pair to each weight a module multiplies
with, so on the fused kernel every target would share one A and "q alone" (or PEFT's usual
q + v) could not be expressed. qwix quantises the frozen base instead (`rlbolt.models.quantize`).

State layout (nnx paths, next to the base kernel they adapt):

    layers.{i}.attn.qkv_proj.lora.{q,k,v}.lora_a      [H, r]
    layers.{i}.attn.qkv_proj.lora.{q,k,v}.lora_b      [r, nH*D | nKV*D]
    layers.{i}.attn.o_proj.lora.o.lora_{a,b}          [nH*D, r], [r, H]
    layers.{i}.mlp.gate_up_proj.lora.{gate,up}.lora_{a,b}  [H, r], [r, I]
    layers.{i}.mlp.down_proj.lora.down.lora_{a,b}     [I, r], [r, H]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rlbolt.models.config import ModelConfig
from rlbolt.models.decoder import Decoder, Dense

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# Hugging Face module of each target, under model.layers.{i} (PEFT's target_modules names).
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
QUANTIZE_TYPES = ("int8", "int4", "nf4")
ROLLOUTS = ("merged", "adapters")
_KEYS = ("rank", "alpha", "targets", "quantize", "rollout")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which projections get adapters, their rank and scale, and the base's storage.

    Attributes:
      rank: r, the inner width of every adapter.
      alpha: the adapters' output is scaled by alpha / rank (PEFT's `lora_alpha`).
      targets: projection names, a subset of q, k, v, o, gate, up, down.
      quantize: store the frozen base quantised with qwix ("int8", "int4", "nf4": QLoRA) or
        None to keep it in the model's dtype.
      rollout: "merged" folds the adapters into a transient copy of the targeted kernels for each
        rollout (faster on the benchmark; + one copy of those kernels while sampling) or
        "adapters" applies them on the fly (no copy). None: "merged", or "adapters" with a
        quantised base (merging would dequantise it).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    quantize: str | None = None
    rollout: str | None = None

    def __post_init__(self):
        _check(self.rank, self.alpha, self.targets, self.quantize, self.rollout, "LoraConfig")
        if self.rollout is None:
            object.__setattr__(self, "rollout", "adapters" if self.quantize else "merged")

    @property
    def scale(self) -> float:
        """alpha / rank."""
        return self.alpha / self.rank

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], where: str = "model.lora") -> LoraConfig:
        """A config from `{rank, alpha, targets, quantize}` (missing keys take the defaults).

        Raises:
          ValueError: an unknown key or a bad value, naming `where.key`, the value and the fix.
        """
        if not isinstance(values, Mapping):
            raise ValueError(f"{where}={values!r} must be a mapping like {{rank: 8, alpha: 16, targets: [q, v]}}")
        unknown = [k for k in values if k not in _KEYS]
        if unknown:
            raise ValueError(f"{where} has unknown key(s) {unknown}; allowed keys: {list(_KEYS)}")
        fields = {name: values.get(name, getattr(cls, name)) for name in _KEYS}
        _check(*fields.values(), where)
        return cls(rank=fields["rank"], alpha=float(fields["alpha"]), targets=tuple(fields["targets"]),
                   quantize=fields["quantize"], rollout=fields["rollout"])

    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON)."""
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets), "quantize": self.quantize,
                "rollout": self.rollout}


def _check(rank: Any, alpha: Any, targets: Any, quantize: Any, rollout: Any, where: str) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}.rank={rank!r} must be a positive integer (e.g. 8)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"{where}.alpha={alpha!r} must be a positive number (e.g. 2 * rank = {2 * rank})")
    if isinstance(targets, str) or not isinstance(targets, Sequence) or not targets:
        raise ValueError(f"{where}.targets={targets!r} must be a non-empty list drawn from {list(TARGETS)}")
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"{where}.targets has unknown name(s) {unknown}; choose from {list(TARGETS)}")
    if len(set(targets)) != len(targets):
        raise ValueError(f"{where}.targets={list(targets)} names a projection twice; list each once")
    if quantize is not None and quantize not in QUANTIZE_TYPES:
        raise ValueError(f"{where}.quantize={quantize!r}; use one of {list(QUANTIZE_TYPES)} or null")
    if rollout is not None and rollout not in ROLLOUTS:
        raise ValueError(f"{where}.rollout={rollout!r}; use one of {list(ROLLOUTS)} or null")
    if rollout == "merged" and quantize is not None:
        raise ValueError(f"{where}.rollout='merged' would dequantise the {quantize} base for every rollout; "
                         "use rollout=adapters (the default with quantize)")


@dataclasses.dataclass(frozen=True)
class Site:
    """Where one target lives in a decoder layer: the Dense and the columns of its output."""

    block: str  # "attn" or "mlp"
    dense: str  # the Dense attribute: qkv_proj, o_proj, gate_up_proj, down_proj
    start: int
    size: int


def target_sites(config: ModelConfig) -> dict[str, Site]:
    """The Dense and output columns of each target in one layer of a model with `config`."""
    q, kv, inter, hidden = config.q_size, config.kv_size, config.intermediate_size, config.hidden_size
    return {"q": Site("attn", "qkv_proj", 0, q), "k": Site("attn", "qkv_proj", q, kv),
            "v": Site("attn", "qkv_proj", q + kv, kv), "o": Site("attn", "o_proj", 0, hidden),
            "gate": Site("mlp", "gate_up_proj", 0, inter), "up": Site("mlp", "gate_up_proj", inter, inter),
            "down": Site("mlp", "down_proj", 0, hidden)}


class LoraAdapters(nnx.Module):
    """The adapters of one Dense kernel: an (A, B) pair per targeted block of output columns.

    Args:
      in_features: the kernel's input width.
      out_features: the kernel's output width (all blocks, targeted or not).
      blocks: `(target, start, size)` of each targeted column block, in column order.
      rank: r.
      scale: alpha / r.
      axes: the kernel's logical axes (in, out); A gets (in, None), B (None, out).
      rngs: initialises A (He uniform, as `nnx.LoRA`); B starts at zero.
    """

    def __init__(self, in_features: int, out_features: int, blocks: Sequence[tuple[str, int, int]], rank: int,
                 scale: float, axes: tuple[str, str], *, rngs: nnx.Rngs):
        self.out_features, self.scale = out_features, scale
        self.blocks = tuple(sorted(blocks, key=lambda b: b[1]))
        for target, _, size in self.blocks:
            setattr(self, target, nnx.LoRA(
                in_features, rank, size, param_dtype=jnp.float32, rngs=rngs,
                a_metadata={"out_sharding": (axes[0], None), "eager_sharding": False},
                b_metadata={"out_sharding": (None, axes[1]), "eager_sharding": False}))

    def __call__(self, x2d: jax.Array) -> jax.Array:
        """[N, in] -> [N, out] float32: `scale * (x A_t) B_t` in each targeted block, 0 elsewhere.

        Two matmuls whatever the number of targets: `x [A_1 .. A_n]` then a block matrix whose
        row block t holds B_t in target t's columns (zeros elsewhere), so the fused kernels cost
        no more dispatches than a single projection (RESULTS.md: 223 -> 153 dots per update).
        """
        a, b = self._stacked()
        return jnp.dot(jnp.dot(x2d.astype(jnp.float32), a), b)

    def kernel_delta(self) -> jax.Array:
        """[in, out] float32: what merging adds to the base kernel (`scale * A_t B_t` per block)."""
        a, b = self._stacked()
        return jnp.dot(a, b)

    def _stacked(self) -> tuple[jax.Array, jax.Array]:
        """(A [in, n*r], scale * block B [n*r, out]) over the n targeted blocks."""
        pairs = [getattr(self, target) for target, _, _ in self.blocks]
        a = jnp.concatenate([p.lora_a[...] for p in pairs], axis=1) if len(pairs) > 1 else pairs[0].lora_a[...]
        rows = []
        for pair, (_, start, size) in zip(pairs, self.blocks):
            b = self.scale * pair.lora_b[...]
            rows.append(jnp.pad(b, ((0, 0), (start, self.out_features - start - size))))
        return a, jnp.concatenate(rows, axis=0) if len(rows) > 1 else rows[0]


def adapted_denses(model: Decoder) -> list[tuple[str, Dense]]:
    """`(path, Dense)` of every projection that carries adapters, in layer order."""
    out = []
    for i, layer in enumerate(model.layers):
        for block in ("attn", "mlp"):
            for name, dense in vars(getattr(layer, block)).items():
                if isinstance(dense, Dense) and dense.lora is not None:
                    out.append((f"layers.{i}.{block}.{name}", dense))
    return out


def apply_lora(model: Decoder, lora: LoraConfig, *, rngs: nnx.Rngs) -> Decoder:
    """A copy of `model` with adapters on the targeted projections; the base arrays are shared.

    Args:
      model: the base Decoder (not modified; its parameter arrays are reused, not copied).
      lora: ranks, scale and targets.
      rngs: initialises the A matrices.

    Returns:
      The adapted Decoder: `nnx.state(m, nnx.LoRAParam)` are the adapters, and the other
      `nnx.Param`s are exactly `model`'s.
    """
    mlp_targets = sorted(set(lora.targets) & {"gate", "up", "down"})
    if model.config.num_experts and mlp_targets:
        raise ValueError(f"LoraConfig.targets={list(lora.targets)}: LoRA on the MLP ({mlp_targets}) is not supported "
                         "for mixture-of-experts models (stacked expert kernels); target q, k, v, o.")
    adapted = nnx.clone(model)  # clone = split + merge: new module objects around the same arrays
    sites = target_sites(model.config)
    by_dense: dict[tuple[str, str], list[tuple[str, int, int]]] = {}
    for target in lora.targets:
        site = sites[target]
        by_dense.setdefault((site.block, site.dense), []).append((target, site.start, site.size))
    for layer in adapted.layers:
        for (block, name), blocks in by_dense.items():
            dense = getattr(getattr(layer, block), name)
            kernel = dense.kernel
            axes = kernel.get_metadata().get("out_sharding") or (None, None)
            dense.lora = LoraAdapters(kernel.shape[0], kernel.shape[1], blocks, lora.rank, lora.scale,
                                      tuple(axes), rngs=rngs)
    return adapted


def merge_adapters(adapted: Decoder) -> Decoder:
    """A plain Decoder (no adapters) whose targeted kernels are `W + scale * A B`.

    Works on concrete or traced parameters (jit it to merge on device). The base kernels must be
    plain arrays: a qwix-quantised base is dequantised first (`rlbolt.models.quantize.dequantize_model`).

    Args:
      adapted: a Decoder from `apply_lora` (or `nnx.merge` of its graphdef and state).

    Returns:
      A new Decoder; `adapted` is not modified.
    """
    merged = nnx.clone(adapted)
    for _, dense in adapted_denses(merged):
        kernel = dense.kernel[...]
        dense.kernel.set_value((kernel.astype(jnp.float32) + dense.lora.kernel_delta()).astype(kernel.dtype))
        dense.lora = None
    return merged


def lora_param_count(config: ModelConfig, lora: LoraConfig) -> int:
    """Trainable parameters: sum over layers and targets of r * (in + out) (Hu et al. 2021, Sec. 4)."""
    sites = target_sites(config)
    inputs = {"qkv_proj": config.hidden_size, "o_proj": config.q_size, "gate_up_proj": config.hidden_size,
              "down_proj": config.intermediate_size}
    per_layer = sum(lora.rank * (inputs[sites[t].dense] + sites[t].size) for t in lora.targets)
    return config.num_layers * per_layer
