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


STAGES = {0: "exit", 1: "regex", 2: "ok", 3: "hang", 4: "string", 5: "ok", 6: "nan", 7: "ok", 8: "ok"}


def staged_reward(completion, sample):
    """Prompts 0-8 (three steps of three prompts) misbehave as STAGES says; every later one raises."""
    kind = STAGES.get(sample["prompt_index"])
    if kind is None:
        raise RuntimeError("the grader is down")
    return hostile_reward(completion, {"kind": kind})
