"""Python objects in a config: importable references (`package.module:name`) both ways.

`build_run(cfg, reward=score)` trains with a Python object instead of what the config names.
For `rlbolt resume` to rebuild the same run, config.yaml must say so: `reference_of(score)`
gives `"mypkg.rewards:score"` when importing that name gives back the very same object, and
`import_reference` imports it again at resume (a module-level instance, `REWARD = WeightedReward(...)`,
is found by the name that holds it). An object that cannot be found that way (a lambda, a
function defined in the script being run, an instance built at run time) is recorded as a
`<not importable: ...>` note, so resume refuses in one line instead of silently training with
the config's own settings.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from typing import Any

from rlbolt.config.fields import ConfigError

NOT_IMPORTABLE = "<not importable"


def reference_of(obj: Any) -> str | None:
    """`"package.module:name"` when importing it gives back `obj` itself; else None.

    A function or class is found by its `__module__` and `__qualname__`; any other object (a
    `WeightedReward` instance, a `functools.partial`) by the module-level name that holds it
    in an imported module.

    Args:
      obj: the object.

    Returns:
      The reference, or None (lambdas, nested functions, objects of `__main__` or built at run time).
    """
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    candidates = []
    if isinstance(module, str) and isinstance(name, str) and module != "__main__" and "<" not in name:
        candidates.append(f"{module}:{name}")
    else:
        candidates += _module_level_names(obj)
    for reference in candidates:
        try:
            if _import(reference) is obj:
                return reference
        except (ImportError, AttributeError):
            continue
    return None


def _module_level_names(obj: Any) -> list[str]:
    """`module:name` for every imported module (but `__main__`) holding `obj` at its top level."""
    out = []
    for module_name, module in sorted(sys.modules.items()):
        if module is None or module_name == "__main__" or module_name.startswith("_"):
            continue
        try:
            found = [name for name, value in vars(module).items() if value is obj and not name.startswith("_")]
        except TypeError:
            continue
        out += [f"{module_name}:{name}" for name in found]
    return out


def record(obj: Any) -> str:
    """What config.yaml holds for `obj`: its reference, or a `<not importable: ...>` note."""
    reference = reference_of(obj)
    if reference is not None:
        return reference
    kind = type(obj).__name__
    where = getattr(obj, "__module__", None) or type(obj).__module__
    name = getattr(obj, "__qualname__", None)
    what = f"{kind} {name}" if name else f"a {kind} instance"
    return f"{NOT_IMPORTABLE}: {what} from {where}>"


def import_reference(value: str, field: str) -> Any:
    """Imports the object a config field names.

    Args:
      field: the config field, e.g. "objects.reward" (named in errors).
      value: `"package.module:name"`, or a note written by `record`.

    Returns:
      The object.

    Raises:
      ConfigError: the run was built from an object that cannot be imported, or the reference
        does not import (its one line names the field once: callers pass it on unchanged).
    """
    if value.startswith(NOT_IMPORTABLE):
        raise ConfigError(
            f"{field}: this run was built with a Python object that rlbolt cannot import ({value[1:-1]}); continue it "
            "by running the script that built it again, or pass build_run a module-level object from an importable module")
    if value.count(":") != 1 or not all(value.split(":")):
        raise ConfigError(f"{field}={value!r} must look like 'package.module:name' (e.g. 'mypkg.rewards:score')")
    try:
        return _import(value)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"{field}={value!r} does not import ({type(error).__name__}: {error}); check the name and "
                          "that its package is installed or on PYTHONPATH") from None
    except Exception as error:  # noqa: BLE001 - the module raised while it was imported: a bug in it, named here
        raise ConfigError(f"{field}={value!r}: importing {value.partition(':')[0]} raised {type(error).__name__}: "
                          f"{_first_line(error)}; fix that module") from None


def import_all(section: Any, names: tuple[str, ...] = ("model", "tokenizer", "reward")) -> dict[str, Any]:
    """`{name: object}` for the fields `names` of an ObjectsSection that are set (see `import_reference`)."""
    values = section if isinstance(section, Mapping) else vars(section)
    values = {k: v for k, v in values.items() if k in names}
    return {name: import_reference(value, f"objects.{name}") for name, value in values.items() if value is not None}


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def _import(reference: str) -> Any:
    module_name, _, qualname = reference.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
