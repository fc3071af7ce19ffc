"""Opening a multi-turn session on any rollout engine: the engine's own (`SessionEngine`,
which keeps each episode's KV cache), or `HistorySession`, which calls `generate` with every
episode's whole history each turn (what an engine without the capability can do).

    session = open_session(engine, prompts, max_total_tokens=256, max_new_tokens=32)
    out = session.turn([0, 1, 2], [[], [], []], keys0)        # first turn: no new ids
    out = session.turn([0, 2], [reply0, reply2], keys1)       # episode 1 left the session
    session.close()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rlbolt.rollout.engine import RolloutOutput, SessionEngine, TurnSession

__all__ = ["HistorySession", "open_session"]


class HistorySession:
    """A `TurnSession` over a `generate` callable: each turn passes every listed episode's whole
    history (prompt, sampled ids, new ids) and the engine prefills all of it again.

    Args:
      generate: `generate(prompt_ids: list[list[int]], rng_keys, **opts) -> RolloutOutput`.
      prompt_ids: the N opening prompts.
      **opts: passed to every `generate` call.
    """

    def __init__(self, generate: Callable[..., RolloutOutput], prompt_ids: Sequence[Sequence[int]], **opts: Any):
        self._generate, self._opts = generate, opts
        self._history = [[int(t) for t in p] for p in prompt_ids]
        self._open = np.ones(len(self._history), bool)

    def turn(self, episodes: Sequence[int], new_ids: Sequence[Sequence[int]], rng_keys: np.ndarray) -> RolloutOutput:
        """See `rlbolt.rollout.engine.TurnSession.turn`.

        Raises:
          ValueError: episodes not ascending, unknown or already left, or one new_ids row per
            episode missing.
        """
        episodes = [int(e) for e in episodes]
        n = len(self._history)
        if any(b <= a for a, b in zip(episodes, episodes[1:])) or any(not 0 <= e < n for e in episodes):
            raise ValueError(f"turn: episodes must be ascending indices in [0, {n}); got {episodes}")
        if not all(self._open[e] for e in episodes):
            raise ValueError(f"turn: episodes {[e for e in episodes if not self._open[e]]} left the session earlier")
        if len(new_ids) != len(episodes):
            raise ValueError(f"turn: {len(new_ids)} new_ids rows for {len(episodes)} episodes; pass one per episode")
        listed = np.zeros(n, bool)
        listed[episodes] = True
        self._open &= listed
        for e, ids in zip(episodes, new_ids):
            self._history[e].extend(int(t) for t in ids)
        out = self._generate([self._history[e] for e in episodes], rng_keys, **self._opts)
        for row, e in enumerate(episodes):
            count = int(np.asarray(out.completion_mask[row]).sum())
            self._history[e].extend(int(t) for t in np.asarray(out.completion_ids[row])[:count])
        return out

    def close(self) -> None:
        """Forgets the histories."""
        self._history = [[] for _ in self._history]
        self._open[:] = False


def open_session(engine: Any, prompt_ids: Sequence[Sequence[int]], *, max_total_tokens: int,
                 **opts: Any) -> TurnSession:
    """A session of N episodes on `engine`: its own (`SessionEngine.open_session`) where it has
    one and can open it, else a `HistorySession` over its `generate`.

    Args:
      engine: a RolloutEngine (a `SessionEngine` keeps caches), or a bare `generate` callable.
      prompt_ids: the N opening prompts.
      max_total_tokens: the most ids after the prompt per episode.
      **opts: the engine's per-call options (`max_new_tokens`, `temperature`, ...).
    """
    if isinstance(engine, SessionEngine):
        session = engine.open_session(prompt_ids, max_total_tokens=max_total_tokens, **opts)
        if session is not None:
            return session
    return HistorySession(engine.generate if hasattr(engine, "generate") else engine, prompt_ids, **opts)
