"""docs/api.md is generated from the docstrings; this test keeps it in step with them, and
keeps it complete: every module is listed (or excluded here with a reason), every name a public
package exports has an entry, and no method shows a docstring inherited from a base class that
describes another algorithm.

Regenerate after changing a public docstring or signature:

    python tests/test_docs_api.py          # rewrites docs/api.md
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
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
    ("Training loop", "rlbolt.fit_checks"),
    ("Training loop", "rlbolt.step_metrics"),
    ("Training loop", "rlbolt.validation"),
    ("Training loop", "rlbolt.producer"),
    ("Training loop", "rlbolt.handoff"),
    ("Training loop", "rlbolt.prefetch"),
    ("Training loop", "rlbolt.update"),
    ("Training loop", "rlbolt.weights"),
    ("Training loop", "rlbolt.signals"),
    ("Training loop", "rlbolt.timeline"),
    ("Dock", "rlbolt.dock.store"),
    ("Dock", "rlbolt.dock.queues"),
    ("Dock", "rlbolt.dock.columns"),
    ("Dock", "rlbolt.dock.selection"),
    ("Data", "rlbolt.data.source"),
    ("Data", "rlbolt.data.loaders"),
    ("Data", "rlbolt.data.tasks"),
    ("Data", "rlbolt.data.tokenizers"),
    ("Data", "rlbolt.data.chat_template"),
    ("Algorithms", "rlbolt.algorithms.advantages"),
    ("Algorithms", "rlbolt.algorithms.policy_loss"),
    ("Algorithms", "rlbolt.algorithms.kl"),
    ("Algorithms", "rlbolt.algorithms.aggregation"),
    ("Algorithms", "rlbolt.algorithms.groups"),
    ("Algorithms", "rlbolt.algorithms.moments"),
    ("Algorithms", "rlbolt.algorithms.masked"),
    ("Algorithms", "rlbolt.algorithms.shaping"),
    ("Algorithms", "rlbolt.algorithms.registry"),
    ("Modules", "rlbolt.modules.policy"),
    ("Modules", "rlbolt.modules.policy_setup"),
    ("Modules", "rlbolt.modules.grpo"),
    ("Modules", "rlbolt.modules.dapo"),
    ("Modules", "rlbolt.modules.reinforcepp"),
    ("Modules", "rlbolt.modules.ppo"),
    ("Modules", "rlbolt.modules.prompts"),
    ("Modules", "rlbolt.modules.rewarding"),
    ("Modules", "rlbolt.modules.lm_ops"),
    ("Modules", "rlbolt.modules.lora_policy"),
    ("Modules", "rlbolt.modules.prompt_sharing"),
    ("Modules", "rlbolt.modules.reference"),
    ("Models", "rlbolt.models.config"),
    ("Models", "rlbolt.models.decoder"),
    ("Models", "rlbolt.models.cache"),
    ("Models", "rlbolt.models.shared_prefix"),
    ("Models", "rlbolt.models.attention_chunks"),
    ("Models", "rlbolt.models.rope"),
    ("Models", "rlbolt.models.hf_io"),
    ("Models", "rlbolt.models.hf_config"),
    ("Models", "rlbolt.models.lora"),
    ("Models", "rlbolt.models.peft_io"),
    ("Models", "rlbolt.models.quantize"),
    ("Devices and hosts", "rlbolt.distributed.mesh"),
    ("Devices and hosts", "rlbolt.distributed.sharding"),
    ("Devices and hosts", "rlbolt.distributed.runtime"),
    ("Devices and hosts", "rlbolt.distributed.agree"),
    ("Devices and hosts", "rlbolt.distributed.memory"),
    ("Devices and hosts", "rlbolt.distributed.state"),
    ("Devices and hosts", "rlbolt.distributed.placement"),
    ("Rollout", "rlbolt.rollout.engine"),
    ("Rollout", "rlbolt.rollout.sampler"),
    ("Rollout", "rlbolt.rollout.sampling"),
    ("Rollout", "rlbolt.rollout.compaction"),
    ("Rollout", "rlbolt.rollout.logps"),
    ("Agents", "rlbolt.agents.environment"),
    ("Agents", "rlbolt.agents.tools"),
    ("Agents", "rlbolt.agents.parsers"),
    ("Agents", "rlbolt.agents.episode"),
    ("Agents", "rlbolt.agents.rollout"),
    ("Agents", "rlbolt.agents.tasks"),
    ("Agents", "rlbolt.agents.demo_training"),
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
    ("Loggers", "rlbolt.loggers.console"),
    ("Loggers", "rlbolt.loggers.tensorboard"),
    ("Loggers", "rlbolt.loggers.wandb_writer"),
    ("Loggers", "rlbolt.loggers.async_writer"),
    ("Loggers", "rlbolt.loggers.naming"),
    ("Loggers", "rlbolt.loggers.factory"),
    ("Callbacks", "rlbolt.callbacks.checkpoint"),
    ("Callbacks", "rlbolt.callbacks.checkpoint_io"),
    ("Callbacks", "rlbolt.callbacks.checkpoint_meta"),
    ("Callbacks", "rlbolt.callbacks.checkpoint_integrity"),
    ("Callbacks", "rlbolt.callbacks.config_guard"),
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
    ("Config and runs", "rlbolt.app.config_fields"),
    ("Config and runs", "rlbolt.app.config_rules"),
    ("Config and runs", "rlbolt.app.objects"),
    ("Config and runs", "rlbolt.app.build"),
    ("Config and runs", "rlbolt.app.input_checks"),
    ("Config and runs", "rlbolt.app.rundir"),
    ("Config and runs", "rlbolt.app.plotting"),
    ("Config and runs", "rlbolt.app.gantt"),
    ("Config and runs", "rlbolt.app.demo"),
    ("Config and runs", "rlbolt.app.demo_config"),
    ("Config and runs", "rlbolt.app.quiet"),
    ("Config and runs", "rlbolt.app.cli"),
    ("Config and runs", "rlbolt.app.cli_run"),
    ("Config and runs", "rlbolt.app.cli_export"),
    ("Utilities", "rlbolt.utils.files"),
    ("Utilities", "rlbolt.utils.runlock"),
    ("Utilities", "rlbolt.utils.xla_flags"),
    ("Utilities", "rlbolt.utils.fingerprint"),
]

# Modules with no page entry of their own, and why. Every other module must be in MODULES.
NOT_LISTED = {
    "rlbolt.__main__": "`python -m rlbolt`: runs rlbolt.app.cli.run",
    "rlbolt.rewards._sandbox_launcher": "private: the script the sandbox child process runs",
    "rlbolt.rewards._reward_worker": "private: the loop a reward worker process runs",
}
# Packages whose exports must each have an entry (their own modules are listed above).
PACKAGES = ("rlbolt", "rlbolt.algorithms", "rlbolt.modules", "rlbolt.callbacks", "rlbolt.rewards", "rlbolt.data",
            "rlbolt.models", "rlbolt.rollout", "rlbolt.loggers", "rlbolt.agents")


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
        if inspect.isclass(obj) and [p.kind for p in sig.parameters.values()] == [
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
            # A metaclass __call__ (Flax NNX modules) hides the constructor: show __init__'s.
            init = inspect.signature(obj.__init__)
            sig = init.replace(parameters=list(init.parameters.values())[1:], return_annotation=inspect.Signature.empty)
    except (TypeError, ValueError):
        return "(...)"
    params = [p.replace(annotation=_raw(p.annotation)) for p in sig.parameters.values()]
    sig = sig.replace(parameters=params, return_annotation=_raw(sig.return_annotation))
    return _clean(str(sig))


def _is_documentable(obj) -> bool:
    # jax.jit-wrapped functions (the group advantage estimators) are not plain functions but
    # carry the original in __wrapped__.
    return inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isfunction(getattr(obj, "__wrapped__", None))


def _public_members(module) -> list:
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    out = []
    for name in names:
        obj = getattr(module, name, None)
        if _is_documentable(obj) and getattr(obj, "__module__", None) == module.__name__:
            out.append((name, obj))
    return out


def _method_names(cls) -> list[str]:
    """The methods a class documents: public ones, `__call__`, and `__init__` when it has its own docstring."""
    out = []
    for name, attr in vars(cls).items():
        if name.startswith("_") and not (name == "__call__" or (name == "__init__" and attr.__doc__)):
            continue
        if inspect.isfunction(attr) or isinstance(attr, (classmethod, staticmethod, property)):
            out.append(name)
    return out


def _methods(cls) -> list[str]:
    lines = []
    for name in _method_names(cls):
        attr = vars(cls)[name]
        func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
        doc = inspect.getdoc(func) or ""
        if doc == inspect.getdoc(object.__call__):  # "Call self as a function.": says nothing
            doc = ""
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


def _documented_names() -> set[tuple[str, str]]:
    """(module, name) of every entry on the page."""
    out = set()
    for _, module_name in MODULES:
        out |= {(module_name, name) for name, _ in _public_members(importlib.import_module(module_name))}
    return out


def test_every_module_is_listed_or_excused():
    import rlbolt
    import rlbolt.callbacks

    listed = {name for _, name in MODULES}
    found = {info.name for info in pkgutil.walk_packages(rlbolt.__path__, "rlbolt.") if not info.ispkg}
    found |= {info.name for info in pkgutil.walk_packages(rlbolt.callbacks.__path__, "rlbolt.callbacks.")}
    missing = sorted(found - listed - set(NOT_LISTED))
    assert not missing, f"modules missing from MODULES in tests/test_docs_api.py (or from NOT_LISTED, with a reason): {missing}"
    assert not sorted(listed - found), "MODULES lists modules that do not exist"


def test_every_exported_name_has_an_entry():
    documented = _documented_names()
    missing = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names = getattr(package, "__all__", None) or [n for n in vars(package) if not n.startswith("_")]
        for name in names:
            obj = getattr(package, name)
            if _is_documentable(obj) and (obj.__module__, name) not in documented:
                missing.append(f"{package_name}.{name} (defined in {obj.__module__})")
    assert not missing, f"exported but not on docs/api.md: {missing}"
    assert "#### `def grpo_advantages(" in API_FILE.read_text(encoding="utf-8")


def _algorithm_names() -> dict[str, str]:
    """How each ready algorithm is spelled in prose, from the module registry."""
    from rlbolt.modules import MODULES as READY

    spelled = {"drgrpo": "Dr.GRPO", "reinforcepp": "REINFORCE++"}
    return {key: spelled.get(key, key.upper()) for key in READY}


def _mentions(text: str, spelling: str) -> bool:
    # "GRPO" must not match inside "Dr.GRPO"; "PPO" does match "PPO-clip" (the PPO surrogate).
    return re.search(rf"(?<![\w.]){re.escape(spelling)}(?![\w+])", text) is not None


def test_no_method_shows_a_docstring_that_describes_another_algorithm():
    from rlbolt.modules import MODULES as READY

    names = _algorithm_names()
    own_key = {cls: key for key, cls in READY.items()}
    wrong = []
    for _, module_name in MODULES:
        for class_name, cls in _public_members(importlib.import_module(module_name)):
            if not inspect.isclass(cls):
                continue
            own = names.get(own_key.get(cls, ""), None)
            for method in _method_names(cls):
                attr = vars(cls)[method]
                func = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
                if func.__doc__ is not None:
                    continue  # its own words
                inherited = inspect.getdoc(func) or ""
                others = [n for n in names.values() if n != own and _mentions(inherited, n)]
                if others:
                    wrong.append(f"{class_name}.{method} inherits a docstring naming {others}")
    assert not wrong, f"write these methods their own docstrings: {wrong}"


def test_every_public_object_has_a_docstring():
    missing = []
    for _, module_name in MODULES:
        module = importlib.import_module(module_name)
        missing += [f"{module_name}.{name}" for name, obj in _public_members(module) if not inspect.getdoc(obj)]
    assert not missing, f"public objects without a docstring: {missing}"


if __name__ == "__main__":
    API_FILE.write_text(render_api(), encoding="utf-8")
    print(f"wrote {API_FILE}", file=sys.stderr)
