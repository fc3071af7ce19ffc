"""A named registry: what a config field may name, filled by the code that defines each entry.

One instance per kind (policy objectives, reward terms, demo tasks, batch columns), declared
next to the entries it holds. The entries register themselves where they are defined, so adding
one touches one file; the config asks the registry for its names instead of keeping a list.

A registry may name the modules that define its ready entries (`ready`): they are imported by
name on the first look-up, so a light module (the config) can hold a registry's choices without
importing what they need (JAX) until a value is checked.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries by name, in registration order (the ready ones first).

    Args:
      kind: what an entry is, for messages ("policy objective").
      field: the config field that names an entry ("algorithm.policy_loss"), for messages.
      ready: modules (dotted names) whose import registers the ready entries.
    """

    def __init__(self, kind: str, field: str, ready: tuple[str, ...] = ()) -> None:
        self.kind = kind
        self.field = field
        self._ready = ready
        self._entries: dict[str, T] = {}
        self._owners: dict[str, str] = {}

    def register(self, name: str, entry: T, *, owner: str | None = None) -> T:
        """Adds `entry` under `name` and returns it.

        Args:
          name: a non-empty string.
          entry: what the name stands for.
          owner: where the entry is defined (`module.qualname`); registering the same owner again
            (a reload) replaces the older entry, another owner may not take a held name.

        Raises:
          ValueError: the name is empty, or another owner holds it.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        owner = owner or _owner_of(entry)
        held = self._owners.get(name)
        if name in self._entries and held != owner:
            raise ValueError(f"{self.kind} {name!r} is already {held}; register {owner} under another name")
        self._entries[name] = entry
        self._owners[name] = owner
        return entry

    def unregister(self, name: str) -> None:
        """Removes `name` (a test's or a notebook's entry); a name not held is ignored."""
        self._entries.pop(name, None)
        self._owners.pop(name, None)

    def _load_ready(self) -> None:
        for module in self._ready:
            importlib.import_module(module)  # by name: a light caller does not import the entries' layer

    def names(self) -> tuple[str, ...]:
        """Every registered name, the ready ones first."""
        self._load_ready()
        return tuple(self._entries)

    def get(self, name: str) -> T:
        """The entry registered as `name`.

        Raises:
          KeyError: one line naming the field, the value, the closest name and every name.
        """
        self._load_ready()
        if name not in self._entries:
            match = difflib.get_close_matches(str(name), list(self._entries), n=1)
            hint = f" (did you mean {match[0]!r}?)" if match else ""
            raise KeyError(f"{self.field}={name!r} is not a registered {self.kind}{hint}; "
                           f"choose from {list(self._entries)}")
        return self._entries[name]

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        self._load_ready()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())


def _owner_of(entry: object) -> str:
    module = getattr(entry, "__module__", None) or type(entry).__module__
    name = getattr(entry, "__qualname__", None) or type(entry).__qualname__
    return f"{module}.{name}"
