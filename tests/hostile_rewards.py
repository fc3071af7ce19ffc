"""Reward functions that misbehave on purpose, for the reward-isolation tests.

Standard library only and at module level: worker processes import this file by name (pytest
puts tests/ on sys.path), and a light import keeps their start-up cheap.
"""

import os
import re
import time

CATASTROPHIC = "a" * 27 + "b"  # (a+)+$ backtracks 2^27 times: ~10 s holding the GIL, then ends


def hostile_reward(completion, sample):
    """Misbehaves as `sample["kind"]` says; "ok" scores the completion's length."""
    kind = sample["kind"]
    if kind == "exit":
        os._exit(3)  # a native crash, or a stray exit in C: ends the process that runs it
    if kind == "regex":
        re.match(r"(a+)+$", CATASTROPHIC)  # never releases the GIL while it runs
    if kind == "hang":
        time.sleep(120)  # bounded, so a failure of the isolation cannot hang CI forever
    if kind == "string":
        return "0.75"
    if kind == "nan":
        return float("nan")
    if kind == "pid":
        return float(os.getpid())
    return float(len(completion))


def always_raises(completion, sample):
    """A broken reward: fails on every sample."""
    raise RuntimeError("the grader is down")
