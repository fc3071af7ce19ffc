"""The metadata ModelCheckpoint writes next to the arrays, and its validation on restore.

    format_version     FORMAT_VERSION
    progress           {step, policy_version, data_position}: the TrainState counters
    producer           {mode, lag_steps, next_step, next_data_position}: where the resumed
                       producer starts
    retained_weights   [[steps completed, policy version], ...]: async mode's older weights
    callbacks          {state_key: state_dict()}
    config             the run's resolved config (`config_guard.config_record`)
    model              what export needs to rebuild the network without the module (or None)
    frozen             what identifies the module's frozen params (a LoRA base), or None
    integrity          added by CheckpointIO: dtype, shape, checksum, finite, per array

A file that reads back may still hold nonsense (a hand edit, a damaged disk): `check` validates
every field and its type, and the relations between them, and raises `CheckpointCorrupt` with
the first problem, which makes the step unusable (the restore falls back to the step before).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbolt.checkpointing.integrity import CheckpointCorrupt
from rlbolt.utils.files import to_plain

FORMAT_VERSION = 2
MODES = ("sync", "async")


def build(run: Any, state: Any, retained_versions: list[list[int]], config: Mapping[str, Any] | None,
          model: Mapping[str, Any] | None, frozen: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The metadata of a checkpoint of `state` (see the module docstring); `run` is the fit's
    `rlbolt.run_info.RunInfo` (mode, lag, every callback's state)."""
    return {
        "format_version": FORMAT_VERSION,
        "progress": state.progress(),
        "producer": {"mode": run.mode, "lag_steps": run.lag_steps, "next_step": state.step,
                     "next_data_position": state.data_position},
        "retained_weights": retained_versions,
        "callbacks": run.callback_states(),
        "config": config,
        "model": model,
        "frozen": frozen,
    }


def _get(meta: Mapping, dotted: str) -> Any:
    value: Any = meta
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise CheckpointCorrupt(f"meta.{dotted} is missing")
        value = value[part]
    return value


def _count(meta: Mapping, dotted: str) -> int:
    value = _get(meta, dotted)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointCorrupt(f"meta.{dotted} is {value!r} ({type(value).__name__}), expected an integer >= 0")
    return value


def check(step: int, meta: Mapping[str, Any]) -> None:
    """Validates every field ModelCheckpoint reads.

    Raises:
      CheckpointCorrupt: naming the first bad field, its value and what was expected.
    """
    version = _get(meta, "format_version")
    if version != FORMAT_VERSION:
        raise CheckpointCorrupt(f"meta.format_version is {version!r}; this rlbolt reads format {FORMAT_VERSION} "
                                "(checkpoints with checksums)")
    saved_step = _count(meta, "progress.step")
    if saved_step != step:
        raise CheckpointCorrupt(f"meta.progress.step is {saved_step} inside the folder of step {step}")
    for name in ("progress.policy_version", "progress.data_position", "producer.lag_steps"):
        _count(meta, name)
    mode = _get(meta, "producer.mode")
    if mode not in MODES:
        raise CheckpointCorrupt(f"meta.producer.mode is {mode!r}, expected one of {list(MODES)}")
    for name, twin in (("producer.next_step", "progress.step"), ("producer.next_data_position", "progress.data_position")):
        if _count(meta, name) != _get(meta, twin):
            raise CheckpointCorrupt(f"meta.{name} is {_get(meta, name)} but meta.{twin} is {_get(meta, twin)}")
    retained, lag = _get(meta, "retained_weights"), meta["producer"]["lag_steps"]
    ok = isinstance(retained, list) and all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in p)
        and step - lag <= p[0] < step for p in retained)
    if not ok:
        raise CheckpointCorrupt(f"meta.retained_weights is {str(retained)[:100]}, expected [[k, version], ...] "
                                f"with {step - lag} <= k < {step}")
    callbacks = _get(meta, "callbacks")
    if not isinstance(callbacks, Mapping) or not all(isinstance(k, str) and isinstance(v, Mapping) for k, v in callbacks.items()):
        raise CheckpointCorrupt(f"meta.callbacks is {str(callbacks)[:100]}, expected {{name: state}}")
    for name in ("config", "model", "frozen"):
        value = _get(meta, name)
        if value is not None and not isinstance(value, Mapping):
            raise CheckpointCorrupt(f"meta.{name} is {type(value).__name__}, expected a mapping or null")


class FrozenParamsMismatch(ValueError):
    """A checkpoint was trained on other frozen params (a LoRA base) than this run loads."""


def check_frozen_identity(saved: dict | None, current: dict | None, directory: Path) -> None:
    """Refuses to restore a checkpoint whose frozen params differ from this run's.

    Args:
      saved: the `frozen` record of the checkpoint's meta (None: it had no frozen params).
      current: `module.frozen_identity()` now. Its "path" key is informational (a copied base
        may move); every other key must be equal.
      directory: named in the message.

    Raises:
      FrozenParamsMismatch: one line naming both bases and the fix.
    """
    if saved is None and current is None:
        return
    if saved is None or current is None:
        has = lambda x: "with a frozen base (LoRA)" if x else "without frozen params (full fine-tuning)"
        raise FrozenParamsMismatch(f"checkpoint in {directory} was written {has(saved)} but this run is {has(current)}; "
                                   "resume with the same model.lora setting or use a fresh run directory")
    differ = sorted(k for k in set(saved) | set(current) if k != "path" and saved.get(k) != current.get(k))
    if differ:
        show = lambda x: ", ".join(f"{k}={str(x.get(k))[:16]}" for k in ["path", *differ])
        raise FrozenParamsMismatch(f"checkpoint in {directory} was trained on the base {show(saved)} but this run loads "
                                   f"{show(current)}; point model.path at the base the run was trained on, or use a "
                                   "fresh run directory")


def model_record(card: Any, params: Any) -> dict[str, Any] | None:
    """What `rlbolt export` needs to rebuild the network from a checkpoint alone, or None when
    the module declares no language model (`card` is `RLModule.card()`: None) or its model
    config is not an rlbolt `ModelConfig`.

    Returns:
      {"config": the ModelConfig fields, "params_key": the key of the policy's parameters inside
      the trainable pytree (None: the pytree is the policy's), "tokenizer_folder": a folder whose
      tokenizer files go with an export, or None}.
    """
    from rlbolt.models.config import ModelConfig

    if card is None or not isinstance(card.model_config, ModelConfig):
        return None
    config, key = card.model_config, None
    sub = card.policy_params(params)
    if sub is not params:
        keys = [k for k, v in params.items() if v is sub] if isinstance(params, Mapping) else []
        if len(keys) != 1:
            return None  # the policy is not one top-level entry: export cannot find it
        key = str(keys[0])
    folder = card.tokenizer_folder
    return {"config": to_plain(dataclasses.asdict(config)), "params_key": key,
            "tokenizer_folder": str(folder) if folder else None}
