"""The algorithms a config can name: `algorithm.name` -> the RLModule class that trains it.

An algorithm is a module class with its own `algorithm_name`; defining one registers it (see
`RLModule.__init_subclass__`), so a user's subclass is accepted by the config, the CLI and
`rlbolt resume` without editing rlbolt. The class also declares the paper settings it fills in
for algorithm fields left None (`algorithm_defaults`). The ready modules register when
`rlbolt.modules` is imported, which the first look-up does.

    class MyGRPO(GRPO):
        algorithm_name = "my-grpo"
        algorithm_defaults = {"clip_high": 0.3}

    load_config({"algorithm": {"name": "my-grpo"}})      # after the class was imported, or with
    load_config({"objects": {"module": "mypkg.algos:MyGRPO"}})   # which imports it
"""

from __future__ import annotations

import importlib
from typing import Any

from rlbolt.config.fields import ConfigError, closest

# The algorithm fields every algorithm fills the same way unless its class says otherwise.
GENERIC_DEFAULTS: dict[str, Any] = {"clip_low": 0.2, "clip_high": 0.2, "dynamic_sampling": False,
                                    "overlong_cache_length": 0, "loss_aggregation": "token-mean", "policy_loss": "ppo"}
_READY_MODULES = "rlbolt.modules"  # importing it registers the ready algorithms
_REGISTRY: dict[str, type] = {}


def register_algorithm(cls: type) -> type:
    """Registers `cls` under its `algorithm_name` (called for every class that defines one).

    Raises:
      ValueError: another class already holds the name (a class defined again under the same
        module and name, as a reload does, replaces its older self).
    """
    name = cls.__dict__.get("algorithm_name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__qualname__}.algorithm_name must be a non-empty string, got {name!r}")
    held = _REGISTRY.get(name)
    if held is not None and (held.__module__, held.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"algorithm name {name!r} is already {held.__module__}.{held.__qualname__}; give "
                         f"{cls.__module__}.{cls.__qualname__} another algorithm_name")
    _REGISTRY[name] = cls
    return cls


def _load_ready_modules() -> None:
    importlib.import_module(_READY_MODULES)  # by name: the config layer does not import the modules layer


def algorithm_names() -> tuple[str, ...]:
    """Every registered algorithm name, the ready ones first."""
    _load_ready_modules()
    return tuple(_REGISTRY)


def algorithm_class(name: str) -> type:
    """The module class registered as `name`.

    Raises:
      ConfigError: no class has that name (the closest names are suggested).
    """
    _load_ready_modules()
    if name not in _REGISTRY:
        raise ConfigError(f"algorithm.name={name!r} is not a registered algorithm{closest(str(name), list(_REGISTRY))}; "
                          f"choose from {list(_REGISTRY)}, or name your RLModule class in objects.module "
                          "('package.module:Class', a class with its own algorithm_name)")
    return _REGISTRY[name]


def algorithm_defaults(name: str, cfg: Any) -> dict[str, Any]:
    """The values algorithm `name` fills in for its fields left None: the generic ones, then
    its class's `algorithm_defaults` (a value may be a function of the whole config)."""
    declared = dict(getattr(algorithm_class(name), "algorithm_defaults", {}) or {})
    out = {**GENERIC_DEFAULTS, **declared}
    return {k: (v(cfg) if callable(v) else v) for k, v in out.items()}


def import_algorithm(reference: str) -> type:
    """The RLModule class an importable reference names ('package.module:Class'); importing it
    registers its algorithm name.

    Raises:
      ConfigError: the reference does not import, or is not a class with its own algorithm_name.
    """
    from rlbolt.config.references import import_reference

    cls = import_reference(reference, "objects.module")
    if not isinstance(cls, type) or "algorithm_name" not in cls.__dict__:
        raise ConfigError(f"objects.module={reference!r} must name an RLModule class that sets its own "
                          "algorithm_name (e.g. class MyGRPO(GRPO): algorithm_name = 'my-grpo')")
    register_algorithm(cls)
    return cls
