"""Writes the API reference pages at build time (run by mkdocs-gen-files; see mkdocs.yml).

One page per public module, found by walking the package folders, so a module that is added,
moved or renamed appears in the reference without anyone editing a list. A module is private
when any part of its dotted name starts with an underscore (`rlbolt.rewards._reward_worker`).
`tests/test_docs_reference.py` checks that these pages cover every public module Python itself
finds (`pkgutil.walk_packages`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import name -> folder. `callbacks/` is installed as `rlbolt.callbacks` (see pyproject.toml).
PACKAGE_DIRS = {"rlbolt": ROOT / "src" / "rlbolt", "rlbolt.callbacks": ROOT / "callbacks"}


def public_modules() -> dict[str, bool]:
    """Every public module and package under PACKAGE_DIRS: dotted name -> whether it is a package."""
    found = {}  # rlbolt.__main__ (`python -m rlbolt`) is private by this rule too
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            package_init = parts[-1] == "__init__"
            if package_init:
                parts = parts[:-1]
            if any(part.startswith("_") for part in parts) or not (path.parent / "__init__.py").is_file():
                continue  # private, or a script beside the package rather than a module of it
            found[".".join([package, *parts])] = package_init
    return {name: found[name] for name in sorted(found)}


def summary(name: str, package: bool) -> str:
    """The first sentence of a module's docstring, read from its file (nothing imported)."""
    for root, folder in sorted(PACKAGE_DIRS.items(), key=lambda item: -len(item[0])):
        if name == root or name.startswith(root + "."):
            rest = name[len(root):].lstrip(".").split(".") if name != root else []
            path = folder.joinpath(*rest, "__init__.py") if package else folder.joinpath(*rest).with_suffix(".py")
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
            first = " ".join(doc.strip().split("\n\n")[0].split())
            return first.split(". ")[0].rstrip(".") + "." if first else ""
    return ""


def page_path(name: str, package: bool) -> Path:
    """Where a module's page goes, under `reference/`: rlbolt/producer/dock/store.md, rlbolt/producer/dock/index.md."""
    parts = name.split(".")
    return Path(*parts, "index.md") if package else Path(*parts[:-1], parts[-1] + ".md")


def page_text(name: str, package: bool, children: dict[str, bool] | None = None) -> str:
    """The Markdown of one module's page: a title and the mkdocstrings directive; a package's
    page also lists its direct submodules (`children`: name -> is a package), with links."""
    options = ["show_root_heading: false"]
    if package:
        # A package re-exports its modules' names: its page shows its docstring, and the
        # members are on the modules' own pages.
        options.append("members: false")
    lines = "".join(f"      {option}\n" for option in options)
    text = f"# `{name}`\n\n::: {name}\n    options:\n{lines}"
    if children:
        here = page_path(name, package).parent
        text += "\n## Modules\n\n| module | what it holds |\n|---|---|\n"
        for child, child_package in children.items():
            link = page_path(child, child_package).relative_to(here).as_posix()
            what = summary(child, child_package).replace("|", "\\|")  # a table cell
            text += f"| [`{child}`]({link}) | {what} |\n"
    return text


def children_of(name: str, modules: dict[str, bool]) -> dict[str, bool]:
    """The direct submodules of package `name` among `modules`."""
    depth = name.count(".") + 1
    return {m: p for m, p in modules.items() if m.startswith(name + ".") and m.count(".") == depth}


def write_pages() -> None:
    """Writes every page and the navigation file `reference/SUMMARY.md` (literate-nav)."""
    import mkdocs_gen_files

    nav = mkdocs_gen_files.Nav()
    modules = public_modules()
    for name, package in modules.items():
        path = page_path(name, package)
        nav[tuple(name.split("."))] = path.as_posix()
        with mkdocs_gen_files.open(Path("reference", path), "w") as handle:
            handle.write(page_text(name, package, children_of(name, modules) if package else None))
    with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as handle:
        handle.writelines(nav.build_literate_nav())


if __name__ in {"__main__", "<run_path>"}:  # mkdocs-gen-files runs the script under "<run_path>"
    write_pages()
