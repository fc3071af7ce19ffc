"""Puts this folder on sys.path (for agents_helpers)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
