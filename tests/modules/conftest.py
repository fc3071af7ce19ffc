"""Puts this folder on sys.path (for module_helpers) and shares one tiny model and tokenizer."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from module_helpers import builtin_tokenizer, tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return builtin_tokenizer()


@pytest.fixture(scope="session")
def model(tokenizer):
    return tiny_model(tokenizer)
