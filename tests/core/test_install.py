"""A regular (non-editable) install ships every subpackage: `rlbolt.callbacks` (a top-level
folder mapped into the package), `rlbolt.app` (the `rlbolt` command) and `rlbolt.utils`.

The default tier builds the wheel from a copy of the sources with this environment's
setuptools and imports from it; the slow tier runs `pip install .` into a fresh venv, as a
user would (CI's first README command does the same)."""

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMPORTS = "import rlbolt, rlbolt.callbacks, rlbolt.trainer, rlbolt.app.cli, rlbolt.utils.files"
PRINT = "; print(rlbolt.__file__); print(rlbolt.callbacks.__file__); print(rlbolt.app.cli.__file__)"


def _check_imported_from(where: Path, out: list[str]) -> None:
    assert len(out) == 3 and all(str(where) in path for path in out), out  # the install, not the checkout
    assert out[1].endswith("rlbolt/callbacks/__init__.py") and out[2].endswith("rlbolt/app/cli.py")


def _source_copy(tmp_path: Path) -> Path:
    """The files a build reads, copied: pip builds in place and would leave build/ in the checkout."""
    source = tmp_path / "src_copy"
    for name in ("src", "callbacks", "setup.py", "pyproject.toml", "README.md"):
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy(REPO / name, source / name)
    return source


def test_built_wheel_holds_every_subpackage_and_imports(tmp_path):
    pytest.importorskip("setuptools")
    source = _source_copy(tmp_path)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("rlbolt-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for sub in ("callbacks", "app", "utils", "algorithms", "modules", "models", "rollout", "rewards", "data", "loggers"):
        assert f"rlbolt/{sub}/__init__.py" in names, sub
    assert "rlbolt/rewards/_sandbox_launcher.py" in names  # a private module the sandbox runs by path
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", IMPORTS + PRINT], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout.split()
    _check_imported_from(target, out)


@pytest.mark.slow
def test_regular_install_imports_package_and_callbacks(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # --no-deps: the dependencies come from this environment (PYTHONPATH below); what is checked
    # is that the built wheel holds both the package and the top-level callbacks/ folder.
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(_source_copy(tmp_path))], check=True,
                   cwd=tmp_path)
    # The dependencies through a .pth file, so they come AFTER the venv's own site-packages: on
    # PYTHONPATH they came first, and an environment holding a regular rlbolt install (the README's
    # first command) shadowed the one under test. Every site dir of this process: a venv whose
    # packages come through its own .pth files (not read from PYTHONPATH) is covered too.
    site = next((venv / "lib").glob("python*/site-packages"))
    dirs = [sysconfig.get_paths()["purelib"]] + [p for p in sys.path if p.endswith("site-packages")]
    (site / "zz_test_deps.pth").write_text("\n".join(dict.fromkeys(dirs)) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(py), "-c", IMPORTS + PRINT], check=True, cwd=tmp_path, env=env,
                         capture_output=True, text=True).stdout.split()
    _check_imported_from(venv, out)
