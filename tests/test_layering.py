"""The package's shape, read from its imports: the layers point one way and nothing imports in
a loop; the top-level layout list in `rlbolt/__init__.py` names every top-level module.

Imports are read with `ast` (top-level and inside functions alike: a lazy import is still a
dependency), so the test needs no JAX."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rlbolt

ROOT = Path(rlbolt.__file__).resolve().parent
CALLBACKS = ROOT.parents[1] / "callbacks"
# Nothing below the application layer (app, planning, demo) may import app or demo.
BELOW_APP = ("rlbolt.agents", "rlbolt.modules", "rlbolt.algorithms", "rlbolt.rollout", "rlbolt.models", "rlbolt.config",
             "rlbolt.checkpointing", "rlbolt.producer", "rlbolt.trainer", "rlbolt.module", "rlbolt.callback",
             "rlbolt.state", "rlbolt.batch", "rlbolt.plan", "rlbolt.update", "rlbolt.fit_setup", "rlbolt.master_weights", "rlbolt.validation", "rlbolt.fit_checks",
             "rlbolt.step_metrics", "rlbolt.setup_context", "rlbolt.signals", "rlbolt.timeline", "rlbolt.data",
             "rlbolt.rewards", "rlbolt.distributed", "rlbolt.loggers", "rlbolt.utils", "rlbolt.callbacks")


def _files() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(("rlbolt", *parts)).removesuffix(".__init__")] = path
    for path in CALLBACKS.rglob("*.py"):
        parts = path.relative_to(CALLBACKS).with_suffix("").parts
        out[".".join(("rlbolt.callbacks", *parts)).removesuffix(".__init__")] = path
    return out


FILES = _files()


def _imports(name: str, path: Path) -> set[str]:
    """The rlbolt modules `name` imports (a `from package import module` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m in FILES and m != name}


GRAPH = {name: _imports(name, path) for name, path in FILES.items()}


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_nothing_below_the_application_layer_imports_it():
    arrows = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
                    if (_under(b, "rlbolt.app") or _under(b, "rlbolt.demo")) and any(_under(a, p) for p in BELOW_APP))
    assert arrows == []


# The package rules: what each package may not import (a lazy import counts). The layers run
# bottom to top: utils, batch < algorithms, rewards < models < rollout < agents < modules <
# producer, trainer < the application layer (app, planning, demo).
#
#   package             may not import                               because
#   rlbolt.utils        any other rlbolt package                     everyone's helpers
#   rlbolt.algorithms   any rlbolt package but utils                 pure math (and its registry)
#   rlbolt.rewards      any rlbolt package but utils                 JAX-free: a reward worker imports it
#   rlbolt.models       modules, rollout, agents, producer, trainer  the models know nothing of training
#   rlbolt.rollout      modules, agents, producer, trainer           engines serve the modules
#   rlbolt.agents       modules, producer, trainer                   the modules run episodes, not the reverse
#   rlbolt.demo         app                                          the command runs the demo
#   below the app layer app, demo                                    (test_nothing_below_the_application_layer_imports_it)
_EVERYTHING = tuple(sorted({".".join(m.split(".")[:2]) for m in FILES} - {"rlbolt"}))
PACKAGE_RULES = {
    "rlbolt.utils": tuple(p for p in _EVERYTHING if p != "rlbolt.utils"),
    "rlbolt.algorithms": tuple(p for p in _EVERYTHING if p not in ("rlbolt.algorithms", "rlbolt.utils")),
    "rlbolt.rewards": tuple(p for p in _EVERYTHING if p not in ("rlbolt.rewards", "rlbolt.utils")),
    "rlbolt.models": ("rlbolt.modules", "rlbolt.rollout", "rlbolt.agents", "rlbolt.producer", "rlbolt.trainer"),
    "rlbolt.rollout": ("rlbolt.modules", "rlbolt.agents", "rlbolt.producer", "rlbolt.trainer"),
    "rlbolt.agents": ("rlbolt.modules", "rlbolt.producer", "rlbolt.trainer"),
    "rlbolt.demo": ("rlbolt.app",),
}


def test_each_package_keeps_its_rules():
    arrows = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets
                    for package, forbidden in PACKAGE_RULES.items()
                    if _under(a, package) and any(_under(b, f) for f in forbidden))
    assert arrows == []


def test_the_package_rules_can_fail():
    """The rules read the graph: an upward import, as agents -> modules was, is reported."""
    graph = {"rlbolt.agents.demo_training": {"rlbolt.modules"}, "rlbolt.utils.files": {"rlbolt.config.fields"}}
    arrows = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    for package, forbidden in PACKAGE_RULES.items()
                    if _under(a, package) and any(_under(b, f) for f in forbidden))
    assert arrows == ["rlbolt.agents.demo_training -> rlbolt.modules", "rlbolt.utils.files -> rlbolt.config.fields"]


def test_no_import_cycles():
    """Tarjan's strongly connected components over file -> file imports: every one is a single
    file (a package's __init__ re-exporting its children is not a cycle: it is left out)."""
    graph = {a: {b for b in targets if not FILES[b].name == "__init__.py"} for a, targets in GRAPH.items()
             if FILES[a].name != "__init__.py"}
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == [], "\n".join(" <-> ".join(c) for c in cycles)


def test_the_layout_list_names_every_top_level_module():
    doc = rlbolt.__doc__
    listed = set(re.findall(r"^\s{6}(\w+)/?\s", doc, re.M))
    top = {p.stem if p.is_file() else p.name for p in ROOT.iterdir()
           if (p.suffix == ".py" and not p.name.startswith("_")) or (p.is_dir() and (p / "__init__.py").exists())}
    top.add("callbacks")
    assert top - listed == set(), f"rlbolt/__init__.py's layout list misses {sorted(top - listed)}"
    assert listed - top == set(), f"rlbolt/__init__.py's layout list names what is gone: {sorted(listed - top)}"


def test_the_graph_is_read():  # the checks above could not fail on an empty graph
    assert "rlbolt.config" in GRAPH["rlbolt.modules.policy_setup"]
    assert "rlbolt.app.cli_run" in GRAPH["rlbolt.app.cli"]
