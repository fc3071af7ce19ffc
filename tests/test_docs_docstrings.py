"""The API reference's docstrings parse cleanly: what `mkdocs build --strict` would report, in a
few seconds, without mkdocs.

mkdocstrings reads the package with griffe (statically, nothing imported) and parses the Google
docstrings of every page's objects; each complaint of griffe's (a documented parameter with no
annotation and no type, a returned value with no type, a documented parameter that is not in
the signature, a confusing indentation) is a warning, and the strict build aborts on any. These
tests load the package the way `mkdocs.yml` does (the same source path, parser and griffe
extension) and parse the docstrings the reference renders: the public modules, classes,
functions and attributes (no part of the dotted name starting with `_`), and the `__init__` of
each public class (merged into the class's entry). They fail with griffe's own lines, so a new
public function with an unannotated documented parameter is caught in the default tier.

One rule goes beyond the build (griffe does not check it): an `Args:` section names every
parameter of its function (or of its class's `__init__`), so a parameter added later is not
left out of the reference.
"""

from __future__ import annotations

import logging
from pathlib import Path

import griffe
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
VARIADIC = (griffe.ParameterKind.var_positional, griffe.ParameterKind.var_keyword)


def _python_handler() -> dict:
    """The mkdocstrings python handler's settings in mkdocs.yml."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    for plugin in config["plugins"]:
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            return plugin["mkdocstrings"]["handlers"]["python"]
    raise AssertionError("mkdocs.yml has no mkdocstrings python handler")


def _rendered(obj: griffe.Object, merge_init: bool) -> list[griffe.Object]:
    """`obj` and its members whose docstrings the reference renders (aliases, i.e. imported
    names, are rendered on their own module's page and parsed there)."""
    out = [obj]
    for name, member in obj.members.items():
        if member.is_alias:
            continue
        init = merge_init and name == "__init__" and obj.is_class
        if not name.startswith("_") or init:
            out += _rendered(member, merge_init)
    return out


def _warnings(objects: list[griffe.Object]) -> list[str]:
    """griffe's warnings while parsing the docstrings of `objects`."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                lines.append(record.getMessage())

    handler, log = Collect(), logging.getLogger("griffe")
    log.addHandler(handler)
    try:
        for obj in objects:
            if obj.docstring is not None:
                _ = obj.docstring.parsed
    finally:
        log.removeHandler(handler)
    return lines


def _documented(*docstrings: griffe.Docstring | None) -> set[str] | None:
    """The parameter names the `Args:` sections of `docstrings` list; None when there is none."""
    sections = [s for d in docstrings if d is not None for s in d.parsed
                if s.kind is griffe.DocstringSectionKind.parameters]
    return {p.name for s in sections for p in s.value} if sections else None


def _left_out(objects: list[griffe.Object]) -> list[str]:
    """`path: names` for each function (or class, for its `__init__`) whose `Args:` section
    leaves out some of its parameters (`*args`/`**kwargs` may stay unnamed)."""
    out = []
    for obj in objects:
        if obj.is_function and obj.name != "__init__":
            function, documented = obj, _documented(obj.docstring)
        elif obj.is_class and "__init__" in obj.members and not obj.members["__init__"].is_alias:
            function = obj.members["__init__"]
            documented = _documented(obj.docstring, function.docstring)
        else:
            continue
        if documented is None:
            continue
        missing = [p.name for p in function.parameters
                   if p.name not in documented and p.name not in ("self", "cls") and p.kind not in VARIADIC]
        if missing:
            out.append(f"{obj.relative_filepath}:{obj.lineno}: {obj.path}: Args leaves out {', '.join(missing)}")
    return out


@pytest.fixture(scope="module")
def reference() -> list[griffe.Object]:
    """The objects the API reference renders, loaded as mkdocs.yml says."""
    handler = _python_handler()
    options = handler["options"]
    assert options["docstring_style"] == "google"
    extensions = griffe.load_extensions(*[str(ROOT / e) if ".py" in e else e for e in options.get("extensions", [])])
    package = griffe.load("rlbolt", search_paths=[str(ROOT / p) for p in handler["paths"]],
                          docstring_parser=options["docstring_style"], extensions=extensions, resolve_aliases=False)
    objects = _rendered(package, bool(options.get("merge_init_into_class")))
    names = {obj.path for obj in objects}
    # The walk reaches the callbacks folder (attached by the griffe extension) and deep members.
    assert {"rlbolt.callbacks.metrics", "rlbolt.trainer.Trainer.fit", "rlbolt.models.logps.token_logps"} <= names
    assert not any(part.startswith("_") and part != "__init__" for name in names for part in name.split("."))
    return objects


def test_the_reference_docstrings_parse_without_a_warning(reference):
    warnings = _warnings(reference)
    assert not warnings, (f"{len(warnings)} docstring warning(s) that fail `mkdocs build --strict` (annotate the "
                          "parameter or return value, or fix the docstring):\n" + "\n".join(sorted(warnings)))


def test_every_args_section_names_every_parameter(reference):
    left_out = _left_out(reference)
    assert not left_out, "document each parameter in Args (one `name: description` line each):\n" + "\n".join(left_out)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """Hostile input: a package with each fault, in a public function and in a public class's
    `__init__`, and the same faults in private objects, which are not rendered and must not be
    reported."""
    package = tmp_path / "fake_pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "mod.py").write_text(
        '"""A module."""\n\n\n'
        'def scale(x, factor: float, offset: float = 0.0):\n'
        '    """Scales.\n\n    Args:\n      x: the value.\n      x, factor: both at once.\n\n'
        '    Returns:\n      The scaled value.\n    """\n'
        '    return x * factor + offset\n\n\n'
        'class Box:\n    """A box.\n\n    Args:\n      depth: how deep.\n    """\n\n'
        '    def __init__(self, size, depth: int, *args, **kwargs):\n'
        '        """Makes one.\n\n        Args:\n          size: the side.\n        """\n\n\n'
        'def _hidden(secret_a, secret_c):\n    """Hidden.\n\n    Args:\n      secret_a: never rendered.\n    """\n\n\n'
        'class _Hidden:\n    def method(self, secret_b):\n'
        '        """Hidden.\n\n        Args:\n          secret_b: never rendered.\n        """\n')
    objects = _rendered(griffe.load("fake_pkg", search_paths=[str(tmp_path)], docstring_parser="google"),
                        merge_init=True)
    warnings = _warnings(objects)
    assert any("No type or annotation for parameter 'x'" in w for w in warnings), warnings
    assert any("'x, factor' does not appear in the function signature" in w for w in warnings), warnings
    assert any("No type or annotation for returned value" in w for w in warnings), warnings
    assert any("No type or annotation for parameter 'size'" in w for w in warnings), warnings
    assert not any("secret" in w for w in warnings), warnings
    left_out = _left_out(objects)
    assert [line.split(": ", 1)[1] for line in left_out] == ["fake_pkg.mod.scale: Args leaves out factor, offset"], \
        left_out
    # The class's Args (depth) and its __init__'s (size) together name every named parameter.
    assert not any("Box" in line or "secret" in line for line in left_out), left_out
