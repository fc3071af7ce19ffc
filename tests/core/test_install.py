"""`pip install .` (a regular, non-editable install) into a fresh venv ships rlbolt.callbacks."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_regular_install_imports_package_and_callbacks(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # --no-deps: the dependencies come from this environment (PYTHONPATH below); what is checked
    # is that the built wheel holds both the package and the top-level callbacks/ folder.
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(REPO)], check=True, cwd=tmp_path)
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    out = subprocess.run(
        [str(py), "-c", "import rlbolt, rlbolt.callbacks, rlbolt.trainer; print(rlbolt.__file__); print(rlbolt.callbacks.__file__)"],
        check=True, cwd=tmp_path, env=env, capture_output=True, text=True,
    ).stdout.split()
    assert all(str(venv) in path for path in out), out  # imported from the install, not the checkout
    assert out[1].endswith("rlbolt/callbacks/__init__.py")
