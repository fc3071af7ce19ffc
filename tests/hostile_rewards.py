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


_WARM = {"done": False}


def _slow_first_call_setup():
    time.sleep(float(os.environ.get("RLBOLT_TEST_WARM_S", "1.5")))  # e.g. importing a large task library
    _WARM["done"] = True


def lazily_warmed_reward(completion, sample):
    """Does its slow set-up inside the first call (as reasoning-gym's import did): 1.0 once warm."""
    if not _WARM["done"]:
        _slow_first_call_setup()
    return 1.0


def warmed_reward(completion, sample):
    """The same set-up, declared as `warm_up`: the worker runs it before any sample's clock starts."""
    return 1.0 if _WARM["done"] else 0.0


warmed_reward.warm_up = _slow_first_call_setup


def _broken_setup():
    raise RuntimeError("setup failed")


def reward_with_broken_warm_up(completion, sample):
    """Scores 0.5; its warm_up raises."""
    return 0.5


reward_with_broken_warm_up.warm_up = _broken_setup
