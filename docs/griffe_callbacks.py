"""A griffe extension for the API reference: reads the top-level `callbacks/` folder as
`rlbolt.callbacks`, the name it is installed under (pyproject.toml maps the folder), so the
reference is built from the source files alone, without importing anything."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parents[1]


class InstalledCallbacks(griffe.Extension):
    """Attaches `callbacks/` to the loaded `rlbolt` package as its member `callbacks`."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "rlbolt" or "callbacks" in pkg.members:
            return
        callbacks = griffe.load("callbacks", search_paths=[ROOT], docstring_parser=loader.docstring_parser,
                                docstring_options=loader.docstring_options, lines_collection=loader.lines_collection,
                                resolve_aliases=False)
        pkg.set_member("callbacks", callbacks)
