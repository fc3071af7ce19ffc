"""Config field helpers: a field with help text and choices, and type checking of raw values.

Generic over any frozen dataclass; `rlbolt.app.config` declares the sections with them.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the field and the fix."""


def option(default: Any, help: str, choices: Sequence[Any] | None = None):
    """A dataclass field with help text (and allowed values for enum-like fields)."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _allowed(tp: Any) -> tuple[list[Any], bool]:
    """(the non-None types of a field annotation, whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = list(typing.get_args(tp))
        return [a for a in args if a is not type(None)], type(None) in args
    return [tp], False


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def coerce(where: str, value: Any, tp: Any, choices: tuple | None) -> Any:
    """`value` checked against the annotation `tp` (and `choices`), converted where YAML and the
    command line differ (int -> float, list -> tuple, "a,b" -> tuple, `token_mean` -> `token-mean`).

    Raises:
      ConfigError naming `where` (e.g. "trainer.max_steps"), the value, and what is expected.
    """
    types_, nullable = _allowed(tp)
    expected = " or ".join(_type_name(t) for t in types_) + (" or null" if nullable else "")
    if value is None:
        if nullable:
            return None
        raise ConfigError(f"{where}=null is not allowed; expected {expected}")
    out = _NOT_MATCHED
    for t in types_:
        if t is bool and isinstance(value, bool):
            out = value
        elif t is int and isinstance(value, int) and not isinstance(value, bool):
            out = value
        elif t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value)
        elif t is str and isinstance(value, str):
            out = value
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
    return out


_NOT_MATCHED = object()


def closest(name: str, options: Sequence[Any]) -> str:
    """' (did you mean ...?)' for the nearest option, or ''."""
    match = difflib.get_close_matches(name, [str(o) for o in options], n=1)
    return f" (did you mean {match[0]!r}?)" if match else ""
