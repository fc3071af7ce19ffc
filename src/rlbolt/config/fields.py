"""Config field helpers: a field with help text and choices, and type checking of raw values.

Generic over any frozen dataclass; `rlbolt.config` declares the sections with them.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field and the fix."""


def option(default: Any, help: str, choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None, *,
           at_least: float | None = None,
           above: float | None = None, at_most: float | None = None):
    """A dataclass field with help text, and what values it allows.

    Args:
      default: the default value (a dict or list is copied per instance).
      help: one line for `rlbolt fit --list-fields`.
      choices: the allowed values of an enum-like field, or a function returning them (a registry's
        names: `rlbolt.config.registries`; `resolve` checks those, after objects.module is imported).
      at_least: numbers must be >= this.
      above: numbers must be > this.
      at_most: numbers must be <= this.
    """
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices if callable(choices) else tuple(choices)
    bounds = {k: v for k, v in (("at_least", at_least), ("above", above), ("at_most", at_most)) if v is not None}
    if bounds:
        meta["bounds"] = bounds
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def field_choices(metadata: Mapping[str, Any]) -> tuple | None:
    """A field's allowed values (a registry's names when its choices are a function), or None."""
    choices = metadata.get("choices")
    return tuple(choices()) if callable(choices) else choices


def _allowed(tp: Any) -> tuple[list[Any], bool]:
    """(the non-None types of a field annotation, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = list(typing.get_args(tp))
        return [a for a in args if a is not type(None)], type(None) in args
    return [tp], False


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


# What people type for a number that YAML 1.1 reads as a string: `1e-4`, `+2E3` (YAML wants `1.0e-4`).
_NUMBER = re.compile(r"[+-]?(\d[\d_]*\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _as_number(value: Any) -> Any:
    """`value` as a float when it is a string holding a number in exponent form; else unchanged."""
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value.strip().replace("_", ""))
    return value


def coerce(where: str, value: Any, tp: Any, choices: tuple | None, bounds: Mapping[str, float] | None = None) -> Any:
    """`value` checked against the annotation `tp` (and `choices`, `bounds`), converted where YAML
    and the command line differ (int -> float, "1e-4" -> 0.0001, 1e4 -> 10000 for an int,
    list -> tuple, "a,b" -> tuple, `token_mean` -> `token-mean`, and for a choice of "on" / "off"
    YAML's booleans for those words back to them).

    Raises:
      ConfigError: naming `where` (e.g. "trainer.max_steps"), the value, and what is expected.
    """
    types_, nullable = _allowed(tp)
    expected = " or ".join(_type_name(t) for t in types_) + (" or null" if nullable else "")
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{where}=null is not allowed; expected {expected}")
    if int in types_ or float in types_:
        value = _as_number(value)
    out = _NOT_MATCHED
    for t in types_:
        if t is bool and isinstance(value, bool):
            out = value
        elif t is int and isinstance(value, int) and not isinstance(value, bool):
            out = value
        elif t is int and float not in types_ and isinstance(value, float) and value.is_integer():
            out = int(value)  # `1e4` steps
        elif t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif t is str and isinstance(value, str):
            out = value
        elif t is str and isinstance(value, bool) and choices is not None and {"on", "off"} <= set(choices):
            out = "on" if value else "off"  # YAML 1.1 reads a bare `on` / `off` as a bool
        elif t is dict and isinstance(value, Mapping):
            out = dict(value)
        elif t is tuple and isinstance(value, (list, tuple)):
            out = tuple(value)
        elif t is tuple and isinstance(value, str):  # `callbacks.metrics=console` on the command line
            out = tuple(v.strip() for v in value.split(",") if v.strip())
        if out is not _NOT_MATCHED:
            break
    if out is _NOT_MATCHED:
        raise ConfigError(f"{where}={value!r} has type {type(value).__name__}; expected {expected}")
    if choices is not None and isinstance(out, str) and out not in choices and out.replace("_", "-") in choices:
        out = out.replace("_", "-")  # `token_mean` reads as `token-mean`
    if choices is not None and out not in choices:
        raise ConfigError(f"{where}={out!r} is not allowed; choose one of {list(choices)}" + closest(str(out), choices))
    if isinstance(out, float) and not math.isfinite(out):
        raise ConfigError(f"{where}={out!r} is not a finite number; give a number" + (" or null" if nullable else ""))
    if bounds and isinstance(out, (int, float)) and not isinstance(out, bool):
        check_bounds(where, out, bounds, nullable)
    return out


def check_bounds(where: str, value: float, bounds: Mapping[str, float], nullable: bool = False) -> None:
    """Raises ConfigError when `value` lies outside `bounds` (at_least / above / at_most)."""
    problems = []
    if "at_least" in bounds and value < bounds["at_least"]:
        problems.append(f">= {bounds['at_least']}")
    if "above" in bounds and value <= bounds["above"]:
        problems.append(f"> {bounds['above']}")
    if "at_most" in bounds and value > bounds["at_most"]:
        problems.append(f"<= {bounds['at_most']}")
    if problems:
        raise ConfigError(f"{where}={value!r} must be {' and '.join(problems)}" + (" (or null)" if nullable else ""))


def describe_bounds(bounds: Mapping[str, float]) -> str:
    """' (>= 1)' style text for `--list-fields`, or ''."""
    parts = [f"{sign} {bounds[key]}" for key, sign in (("at_least", ">="), ("above", ">"), ("at_most", "<="))
             if key in bounds]
    return f" ({', '.join(parts)})" if parts else ""


_NOT_MATCHED = object()


def closest(name: str, options: Sequence[Any]) -> str:
    """' (did you mean ...?)' for the nearest option, or ''."""
    match = difflib.get_close_matches(name, [str(o) for o in options], n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""
