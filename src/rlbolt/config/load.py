"""Reading, resolving and writing a run config.

`load_config` reads a YAML file (or a dict), applies `section.key=value` overrides (values
parsed as YAML scalars: `trainer.max_steps=10`, `model.path=/local/qwen`, `algorithm.beta=0.04`),
checks every key and type, and fills algorithm-dependent defaults (`None` = "the algorithm's
choice", declared by the algorithm's module class) so `save_config` writes the fully resolved run.

    cfg = load_config("recipes/configs/grpo_gsm8k.yaml", ["trainer.max_steps=3"])
    save_config(cfg, run_dir / "config.yaml")
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from rlbolt.config.algorithms import algorithm_defaults, algorithm_names, import_algorithm
from rlbolt.config.fields import ConfigError, closest as _closest, coerce as _coerce, describe_bounds, field_choices
from rlbolt.config.rules import check_rules
from rlbolt.config.registries import objective_fills
from rlbolt.config.sections import SECTIONS, RunConfig, default_reward_weights
from rlbolt.utils.files import to_plain, write_text_atomic

def _build_section(name: str, values: Mapping[str, Any]) -> Any:
    cls = SECTIONS[name]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(
                f"unknown key {name}.{key}{_closest(str(key), list(fields))}; allowed keys in [{name}]: {sorted(fields)}"
            )
        meta = fields[key].metadata
        # A registry's choices (a function) are checked by `resolve`, after objects.module (which may
        # register a user's entries) is imported.
        choices = None if callable(meta.get("choices")) else meta.get("choices")
        kwargs[key] = _coerce(f"{name}.{key}", value, hints[key], choices, meta.get("bounds"))
    return cls(**kwargs)


# -- reading and writing ---------------------------------------------------------------------------
def _parse_override(text: str) -> tuple[str, str, Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value (e.g. trainer.max_steps=10)")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override {text!r}: the key must be section.key, e.g. algorithm.beta=0.04")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as error:
        raise ConfigError(f"override {text!r}: cannot parse the value as YAML ({error})") from None
    return parts[0], parts[1], value


def _check_section_name(name: Any, origin: str) -> None:
    if name not in SECTIONS:
        raise ConfigError(
            f"unknown section {name!r} in {origin}{_closest(str(name), list(SECTIONS))}; allowed sections: {list(SECTIONS)}"
        )


def load_config(source: str | Path | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Reads, overrides, validates and resolves a run config.

    Args:
      source: a YAML file path, a dict `{section: {key: value}}`, or None for all defaults.
      overrides: `section.key=value` strings applied in order after the file; values are parsed
        as YAML scalars (`10`, `0.04`, `null`, `true`, `[console, jsonl]`).

    Returns:
      The resolved RunConfig (algorithm-dependent None fields filled in).

    Raises:
      ConfigError: an unknown section or key (the closest valid name is suggested), a value of
        the wrong type, or a value outside an enum-like field's choices.
    """
    origin = "the config dict"
    if source is None:
        raw: dict = {}
    elif isinstance(source, Mapping):
        raw = {k: dict(v or {}) if isinstance(v, Mapping) else v for k, v in source.items()}
    else:
        path = Path(source)
        origin = str(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; pass an existing YAML file or omit --config")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
        raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for name, values in raw.items():
        _check_section_name(name, origin)
        if values is None:
            raw[name] = {}
        elif not isinstance(values, dict):
            raise ConfigError(f"section {name!r} in {origin} must be a mapping of key: value, got {values!r}")
    for text in overrides:
        section, key, value = _parse_override(text)
        _check_section_name(section, f"override {text!r}")
        raw.setdefault(section, {})[key] = value
    cfg = RunConfig(**{name: _build_section(name, raw.get(name, {})) for name in SECTIONS})
    return resolve(cfg)


def resolve(cfg: RunConfig) -> RunConfig:
    """Fills the algorithm-dependent defaults (fields left None, from the algorithm's module class:
    `rlbolt.config.algorithms`) and checks cross-field rules."""
    algo = cfg.algorithm
    if cfg.objects.module is not None:  # importing the class registers its algorithm name
        named = import_algorithm(cfg.objects.module).algorithm_name
        if algo.name not in (named, "grpo"):  # "grpo" is the field's default
            raise ConfigError(f"algorithm.name={algo.name!r} but objects.module={cfg.objects.module!r} is algorithm "
                              f"{named!r}; set algorithm.name={named} or leave it out")
        algo = dataclasses.replace(algo, name=named)
    chosen = algorithm_defaults(algo.name, cfg)
    policy_loss = algo.policy_loss or chosen.get("policy_loss", "ppo")
    chosen = {**chosen, **objective_fills(policy_loss), "policy_loss": policy_loss}
    fills = {k: v for k, v in chosen.items() if getattr(algo, k, None) is None}
    algo = dataclasses.replace(algo, **fills)
    if algo.importance_cap is not None and algo.rollout_correction not in (None, "tis"):
        raise ConfigError(f"algorithm.importance_cap={algo.importance_cap} is rollout_correction=tis, but "
                          f"rollout_correction={algo.rollout_correction}; set one of them")
    if algo.rollout_correction is None:  # a non-native engine's logps are not the trainer's: correct by default
        correct = algo.importance_cap is not None or cfg.rollout.engine != "native"
        algo = dataclasses.replace(algo, rollout_correction="tis" if correct else "none")
    if algo.importance_cap is not None:
        algo = dataclasses.replace(algo, rollout_correction_cap=algo.importance_cap)
    plan = cfg.plan
    if plan.max_refill_rounds is None:
        plan = dataclasses.replace(plan, max_refill_rounds=4 if algo.dynamic_sampling else 0)
    reward = cfg.reward
    if reward.weights is None:  # the environment's reward counts by default (rollout.env)
        reward = dataclasses.replace(reward, weights=default_reward_weights(cfg.rollout.env is not None))
    model = _resolve_package_paths(cfg.model, "model", ("path", "tokenizer"))
    algo = _resolve_package_paths(algo, "algorithm", ("distill_teacher",))
    if model.lora is not None:  # written back in full, so config.yaml shows every LoRA setting
        model = dataclasses.replace(model, lora=_resolve_lora(model.lora))
    cfg = dataclasses.replace(cfg, model=model, algorithm=algo, plan=plan, reward=reward)
    check_rules(cfg)
    return cfg


def _resolve_package_paths(section: Any, name: str, keys: tuple[str, ...]) -> Any:
    """The section's path fields given as `package:NAME/file` -> the installed file's path
    (model.path, model.tokenizer, algorithm.distill_teacher: every field that names a model)."""
    from rlbolt.utils.package_files import is_package_path, resolve_package_path

    fills = {}
    for key in keys:
        value = getattr(section, key)
        if is_package_path(value):
            try:
                fills[key] = resolve_package_path(value, field=f"{name}.{key}")
            except ValueError as error:
                raise ConfigError(str(error)) from None
    return dataclasses.replace(section, **fills) if fills else section


def _resolve_lora(values: dict) -> dict:
    from rlbolt.models.lora import LoraConfig  # imports JAX: only when LoRA is asked for

    try:
        return LoraConfig.from_mapping(values, where="model.lora").to_dict()
    except ValueError as error:
        raise ConfigError(str(error)) from None


def config_to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """The config as plain YAML-able data: `{section: {key: value}}` (tuples become lists)."""
    out = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        out[name] = {f.name: to_plain(getattr(section, f.name)) for f in dataclasses.fields(section)}
    return out


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Writes the fully resolved config as YAML (atomically: a temp file renamed into place).

    Args:
      cfg: the run config.
      path: the target file; parent folders are created.

    Returns:
      The written path.
    """
    return write_text_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def describe_fields() -> str:
    """Every section, key, default and help line (for `--help` screens)."""
    lines = []
    for name, cls in SECTIONS.items():
        lines.append(f"[{name}] {cls.__doc__.strip()}")
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            choices = algorithm_names() if (name, f.name) == ("algorithm", "name") else field_choices(f.metadata)
            extra = (f" (one of {list(choices)})" if choices else "") + describe_bounds(f.metadata.get("bounds", {}))
            lines.append(f"  {name}.{f.name} = {default!r}: {f.metadata['help']}{extra}")
    return "\n".join(lines)
