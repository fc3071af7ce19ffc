"""The RolloutEngine protocol: how the trainer asks for completions and hands over new weights.

A rollout engine turns prompts into sampled completions. rlbolt ships one implementation,
`rlbolt.rollout.NativeSampler` (a jitted JAX sampler with a static KV cache); an engine backed
by another inference server (e.g. vLLM on GPU) implements the same two methods.

Contract
--------
``generate(prompt_ids, rng_keys, **opts) -> RolloutOutput``

- ``prompt_ids``: the N prompts as token ids, either a ``list[list[int]]`` of any lengths or a
  left-padded ``[N, P]`` int array together with ``prompt_mask=[N, P]`` bool.
- ``rng_keys``: ``[N, 2]`` uint32, one raw threefry key per sample
  (``jax.random.key_data(jax.random.split(key, N))``). A sample's completion depends only on its
  own key, its prompt and the weights, never on which other samples share the call or how the
  engine batches them, so results are reproducible across batch sizes and resumes.
- ``opts``: engine-specific overrides for this call (for ``NativeSampler``: ``temperature``,
  ``top_k``, ``top_p``, ``max_new_tokens``); an engine rejects options it does not know.

The result is a ``RolloutOutput`` with static shapes: ``C == max_new_tokens`` always, so every
downstream jitted stage (logps, loss) compiles once.

``update_weights(params, policy_version) -> None``

Hands the engine the policy's current parameters (an ``nnx.State`` with the model's layout, or
the model itself) and the policy version they correspond to (the number of optimizer updates
so far). Every later ``generate`` uses them and stamps ``RolloutOutput.policy_version``; the
trainer uses that stamp to measure staleness in async mode. An engine that shares the
trainer's arrays (colocated, native) may just keep a reference; a remote engine copies or
reshards them.

Multi-turn sessions (optional)
------------------------------
``open_session(prompt_ids, *, max_total_tokens, **opts) -> TurnSession | None``

An engine that can keep each episode's KV cache between the turns of an agent episode
implements this too (`SessionEngine`). The session holds N episodes, each opened on its prompt;
``session.turn(episodes, new_ids, rng_keys)`` appends each listed episode's new ids (the
environment's reply since its last turn) after what it already holds and samples the turn, so
a later turn prefills only those ids. Episodes left out of a turn have left the session. The
tokens and logps are those of ``generate`` over the episode's whole history with the same key
(up to float32 rounding). ``None`` (or no such method) means the engine cannot here:
`rlbolt.rollout.sessions.open_session` then falls back to `HistorySession`, which calls
``generate`` with each episode's whole history every turn (an engine with a prefix cache, such
as vLLM, reuses the shared prefix itself).

Log-probabilities
-----------------
``RolloutOutput.logps`` are the sampled tokens' log-probabilities under the temperature-scaled
distribution *before* top-k/top-p filtering (``log_softmax(logits / temperature)``), i.e. exactly
what ``rlbolt.rollout.token_logps(..., temperature=temperature)`` recomputes. With mu == 1 they can
serve as the "old" policy logps without another forward pass. Greedy decoding (temperature 0)
reports logps at temperature 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class RolloutOutput:
    """Completions for N prompts, as host numpy arrays with static shapes.

    Attributes:
      prompt_ids: [N, P] int32, left-padded with the pad id (P is the prompt bucket used).
      prompt_mask: [N, P] bool, True for real prompt tokens.
      completion_ids: [N, C] int32, C == max_new_tokens; pad id after a stop token.
      completion_mask: [N, C] bool, True through the stop token inclusive.
      logps: [N, C] float32, sampled tokens' logps under the temperature-scaled distribution;
        0 where completion_mask is False.
      policy_version: the policy version of the weights that generated these samples.
    """

    prompt_ids: np.ndarray
    prompt_mask: np.ndarray
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    logps: np.ndarray
    policy_version: int = 0

    @property
    def completion_lengths(self) -> np.ndarray:
        """[N] int32 number of generated tokens per sample (stop token included)."""
        return self.completion_mask.sum(axis=1).astype(np.int32)


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that samples completions and accepts new policy weights (see module docstring)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]] | np.ndarray, rng_keys: np.ndarray,
                 **opts: Any) -> RolloutOutput:
        """Samples one completion per prompt.

        Args:
          prompt_ids: N prompts: a list of id lists, or a left-padded [N, P] int array (then pass
            `prompt_mask=[N, P]`).
          rng_keys: [N, 2] uint32 raw threefry key data, one per sample.
          **opts: engine-specific per-call overrides.

        Returns:
          A RolloutOutput with C == max_new_tokens.
        """
        ...

    def update_weights(self, params: Any, policy_version: int) -> None:
        """Installs new policy parameters for later `generate` calls.

        Args:
          params: an `nnx.State` with the model's parameter layout (or the model).
          policy_version: number of optimizer updates behind these parameters.
        """
        ...


def prompt_rows(prompt_ids: Sequence[Sequence[int]] | np.ndarray, prompt_mask: np.ndarray | None,
                vocab_size: int) -> list[np.ndarray]:
    """The N prompts of a `generate` call as id rows (the protocol's two input forms), checked.

    Args:
      prompt_ids: a list of id lists, or a left-padded [N, P] array with `prompt_mask`.
      prompt_mask: [N, P] bool for an array input, else None.
      vocab_size: every id must lie in [0, vocab_size).

    Returns:
      N int64 arrays, the real ids of each prompt.

    Raises:
      ValueError: mismatched shapes, no prompts, an empty prompt, or an id outside the vocabulary.
    """
    if prompt_mask is not None:
        ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask, bool)
        if ids.ndim != 2 or ids.shape != mask.shape:
            raise ValueError(f"prompt_ids {ids.shape} and prompt_mask {mask.shape} must both be [N, P].")
        rows = [row[m].astype(np.int64) for row, m in zip(ids, mask)]
    else:
        rows = [np.asarray(r, np.int64).reshape(-1) for r in prompt_ids]
    if not rows:
        raise ValueError("generate: got 0 prompts.")
    lengths = np.array([len(r) for r in rows])
    if lengths.min() < 1:
        raise ValueError(f"generate: prompt {int(lengths.argmin())} is empty; every prompt needs >= 1 token.")
    if any(r.min() < 0 or r.max() >= vocab_size for r in rows):
        raise ValueError(f"generate: prompt ids must lie in [0, vocab_size={vocab_size}).")
    return rows


@runtime_checkable
class TurnSession(Protocol):
    """N episodes whose turns an engine samples one after another (see the module docstring)."""

    def turn(self, episodes: Sequence[int], new_ids: Sequence[Sequence[int]], rng_keys: np.ndarray) -> RolloutOutput:
        """Appends each listed episode's new ids and samples its next turn.

        Args:
          episodes: the M episodes (indices into the opening prompts) taking this turn, ascending;
            an episode left out has left the session for good.
          new_ids: per listed episode, the ids after its last turn's sampled ids (empty on its
            first turn); every sampled id of a continuing episode stays in its history.
          rng_keys: [M, 2] uint32 raw threefry keys of this turn.

        Returns:
          A RolloutOutput of the M episodes, C == max_new_tokens.
        """
        ...

    def close(self) -> None:
        """Releases what the session holds (caches, weights)."""
        ...


@runtime_checkable
class SessionEngine(Protocol):
    """A RolloutEngine that can also open multi-turn sessions (the optional capability)."""

    def open_session(self, prompt_ids: Sequence[Sequence[int]], *, max_total_tokens: int,
                     **opts: Any) -> TurnSession | None:
        """Opens a session of N episodes on their prompts with the current weights.

        Args:
          prompt_ids: the N opening prompts as id lists.
          max_total_tokens: the most ids after the prompt per episode (sampled + new).
          **opts: per-session overrides, as `generate`'s (e.g. `max_new_tokens`, `temperature`).

        Returns:
          The session, or None where this engine cannot keep caches (the caller falls back).
        """
        ...
