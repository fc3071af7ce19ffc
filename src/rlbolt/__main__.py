"""`python -m rlbolt ...` is the `rlbolt` command."""

from rlbolt.app.cli import run

run()
