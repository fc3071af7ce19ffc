"""Argument types the `rlbolt` command's parsers share (JAX-free: `rlbolt launch` imports them)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1, or argparse's one-line error naming the value.

    Args:
      text: the argument as typed.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value
