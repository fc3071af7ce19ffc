"""A venv that runs any test tier installs the plugins pyproject's addopts name.

pytest refuses to start when addopts holds an option no installed plugin defines (``-n`` without
pytest-xdist), so every documented or scripted ``pip install`` of a checkout that is followed by a
pytest run must bring the ``pytest`` extra (the ``test`` extra includes it).
"""

import pathlib
import re
import shlex
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# addopts option -> the distribution that defines it; None: pytest's own.
OPTION_OWNERS = {
    "-m": None,
    "--import-mode": None,
    "-p": None,
    "--timeout": "pytest-timeout",
    "-n": "pytest-xdist",
    "--dist": "pytest-xdist",
}


def _addopts_options() -> list[str]:
    tokens = shlex.split(PYPROJECT["tool"]["pytest"]["ini_options"]["addopts"])
    return [t.split("=")[0] for t in tokens if t.startswith("-")]


def _distribution(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()


def test_the_pytest_extra_brings_every_plugin_addopts_names():
    extras = PYPROJECT["project"]["optional-dependencies"]
    pytest_extra = {_distribution(r) for r in extras["pytest"]}
    assert "pytest" in pytest_extra
    for option in _addopts_options():
        assert option in OPTION_OWNERS, (
            f"addopts names {option}: add its plugin to the pytest extra and to OPTION_OWNERS")
        owner = OPTION_OWNERS[option]
        assert owner is None or owner in pytest_extra, f"{option} needs {owner} in the pytest extra"
    assert "rlbolt[pytest]" in extras["test"], "the test extra must include the pytest extra"


_CHECKOUT_INSTALL = re.compile(r"pip\"? install[^\n]*?-e \"?\.(\[(?P<extras>[^\]]*)\])?\"?")


def _installs_then_pytest(text: str):
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = _CHECKOUT_INSTALL.search(line)
        if match is None:
            continue
        following = "\n".join([line[match.end():], *lines[i + 1:i + 6]])
        if re.search(r"\bpytest\b", following):
            yield i + 1, set(filter(None, (match.group("extras") or "").split(",")))


def _scripted_and_documented() -> list[pathlib.Path]:
    return [ROOT / ".ci" / "run", ROOT / "README.md", ROOT / "CONTRIBUTING.md",
            *sorted((ROOT / "docs").rglob("*.md"))]


def test_every_install_before_a_pytest_run_brings_the_pytest_plugins():
    checked = 0
    for path in _scripted_and_documented():
        for lineno, extras in _installs_then_pytest(path.read_text()):
            checked += 1
            assert extras & {"test", "pytest"}, (
                f"{path.relative_to(ROOT)}:{lineno} installs .[{','.join(sorted(extras))}] and then "
                "runs pytest: add the pytest extra (addopts needs pytest-xdist and pytest-timeout)")
    assert checked >= 5  # README, CONTRIBUTING, the CI's vllm/openenv/tpu venvs at least


def test_the_check_catches_an_install_without_the_plugins():
    text = 'pip install -q -e ".[openenv]" "pytest>=8.0" "pytest-timeout>=2.3"\npython -m pytest -m openenv\n'
    assert list(_installs_then_pytest(text)) == [(1, {"openenv"})]
    assert list(_installs_then_pytest('pip install -e ".[test]" && python -m pytest')) == [(1, {"test"})]
    assert list(_installs_then_pytest('pip install -e ".[docs]"\nmkdocs build\n')) == []
