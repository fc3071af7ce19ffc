"""LoRA adapters out in PEFT's layout: `adapter_config.json` + `adapter_model.safetensors`.

What `peft.PeftModel.from_pretrained(base, folder)` and vLLM's LoRA loader read:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   [out, r]
    ... one pair per target module (q/k/v/o_proj, gate/up/down_proj) and layer

PEFT stores `nn.Linear`-style [out, in] matrices and computes `W x + (alpha / r) B (A x)`;
rlbolt keeps A [in, r] and B [r, out] and computes `x W + (alpha / r) (x A) B`, so each is the
other's transpose and the config's `r` / `lora_alpha` carry the same scale. The folder is written
under a temporary name and renamed into place, so a crash never leaves half of it.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import jax
import numpy as np
import safetensors.numpy

from rlbolt.models.decoder import Decoder
from rlbolt.utils.files import replace_folder
from rlbolt.models.lora import HF_MODULES, TARGETS, LoraConfig, target_sites
from rlbolt.utils.files import default_file_mode

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_tensors(adapted: Decoder, lora: LoraConfig) -> dict[str, np.ndarray]:
    """The adapters of an `apply_lora` Decoder as PEFT's named [r, in] / [out, r] tensors."""
    sites = target_sites(adapted.config)
    tensors = {}
    for i, layer in enumerate(adapted.layers):
        for target in lora.targets:
            site = sites[target]
            adapters = getattr(getattr(layer, site.block), site.dense).lora
            if adapters is None or not hasattr(adapters, target):
                raise ValueError(f"layer {i} has no {target!r} adapter; the model was adapted with other targets "
                                 f"than {list(lora.targets)}")
            pair = getattr(adapters, target)
            prefix = f"base_model.model.model.layers.{i}.{HF_MODULES[target]}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(pair.lora_a[...])).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(pair.lora_b[...])).T)
    return tensors


def peft_config(lora: LoraConfig, base_model: str | None) -> dict:
    """adapter_config.json: the fields PEFT's LoraConfig and vLLM's PEFT helper read."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
        "target_modules": sorted(HF_MODULES[t].split(".")[-1] for t in sorted(lora.targets, key=TARGETS.index)),
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def save_peft_adapter(adapted: Decoder, lora: LoraConfig, folder: str | os.PathLike, *,
                      base_model: str | None = None, overwrite: bool = False) -> Path:
    """Writes the adapters of `adapted` as a PEFT LoRA folder.

    Args:
      adapted: a Decoder from `rlbolt.models.lora.apply_lora` holding the trained adapters.
      lora: the LoraConfig it was adapted with (rank, alpha, targets).
      folder: the output folder.
      base_model: recorded as `base_model_name_or_path` (the base's folder or hub name).
      overwrite: replace an existing folder; False raises FileExistsError.

    Returns:
      The folder.
    """
    folder = Path(folder)
    if folder.exists() and not overwrite:
        raise FileExistsError(f"{folder} exists; pass overwrite=True or choose another folder")
    tensors = peft_tensors(adapted, lora)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".{folder.name}.tmp-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        (staging / ADAPTER_CONFIG).write_text(json.dumps(peft_config(lora, base_model), indent=2) + "\n")
        safetensors.numpy.save_file(tensors, str(staging / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        os.chmod(staging / ADAPTER_WEIGHTS, default_file_mode())  # safetensors creates its files 0600
        replace_folder(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder
