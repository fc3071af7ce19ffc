"""EngineHandle.open_session and rollout.sessions.open_session with fake engines (no JAX): the
weights reach the engine before its session opens, transient weights are let go at once, and
engines without the capability (or that decline) leave the caller to whole histories."""

import numpy as np
import pytest

from rlbolt.rollout.engine import RolloutOutput, SessionEngine
from rlbolt.rollout.engines import EngineHandle
from rlbolt.rollout.sessions import HistorySession, open_session


class Plain:
    """A RolloutEngine without sessions; one id 9 per call; records weight pushes."""

    def __init__(self):
        self.pushed, self.version, self.calls = [], 0, []

    def update_weights(self, params, policy_version):
        self.pushed.append(params)
        self.version = policy_version

    def generate(self, prompt_ids, rng_keys, max_new_tokens=2, **opts):
        self.calls.append([list(p) for p in prompt_ids])
        n = len(prompt_ids)
        ids = np.full((n, max_new_tokens), 0, np.int32)
        ids[:, 0] = 9
        mask = np.zeros((n, max_new_tokens), bool)
        mask[:, 0] = True
        return RolloutOutput(ids, mask, ids, mask, np.zeros((n, max_new_tokens), np.float32), self.version)


class WithSessions(Plain):
    def __init__(self, decline=False):
        super().__init__()
        self.decline, self.opened_with = decline, []

    def open_session(self, prompt_ids, *, max_total_tokens, **opts):
        self.opened_with.append((self.pushed[-1] if self.pushed else None, max_total_tokens, opts))
        return None if self.decline else HistorySession(self.generate, prompt_ids, **opts)


def test_the_handle_pushes_the_weights_before_the_session_opens_and_lets_transient_ones_go():
    engine = WithSessions()
    handle = EngineHandle(engine, release="own arrays")
    session = handle.open_session("merged", 3, [[1, 2]], max_total_tokens=8, keep=False, max_new_tokens=2)
    assert engine.opened_with == [("merged", 8, {"max_new_tokens": 2})]
    assert engine.pushed == ["merged", "own arrays"]  # the session holds what it needs; the engine lets go
    out = session.turn([0], [[]], np.zeros((1, 2), np.uint32))
    assert out.completion_ids[0, 0] == 9 and engine.calls == [[[1, 2]]]
    # The next call with the same weights pushes them again (the handle no longer holds them).
    handle.open_session("merged", 3, [[1]], max_total_tokens=8)
    assert engine.pushed == ["merged", "own arrays", "merged"]


def test_engines_without_sessions_or_that_decline_leave_the_caller_to_whole_histories():
    plain, declining = Plain(), WithSessions(decline=True)
    assert not isinstance(plain, SessionEngine) and isinstance(declining, SessionEngine)
    assert EngineHandle(plain).open_session("w", 1, [[1]], max_total_tokens=4) is None
    assert plain.pushed == []  # nothing pushed for a session that cannot open
    assert EngineHandle(declining).open_session("w", 1, [[1]], max_total_tokens=4) is None
    for engine in (plain, declining, plain.generate):
        session = open_session(engine, [[1, 2], [3]], max_total_tokens=8, max_new_tokens=2)
        assert isinstance(session, HistorySession)
        session.turn([0, 1], [[], []], np.zeros((2, 2), np.uint32))
        session.turn([1], [[4, 5]], np.zeros((1, 2), np.uint32))
    # The second turn of episode 1 is its prompt, its sampled id and the new ids.
    assert plain.calls[-2:] == [[[1, 2], [3]], [[3, 9, 4, 5]]]


def test_history_sessions_refuse_bad_turns_in_one_line():
    session = HistorySession(Plain().generate, [[1], [2]], max_new_tokens=2)
    keys = np.zeros((2, 2), np.uint32)
    with pytest.raises(ValueError, match="ascending"):
        session.turn([1, 1], [[], []], keys)
    with pytest.raises(ValueError, match="new_ids rows"):
        session.turn([0, 1], [[]], keys)
    session.turn([1], [[]], keys[:1])  # episode 0 leaves
    with pytest.raises(ValueError, match="left the session"):
        session.turn([0, 1], [[], []], keys)
