"""NativeSession: the native sampler's multi-turn session (`rlbolt.rollout.engine.TurnSession`).

`NativeSampler.open_session(prompts, max_total_tokens=T)` prefills each group's prompt once
and gives every episode a KV cache of at most T + 1 slots after the prompt; each `turn` then
prefills only the ids that are new since the episode's last turn and samples the turn
(`rlbolt.rollout.session_decode`). Compiled shapes stay bucketed: one executable per (rows,
group, new-ids bucket, cache size, sampling options); the new ids of a turn are padded to a
power of two (at least 8), the cache grows only through `cache_sizes(T + 1)` (at most four
sizes: a decode step reads about what is filled, not all T + 1 slots), and the rows shrink only
to the sizes `rollout.compaction` allows (B, B/2, B/4), so a turn compiles nothing once its
shapes were seen.

Episodes that are not passed to a turn have left the session: when the live ones fit a smaller
size, their cache rows are gathered into a smaller cache (and each gets its own copy of its
group's prompt cache), so finished episodes stop costing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rlbolt.models.shared_prefix import prompt_group_size
from rlbolt.rollout.compaction import compaction_sizes, next_power_of_two
from rlbolt.rollout.engine import RolloutOutput, prompt_rows
from rlbolt.rollout.sampling import SamplingParams
from rlbolt.rollout.session_decode import _grow_jit, _open_jit, _take_jit, _turn_jit

MIN_NEW_IDS_BUCKET = 8
# The own cache grows through max_total_tokens + 1 over (S + 1) / 8, / 4, / 2 (rounded up to 8,
# never below this): a decode step reads about what is filled, in at most four compiled sizes.
MIN_CACHE_SLOTS = 64


def cache_sizes(slots: int, smallest: int = MIN_CACHE_SLOTS) -> tuple[int, ...]:
    """The own cache's sizes, ascending: `slots`, and its halvings (three at most, rounded up to a
    multiple of 8) that are at least `smallest`."""
    halves = {-(-slots // (2 ** k) // 8) * 8 for k in (1, 2, 3)}
    return tuple(sorted({slots} | {h for h in halves if smallest <= h < slots}))


def _new_ids_bucket(longest: int) -> int:
    return max(MIN_NEW_IDS_BUCKET, next_power_of_two(longest))


class NativeSession:
    """Episodes whose KV caches live on the device between turns (see the module docstring).

    Args:
      graphdef: the model's GraphDef.
      params: the weights every turn samples with (captured at open).
      policy_version: stamped on every turn's RolloutOutput.
      prompts: the N opening prompts as id rows.
      max_total_tokens: T, the most ids after the prompt per episode (sampled + new).
      sp: the sampling options (`max_new_tokens` is each turn's C).
      prompt_buckets: the sampler's padded prompt lengths (the prompt cache's width).
      share_prompts: prefill the prompt of consecutive rows with one prompt once.
      vocab_size: the model's vocabulary size (every prompt id must be below it).
      max_position_embeddings: the model's; the longest prompt + T + 1 must fit.
    """

    def __init__(self, graphdef: Any, params: Any, policy_version: int, prompts: Sequence[Sequence[int]], *,
                 max_total_tokens: int, sp: SamplingParams, prompt_buckets: Sequence[int], share_prompts: bool,
                 vocab_size: int, max_position_embeddings: int):
        if not isinstance(max_total_tokens, int) or isinstance(max_total_tokens, bool) or max_total_tokens < 1:
            raise ValueError(f"open_session: max_total_tokens={max_total_tokens!r} must be an int >= 1")
        rows = prompt_rows(prompts, None, vocab_size)
        longest = max(len(r) for r in rows)
        if longest + max_total_tokens > max_position_embeddings:
            raise ValueError(f"open_session: prompt length {longest} + max_total_tokens={max_total_tokens} exceeds "
                             f"the model's max_position_embeddings={max_position_embeddings}; lower max_total_tokens")
        fitting = [b for b in sorted(prompt_buckets) if b >= longest - 1]
        if not fitting:
            raise ValueError(f"open_session: a prompt has {longest} tokens, more than the largest of prompt_buckets="
                             f"{tuple(prompt_buckets)} + 1; add a bucket >= {longest - 1} or truncate prompts")
        width = fitting[0]
        n = len(rows)
        ids = np.full((n, width), sp.pad_id, np.int32)
        mask = np.zeros((n, width), bool)
        for i, r in enumerate(rows):  # every id but the last: that one starts the first turn
            if len(r) > 1:
                ids[i, width - len(r) + 1:] = r[:-1]
                mask[i, width - len(r) + 1:] = True
        # Sharing needs the same last id too: compare whole prompts, then prefill the prefixes.
        full = np.full((n, longest), sp.pad_id, np.int64)
        full_mask = np.zeros((n, longest), bool)
        for i, r in enumerate(rows):
            full[i, longest - len(r):], full_mask[i, longest - len(r):] = r, True
        group = prompt_group_size(full, full_mask) if share_prompts else 1
        batch = group * next_power_of_two(-(-n // group))  # whole groups, a power of two of them
        if batch > n:  # filler rows: never live
            ids = np.concatenate([ids, np.full((batch - n, width), sp.pad_id, np.int32)])
            mask = np.concatenate([mask, np.zeros((batch - n, width), bool)])
        self._graphdef, self._params, self.policy_version = graphdef, params, int(policy_version)
        self.sp, self.max_total_tokens, self.num_episodes = sp, max_total_tokens, n
        self._vocab, self._group = vocab_size, group
        self._sizes = compaction_sizes(batch)  # the row counts the cache may shrink to
        self._slots = cache_sizes(max_total_tokens + 1, MIN_CACHE_SLOTS)
        self._state = _open_jit(params, ids[::group], mask[::group], graphdef=graphdef, group=group,
                                slots=self._slots[0])
        self._row = np.arange(n)  # episode -> its row in the cache
        self._open = np.ones(n, bool)  # episodes still in the session
        self._last = np.array([r[-1] for r in rows], np.int32)  # each episode's id not fed yet
        self._used = np.zeros(n, np.int64)  # ids after the prompt so far (sampled + new)
        self.last_decode_steps = 0

    @property
    def rows(self) -> int:
        """Rows of the session's cache now (shrinks as episodes leave)."""
        return int(self._state.mask.shape[0])

    def turn(self, episodes: Sequence[int], new_ids: Sequence[Sequence[int]], rng_keys: np.ndarray) -> RolloutOutput:
        """Appends each listed episode's new ids to its cache and samples its next turn.

        Args:
          episodes: the M episodes (indices into the opening prompts) that take this turn, ascending;
            an open episode left out has left the session for good.
          new_ids: per listed episode, the ids after its last turn's sampled ids (the environment's
            reply); empty on an episode's first turn.
          rng_keys: [M, 2] uint32 raw threefry keys of this turn, one per listed episode.

        Returns:
          A RolloutOutput of the M episodes (C = max_new_tokens; `prompt_ids` holds the ids fed
          before sampling: the previous turn's last id and the new ids). An episode whose budget
          runs out mid-turn gets one id past it, so the caller sees the cut.

        Raises:
          ValueError: episodes not ascending, unknown or already left; mismatched new_ids or keys;
            an id outside the vocabulary; new ids past the episode's max_total_tokens.
        """
        episodes = np.asarray(episodes, np.int64).reshape(-1)
        m = len(episodes)
        if m == 0:
            raise ValueError("turn: got no episodes; close the session instead")
        if (np.diff(episodes) <= 0).any() or episodes.min() < 0 or episodes.max() >= self.num_episodes:
            raise ValueError(f"turn: episodes must be ascending indices in [0, {self.num_episodes}); got {episodes}")
        if not self._open[episodes].all():
            gone = episodes[~self._open[episodes]].tolist()
            raise ValueError(f"turn: episodes {gone} left the session in an earlier turn; open a new session")
        if len(new_ids) != m:
            raise ValueError(f"turn: {len(new_ids)} new_ids rows for {m} episodes; pass one (maybe empty) per episode")
        keys = np.asarray(rng_keys)
        if keys.shape != (m, 2) or keys.dtype != np.uint32:
            raise ValueError(f"turn: rng_keys must be [M={m}, 2] uint32; got {keys.shape} {keys.dtype}")
        new = [np.asarray(r, np.int64).reshape(-1) for r in new_ids]
        for e, r in zip(episodes, new):
            if len(r) and (r.min() < 0 or r.max() >= self._vocab):
                raise ValueError(f"turn: episode {e}'s new ids must lie in [0, vocab_size={self._vocab})")
            if self._used[e] + len(r) > self.max_total_tokens:
                raise ValueError(f"turn: episode {e} would hold {self._used[e] + len(r)} ids after its prompt, more "
                                 f"than max_total_tokens={self.max_total_tokens}; end the episode instead")
        left = self._open.copy()
        left[episodes] = False
        self._open[left] = False
        self._shrink(episodes)

        fed = [np.concatenate([[self._last[e]], r]) for e, r in zip(episodes, new)]
        # Room for every live row's whole turn (its fed ids, then C - 1 sampled ids fed back).
        needed = max(1 + int(self._used[e]) + len(r) + self.sp.max_new_tokens - 1 for e, r in zip(episodes, new))
        slots = next((s for s in self._slots if s >= needed), self._slots[-1])
        if slots > self._state.mask.shape[1]:
            self._state = _grow_jit(self._state, slots=slots)
        width = _new_ids_bucket(max(len(f) for f in fed))
        b = self.rows
        ids = np.full((b, width), self.sp.pad_id, np.int32)
        counts = np.zeros(b, np.int32)
        live = np.zeros(b, bool)
        all_keys = np.zeros((b, 2), np.uint32)
        rows = self._row[episodes]
        for row, f, key in zip(rows, fed, keys):
            ids[row, :len(f)], counts[row], live[row], all_keys[row] = f, len(f), True, key
        self._state, out_ids, out_mask, out_logps, steps = _turn_jit(
            self._params, self._state, ids, counts, live, all_keys, graphdef=self._graphdef, sp=self.sp,
            group=self._group)
        out_ids, out_mask, out_logps = (np.asarray(x)[rows] for x in (out_ids, out_mask, out_logps))
        self.last_decode_steps = int(steps)
        sampled = out_mask.sum(axis=1)
        self._used[episodes] += np.array([len(r) for r in new]) + sampled
        self._last[episodes] = out_ids[np.arange(m), np.maximum(sampled - 1, 0)]
        fed_ids = np.full((m, width), self.sp.pad_id, np.int32)
        fed_mask = np.zeros((m, width), bool)
        for k, f in enumerate(fed):
            fed_ids[k, width - len(f):], fed_mask[k, width - len(f):] = f, True
        return RolloutOutput(prompt_ids=fed_ids, prompt_mask=fed_mask, completion_ids=out_ids,
                             completion_mask=out_mask, logps=out_logps, policy_version=self.policy_version)

    def _shrink(self, episodes: np.ndarray) -> None:
        """Gathers the rows of `episodes` into the smallest allowed size that holds them."""
        size = min(s for s in self._sizes if s >= len(episodes))
        if size == self.rows:
            return
        keep = self._row[episodes]
        spare = np.setdiff1d(np.arange(self.rows), keep)[:size - len(keep)]  # dead rows filling the size
        idx = np.concatenate([keep, spare]).astype(np.int32)
        self._state = _take_jit(self._state, idx, group=self._group)
        self._group = 1
        self._row[episodes] = np.arange(len(episodes))

    def close(self) -> None:
        """Lets go of the caches and the weights."""
        self._state = self._params = None
        self._open[:] = False
