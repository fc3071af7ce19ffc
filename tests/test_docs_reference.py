"""The API reference is generated at build time (docs/gen_reference.py, run by mkdocs); these
tests keep it complete and readable: every public module Python finds gets a page, private
modules get none, every name a public package exports is documented on some module's page, and
no method shows a docstring inherited from a base class that describes another algorithm."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlbolt", "rlbolt.algorithms", "rlbolt.modules", "rlbolt.callbacks", "rlbolt.rewards", "rlbolt.data",
            "rlbolt.models", "rlbolt.rollout", "rlbolt.loggers")


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # __name__ is "gen_reference": nothing is written
    return module


def _python_finds() -> dict[str, bool]:
    """Every module and package of the installed rlbolt, as the import system sees it."""
    import rlbolt
    import rlbolt.callbacks

    found = {"rlbolt": True, "rlbolt.callbacks": True}
    for root, prefix in ((rlbolt, "rlbolt."), (rlbolt.callbacks, "rlbolt.callbacks.")):
        found |= {info.name: info.ispkg for info in pkgutil.walk_packages(root.__path__, prefix)}
    return found


def _public(name: str) -> bool:
    return not any(part.startswith("_") for part in name.split("."))


def test_every_public_module_has_a_page_and_no_private_one_does():
    pages = _generator().public_modules()
    found = _python_finds()
    expected = {name: ispkg for name, ispkg in found.items() if _public(name)}
    assert pages == expected, (f"missing pages: {sorted(set(expected) - set(pages))}; "
                               f"pages of no module: {sorted(set(pages) - set(expected))}")
    private = [name for name in found if not _public(name) and name != "rlbolt.__main__"]
    assert private, "expected private modules (e.g. rlbolt.rewards._reward_worker) to exist and stay off the site"
    assert "rlbolt.__main__" not in pages


def test_page_paths_are_distinct_and_packages_become_index_pages():
    gen = _generator()
    pages = gen.public_modules()
    paths = [gen.page_path(name, package) for name, package in pages.items()]
    assert len(set(paths)) == len(paths)
    assert gen.page_path("rlbolt.producer.dock", True).as_posix() == "rlbolt/producer/dock/index.md"
    assert gen.page_path("rlbolt.producer.dock.store", False).as_posix() == "rlbolt/producer/dock/store.md"
    text = gen.page_text("rlbolt.producer.dock.store", False)
    assert re.search(r"^::: rlbolt\.producer\.dock\.store$", text, re.M)
    assert "members: false" in gen.page_text("rlbolt.producer.dock", True)


def _documented(module_name: str) -> set[str]:
    module = importlib.import_module(module_name)
    return {name for name, obj in vars(module).items()
            if not name.startswith("_") and getattr(obj, "__module__", None) == module_name}


def test_every_exported_name_is_defined_in_a_module_with_a_page():
    pages = _generator().public_modules()
    missing = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names = getattr(package, "__all__", None) or [n for n in vars(package) if not n.startswith("_")]
        for name in names:
            obj = getattr(package, name)
            home = getattr(obj, "__module__", None)
            if not (inspect.isclass(obj) or inspect.isfunction(obj) or hasattr(obj, "__wrapped__")):
                continue
            if home not in pages or name not in _documented(home):
                missing.append(f"{package_name}.{name} (defined in {home})")
    assert not missing, f"exported but on no reference page (defined in a private module?): {missing}"


def _ready_algorithms() -> dict[str, type]:
    from rlbolt.config import algorithm_class, algorithm_names

    return {name: algorithm_class(name) for name in algorithm_names()}


def _algorithm_names() -> dict[str, str]:
    READY = _ready_algorithms()
    spelled = {"drgrpo": "Dr.GRPO", "reinforcepp": "REINFORCE++"}
    return {key: spelled.get(key, key.upper()) for key in READY}


def _mentions(text: str, spelling: str) -> bool:
    # "GRPO" must not match inside "Dr.GRPO"; "PPO" does match "PPO-clip" (the PPO surrogate).
    return re.search(rf"(?<![\w.]){re.escape(spelling)}(?![\w+])", text) is not None


@pytest.mark.parametrize("text, spelling, expected", [
    ("Dr.GRPO's loss", "GRPO", False), ("the GRPO loss", "GRPO", True), ("PPO-clip", "PPO", True),
    ("REINFORCE++ baseline", "REINFORCE", False),
])
def test_mentions_tells_algorithm_names_apart(text, spelling, expected):
    assert _mentions(text, spelling) is expected


def test_no_method_shows_a_docstring_that_describes_another_algorithm():
    READY = _ready_algorithms()
    names = _algorithm_names()
    own_key = {cls: key for key, cls in READY.items()}
    wrong = []
    for module_name in _generator().public_modules():
        for class_name, cls in vars(importlib.import_module(module_name)).items():
            if not inspect.isclass(cls) or cls.__module__ != module_name or class_name.startswith("_"):
                continue
            own = names.get(own_key.get(cls, ""), None)
            for method, attr in vars(cls).items():
                func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
                if not inspect.isfunction(func) or (method.startswith("_") and method != "__call__"):
                    continue
                if func.__doc__ is not None:
                    continue  # its own words
                inherited = inspect.getdoc(func) or ""
                others = [n for n in names.values() if n != own and _mentions(inherited, n)]
                if others:
                    wrong.append(f"{class_name}.{method} inherits a docstring naming {others}")
    assert not wrong, f"write these methods their own docstrings: {wrong}"


def test_every_public_class_and_function_has_a_docstring():
    missing = []
    for module_name in _generator().public_modules():
        module = importlib.import_module(module_name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and not inspect.getdoc(obj):
                missing.append(f"{module_name}.{name}")
    assert not missing, f"public objects without a docstring (the reference would show nothing): {missing}"


def test_package_pages_link_every_direct_submodule_to_its_page():
    gen = _generator()
    pages = gen.public_modules()
    paths = {gen.page_path(name, package).as_posix() for name, package in pages.items()}
    for name, package in pages.items():
        if not package:
            continue
        children = gen.children_of(name, pages)
        text = gen.page_text(name, package, children)
        here = gen.page_path(name, package).parent
        links = re.findall(r"\]\(([^)]+)\)", text)
        assert len(links) == len(children), name
        for link in links:
            assert (here / link).as_posix() in paths, f"{name}'s page links {link}, which is no page"
    import rlbolt.producer.dock

    direct = {f"rlbolt.producer.dock.{info.name}" for info in pkgutil.iter_modules(rlbolt.producer.dock.__path__) if _public(info.name)}
    assert set(gen.children_of("rlbolt.producer.dock", pages)) == direct and direct
    paragraph = inspect.getdoc(importlib.import_module("rlbolt.producer.dock.store")).split("\n\n")[0]
    assert gen.summary("rlbolt.producer.dock.store", False) == " ".join(paragraph.split()).split(". ")[0].rstrip(".") + "."
