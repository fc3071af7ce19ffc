"""docs/api.md is generated from the docstrings; this test keeps it in step with them.

Regenerate after changing a public docstring or signature:

    python tests/test_docs_api.py          # rewrites docs/api.md
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

API_FILE = Path(__file__).resolve().parents[1] / "docs" / "api.md"

# (section title, module): every public class and function defined in the module is listed.
MODULES = [
    ("Training loop", "rlbolt.trainer"),
    ("Training loop", "rlbolt.module"),
    ("Training loop", "rlbolt.callback"),
    ("Training loop", "rlbolt.state"),
    ("Training loop", "rlbolt.plan"),
    ("Training loop", "rlbolt.batch"),
    ("Training loop", "rlbolt.producer"),
    ("Training loop", "rlbolt.handoff"),
    ("Training loop", "rlbolt.prefetch"),
    ("Training loop", "rlbolt.weights"),
    ("Training loop", "rlbolt.timeline"),
    ("Dock", "rlbolt.dock.store"),
    ("Dock", "rlbolt.dock.queues"),
    ("Dock", "rlbolt.dock.columns"),
    ("Dock", "rlbolt.dock.selection"),
    ("Data", "rlbolt.data.source"),
    ("Data", "rlbolt.data.loaders"),
    ("Data", "rlbolt.data.tasks"),
    ("Data", "rlbolt.data.tokenizers"),
    ("Algorithms", "rlbolt.algorithms.advantages"),
    ("Algorithms", "rlbolt.algorithms.policy_loss"),
    ("Algorithms", "rlbolt.algorithms.kl"),
    ("Algorithms", "rlbolt.algorithms.aggregation"),
    ("Algorithms", "rlbolt.algorithms.groups"),
    ("Algorithms", "rlbolt.algorithms.moments"),
    ("Algorithms", "rlbolt.algorithms.masked"),
    ("Algorithms", "rlbolt.algorithms.shaping"),
    ("Modules", "rlbolt.modules.policy"),
    ("Modules", "rlbolt.modules.grpo"),
    ("Modules", "rlbolt.modules.dapo"),
    ("Modules", "rlbolt.modules.reinforcepp"),
    ("Modules", "rlbolt.modules.ppo"),
    ("Models", "rlbolt.models.config"),
    ("Models", "rlbolt.models.decoder"),
    ("Models", "rlbolt.models.cache"),
    ("Models", "rlbolt.models.hf_io"),
    ("Rollout", "rlbolt.rollout.engine"),
    ("Rollout", "rlbolt.rollout.sampler"),
    ("Rollout", "rlbolt.rollout.logps"),
    ("Rewards", "rlbolt.rewards.base"),
    ("Rewards", "rlbolt.rewards.combine"),
    ("Rewards", "rlbolt.rewards.format"),
    ("Rewards", "rlbolt.rewards.math_answers"),
    ("Rewards", "rlbolt.rewards.runner"),
    ("Rewards", "rlbolt.rewards.workers"),
    ("Rewards", "rlbolt.rewards.sandbox"),
    ("Rewards", "rlbolt.rewards.code_tests"),
    ("Rewards", "rlbolt.rewards.sandbox_isolation"),
    ("Loggers", "rlbolt.loggers.interface"),
    ("Loggers", "rlbolt.loggers.jsonl"),
    ("Loggers", "rlbolt.loggers.factory"),
    ("Callbacks", "rlbolt.callbacks.checkpoint"),
    ("Callbacks", "rlbolt.callbacks.metrics"),
    ("Callbacks", "rlbolt.callbacks.progress"),
    ("Callbacks", "rlbolt.callbacks.nan_guard"),
    ("Callbacks", "rlbolt.callbacks.evaluation"),
    ("Callbacks", "rlbolt.callbacks.early_stopping"),
    ("Callbacks", "rlbolt.callbacks.lr_monitor"),
    ("Callbacks", "rlbolt.callbacks.throughput"),
    ("Callbacks", "rlbolt.callbacks.offload"),
    ("Callbacks", "rlbolt.callbacks.hf_export"),
    ("Callbacks", "rlbolt.callbacks.timeline"),
    ("Config and runs", "rlbolt.app.config"),
    ("Config and runs", "rlbolt.app.build"),
    ("Config and runs", "rlbolt.app.rundir"),
    ("Config and runs", "rlbolt.app.plotting"),
    ("Config and runs", "rlbolt.app.gantt"),
    ("Config and runs", "rlbolt.app.demo"),
    ("Config and runs", "rlbolt.app.cli"),
]


def _clean(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


class _Raw:
    """Shows a string annotation without quotes (modules use `from __future__ import annotations`)."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return self.text


def _raw(annotation):
    return _Raw(annotation) if isinstance(annotation, str) else annotation


def _signature(obj) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = [p.replace(annotation=_raw(p.annotation)) for p in sig.parameters.values()]
    sig = sig.replace(parameters=params, return_annotation=_raw(sig.return_annotation))
    return _clean(str(sig))


def _public_members(module) -> list:
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    out = []
    for name in names:
        obj = getattr(module, name, None)
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == module.__name__:
            out.append((name, obj))
    return out


def _methods(cls) -> list[str]:
    lines = []
    for name, attr in vars(cls).items():
        if name.startswith("_") or not (inspect.isfunction(attr) or isinstance(attr, (classmethod, staticmethod, property))):
            continue
        func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
        doc = inspect.getdoc(func) or ""
        first = doc.split("\n\n")[0].replace("\n", " ").strip()
        sig = "" if isinstance(attr, property) else _signature(func)
        lines.append(f"- `{name}{sig}`" + (f": {first}" if first else ""))
    return lines


def render_api() -> str:
    """The text docs/api.md must hold."""
    out = ["# API reference", "",
           "Generated from the docstrings by `python tests/test_docs_api.py`; `tests/test_docs_api.py` fails",
           "when this page and the code disagree. Concepts and how-tos: [concepts.md](concepts.md), [howto/](howto/).",
           ""]
    section = None
    for title, module_name in MODULES:
        module = importlib.import_module(module_name)  # a module that fails to import must fail the test
        if title != section:
            out += [f"## {title}", ""]
            section = title
        out += [f"### `{module_name}`", ""]
        summary = (inspect.getdoc(module) or "").split("\n\n")[0].strip()
        if summary:
            out += [summary, ""]
        for name, obj in _public_members(module):
            kind = "class" if inspect.isclass(obj) else "def"
            out += [f"#### `{kind} {name}{_signature(obj)}`", ""]
            doc = inspect.getdoc(obj)
            if doc:
                out += ["```text", _clean(doc), "```", ""]
            if inspect.isclass(obj):
                methods = _methods(obj)
                if methods:
                    out += methods + [""]
    return "\n".join(out).rstrip() + "\n"


def test_api_reference_matches_docstrings():
    assert API_FILE.is_file(), f"{API_FILE} is missing; run `python tests/test_docs_api.py` to generate it"
    expected = render_api()
    actual = API_FILE.read_text(encoding="utf-8")
    if actual != expected:
        diff = [f"line {i + 1}: docs has {a!r}, code gives {b!r}"
                for i, (a, b) in enumerate(zip(actual.splitlines(), expected.splitlines())) if a != b][:3]
        raise AssertionError("docs/api.md is out of step with the docstrings; run `python tests/test_docs_api.py` "
                             f"to regenerate it. First differences: {diff or 'length differs'}")


def test_every_public_object_has_a_docstring():
    missing = []
    for _, module_name in MODULES:
        module = importlib.import_module(module_name)
        missing += [f"{module_name}.{name}" for name, obj in _public_members(module) if not inspect.getdoc(obj)]
    assert not missing, f"public objects without a docstring: {missing}"


if __name__ == "__main__":
    API_FILE.write_text(render_api(), encoding="utf-8")
    print(f"wrote {API_FILE}", file=sys.stderr)
