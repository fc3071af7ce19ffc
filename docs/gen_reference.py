"""Writes the API reference pages at build time (run by mkdocs-gen-files; see mkdocs.yml).

One page per public module, found by walking the package folders, so a module that is added,
moved or renamed appears in the reference without anyone editing a list. A module is private
when any part of its dotted name starts with an underscore (`rlbolt.rewards._reward_worker`).
`tests/test_docs_reference.py` checks that these pages cover every public module Python itself
finds (`pkgutil.walk_packages`).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Import name -> folder. `callbacks/` is installed as `rlbolt.callbacks` (see pyproject.toml).
PACKAGE_DIRS = {"rlbolt": ROOT / "src" / "rlbolt", "rlbolt.callbacks": ROOT / "callbacks"}
SKIP = {"rlbolt.__main__"}  # `python -m rlbolt`: runs the command; nothing to document


def public_modules() -> dict[str, bool]:
    """Every public module and package under PACKAGE_DIRS: dotted name -> whether it is a package."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            package_init = parts[-1] == "__init__"
            if package_init:
                parts = parts[:-1]
            if any(part.startswith("_") for part in parts) or not (path.parent / "__init__.py").is_file():
                continue  # private, or a script beside the package rather than a module of it
            found[".".join([package, *parts])] = package_init
    return {name: found[name] for name in sorted(found) if name not in SKIP}


def page_path(name: str, package: bool) -> Path:
    """Where a module's page goes, under `reference/`: rlbolt/dock/store.md, rlbolt/dock/index.md."""
    parts = name.split(".")
    return Path(*parts, "index.md") if package else Path(*parts[:-1], parts[-1] + ".md")


def page_text(name: str, package: bool) -> str:
    """The Markdown of one module's page: a title and the mkdocstrings directive."""
    options = ["show_root_heading: false"]
    if package:
        # A package re-exports its modules' names: its page shows its docstring, and the
        # members are on the modules' own pages.
        options.append("members: false")
    lines = "".join(f"      {option}\n" for option in options)
    return f"# `{name}`\n\n::: {name}\n    options:\n{lines}"


def write_pages() -> None:
    """Writes every page and the navigation file `reference/SUMMARY.md` (literate-nav)."""
    import mkdocs_gen_files

    nav = mkdocs_gen_files.Nav()
    for name, package in public_modules().items():
        path = page_path(name, package)
        nav[tuple(name.split("."))] = path.as_posix()
        with mkdocs_gen_files.open(Path("reference", path), "w") as handle:
            handle.write(page_text(name, package))
    with mkdocs_gen_files.open("reference/SUMMARY.md", "w") as handle:
        handle.writelines(nav.build_literate_nav())


if __name__ in {"__main__", "<run_path>"}:  # mkdocs-gen-files runs the script under "<run_path>"
    write_pages()
