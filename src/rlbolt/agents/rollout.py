"""`run_episodes`: many multi-turn episodes at once, one batched engine call per turn.

The episodes run in one multi-turn session of the engine (`rlbolt.rollout.sessions.open_session`):
each turn passes every live episode's new ids (the environment's reply since its last turn) in
one `session.turn` call. An engine with the session capability (the native sampler) keeps each
episode's KV cache between turns and prefills only those ids; any other engine gets each live
episode's whole history through `generate` every turn (`HistorySession`; vLLM's prefix cache
then reuses what it can), and needs prompt buckets up to P + max_total_tokens. Episode i's turn
t is sampled with the key `fold_in(rng_keys[i], t)`, and the engine's completions depend only on
a sample's key and history, so an episode's tokens do not depend on which other episodes share
the batch, when they finish, or which of the two paths ran it. Finished episodes leave the
session. An episode ends when its environment says done, after `max_turns` turns, when
`max_total_tokens` (sampled + environment ids after the prompt) are spent, or when its
environment's step raises or hangs (`env_error`); the reason is recorded per sample.

Environment steps of a turn run concurrently, one daemon thread each, with a time-out
(`step_timeout_s`): a step that hangs ends only its own episode.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rlbolt.agents.environment import Environment, StepResult
from rlbolt.agents.episode import EpisodeState, TurnRenderer
from rlbolt.agents.failures import EnvFailureError
from rlbolt.agents.parsers import THINK_TAGS, split_reasoning
from rlbolt.batch import register_column
from rlbolt.rollout.sessions import open_session

__all__ = ["EpisodeBatch", "run_episodes", "END_REASONS"]

END_REASONS = ("done", "max_turns", "budget", "env_error")

# env_reward stays a prompt-row field: the env reward term reads it (rlbolt.rewards.environment).
register_column("sequence_mask", "[N, T]", "bool", "an episode's real ids (sampled and environment)", by=__name__)


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    """N finished episodes as static-width host arrays (T = max_total_tokens) plus metadata.

    Attributes:
        prompt_ids: N opening prompts (id lists of any length; `padded_prompts` left-pads them).
        completion_ids: [N, T] int32: each episode's ids after its prompt (sampled and
            environment), right-padded with the pad id.
        completion_mask: [N, T] bool: True exactly on sampled ids (each turn's stop token
            included): the loss mask. False on environment ids and padding (holes).
        sequence_mask: [N, T] bool: True on every real id (sampled and environment): what the
            training forward attends over. Train with `token_logps(..., completion_mask=sequence_mask)`
            and mask the loss with `completion_mask`.
        sampler_logps: [N, T] float32: the sampler's logps on sampled ids; 0 elsewhere.
        env_reward: [N] float32: each episode's step rewards summed.
        turns, tool_calls, tool_errors: [N] int32 per episode.
        tool_time_s: [N] float32.
        end_reason: [N] object: "done", "max_turns", "budget" or "env_error".
        transcript: [N] object: prompt and sequence decoded with special tokens kept.
        messages: per episode, the conversation as messages (opening, turns, replies).
        errors: {episode index: text} for episodes ended by their environment's error.
    """

    prompt_ids: list[list[int]]
    completion_ids: np.ndarray
    completion_mask: np.ndarray
    sequence_mask: np.ndarray
    sampler_logps: np.ndarray
    env_reward: np.ndarray
    turns: np.ndarray
    tool_calls: np.ndarray
    tool_errors: np.ndarray
    tool_time_s: np.ndarray
    end_reason: np.ndarray
    transcript: np.ndarray
    messages: list[list[dict]]
    errors: dict[int, str]

    @property
    def num_episodes(self) -> int:
        """N."""
        return len(self.prompt_ids)

    def padded_prompts(self, pad_id: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(prompt_ids [N, P] int32 left-padded, prompt_mask [N, P] bool); P = `width` or the longest.

        Raises:
            ValueError: a prompt is longer than `width`.
        """
        longest = max((len(p) for p in self.prompt_ids), default=0)
        width = longest if width is None else width
        if longest > width:
            raise ValueError(f"padded_prompts: a prompt has {longest} tokens but width={width}; pass a larger width")
        ids = np.full((self.num_episodes, width), pad_id, np.int32)
        mask = np.zeros((self.num_episodes, width), bool)
        for i, prompt in enumerate(self.prompt_ids):
            if prompt:
                ids[i, width - len(prompt):] = prompt
                mask[i, width - len(prompt):] = True
        return ids, mask

    def columns(self, pad_id: int, prompt_width: int | None = None) -> dict[str, np.ndarray]:
        """The columns an RLModule's `on_rollout` adds to its batch (`batch.with_columns(**columns)`).

        Args:
            pad_id: the tokenizer's pad id.
            prompt_width: the prompts' padded width (a fixed width compiles once); None: the longest.

        Returns:
            prompt_ids [N, P], prompt_mask [N, P], completion_ids / completion_mask / sequence_mask /
            sampler_logps [N, T], env_reward [N] and completion_text [N] (the transcripts).
        """
        prompt_ids, prompt_mask = self.padded_prompts(pad_id, prompt_width)
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": self.completion_ids,
                "completion_mask": self.completion_mask, "sequence_mask": self.sequence_mask,
                "sampler_logps": self.sampler_logps, "env_reward": self.env_reward, "completion_text": self.transcript}

    def metrics(self) -> dict[str, float]:
        """Step metrics, each a mean over the episodes (`agents/end/<reason>`: the fraction that ended so)."""
        n = max(self.num_episodes, 1)
        model = self.completion_mask.sum(axis=1)
        env = self.sequence_mask.sum(axis=1) - model
        out = {
            "agents/turns": float(self.turns.mean()) if self.num_episodes else 0.0,
            "agents/tool_calls": float(self.tool_calls.sum()) / n,
            "agents/tool_errors": float(self.tool_errors.sum()) / n,
            "agents/tool_time_s": float(self.tool_time_s.astype(np.float64).sum()) / n,
            "agents/model_tokens": float(model.sum()) / n,
            "agents/env_tokens": float(env.sum()) / n,
            "agents/env_reward": float(self.env_reward.mean()) if self.num_episodes else 0.0,
        }
        for reason in END_REASONS:
            out[f"agents/end/{reason}"] = float(np.sum(self.end_reason == reason)) / n
        return out


def _turn_keys(rng_keys: np.ndarray, turn: int) -> np.ndarray:
    """[M, 2] uint32: fold_in(key, turn) of each raw threefry key."""
    keys = jnp.asarray(rng_keys, jnp.uint32)
    return np.asarray(jax.vmap(lambda k: jax.random.fold_in(k, turn))(keys), np.uint32)


def _step_all(envs: Sequence[Environment], texts: Sequence[str], timeout_s: float) -> list[StepResult | str]:
    """env.step(text) for each pair on its own daemon thread; a StepResult, or the error text."""
    slots: list[dict] = [{} for _ in envs]

    def work(env, text, slot):
        try:
            result = env.step(text)
            if not isinstance(result, StepResult):
                raise TypeError(f"step() returned {type(result).__name__}, not a StepResult")
            slot["result"] = result
        except BaseException as error:  # noqa: BLE001 - an environment's bug costs its episode
            slot["error"] = f"{type(env).__name__}.step raised {type(error).__name__}: {error}"

    threads = [threading.Thread(target=work, args=(e, t, s), daemon=True, name="rlbolt-env-step")
               for e, t, s in zip(envs, texts, slots)]
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.start()
    out: list[StepResult | str] = []
    for env, thread, slot in zip(envs, threads, slots):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            out.append(f"{type(env).__name__}.step did not return within step_timeout_s={timeout_s:g} s")
        else:
            out.append(slot.get("result") or slot.get("error", "step ended without a result"))
    return out


def _check_limits(max_turns: int, max_total_tokens: int, max_turn_tokens: int) -> None:
    for name, value in (("max_turns", max_turns), ("max_total_tokens", max_total_tokens),
                        ("max_turn_tokens", max_turn_tokens)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ValueError(f"run_episodes: {name}={value!r} must be an int >= 1")


def run_episodes(engine: Any, envs: Sequence[Environment], rng_keys: np.ndarray, *, tokenizer: Any,
                 max_turns: int, max_total_tokens: int, max_turn_tokens: int,
                 prompt_ids: Sequence[Sequence[int]] | None = None, temperature: float | None = None,
                 stop_token_ids: Sequence[int] | None = None, template_kwargs: Mapping[str, Any] | None = None,
                 stop_text: str | None = None, step_timeout_s: float = 60.0,
                 reasoning_tags: tuple[str, str] | None = THINK_TAGS) -> EpisodeBatch:
    """Runs N episodes to their end, batching each turn's generation over the live ones.

    Args:
        engine: a `RolloutEngine` (one with `open_session` keeps each episode's KV cache across
            turns), or a callable with `generate`'s signature
            `(prompt_ids: list[list[int]], rng_keys, **opts) -> RolloutOutput`.
        envs: N environments (one per sample: a group's G samples get G environments).
        rng_keys: [N, 2] uint32 raw threefry keys, one per sample (the `sample_keys` column).
        tokenizer: renders and tokenises the environment's messages (chat template) and decodes
            each turn for the environment.
        max_turns: most model turns per episode.
        max_total_tokens: T, the most ids after the prompt (sampled + environment) per episode;
            the width of the returned arrays.
        max_turn_tokens: most ids sampled per turn (the engine's `max_new_tokens`, fixed so the
            engine compiles once per prompt bucket).
        prompt_ids: the rows' encoded prompts, used for environments whose `reset()` returns None.
        temperature: passed to the engine when not None.
        stop_token_ids: ids that end a turn (default: the tokenizer's eos); a turn that did not
            end on one was cut at max_turn_tokens.
        template_kwargs: extra chat-template variables (e.g. `enable_thinking=False`).
        stop_text: the stop token's text in the template (see `TurnRenderer`).
        step_timeout_s: how long one environment step may take before its episode ends.
        reasoning_tags: (open, close) of a reasoning model's thinking (`<think>`, `</think>`):
            each turn's reasoning is split off (`split_reasoning`) and `step` gets the answer
            after it, as a serving stack's reasoning parser does, so a tool call written while
            thinking is not run; the messages hold the answer as `content` and the reasoning as
            `reasoning_content`. The trained ids are the sampled ids either way. None: `step`
            gets the whole turn.

    Returns:
        An EpisodeBatch with T = max_total_tokens.

    Raises:
        ValueError: a limit, the keys or the prompts do not fit the environments (one line each).
        EnvFailureError: an environment's `reset()` raised (set-up, not the model's doing).
    """
    _check_limits(max_turns, max_total_tokens, max_turn_tokens)
    n = len(envs)
    keys = np.asarray(rng_keys)
    if keys.shape != (n, 2) or keys.dtype != np.uint32:
        raise ValueError(f"run_episodes: rng_keys must be [N={n}, 2] uint32 (one raw key per environment); got "
                         f"{keys.shape} {keys.dtype}")
    if prompt_ids is not None and len(prompt_ids) != n:
        raise ValueError(f"run_episodes: prompt_ids has {len(prompt_ids)} rows for {n} environments; pass one per env")
    stops = set(int(t) for t in (stop_token_ids if stop_token_ids is not None else (tokenizer.eos_id,)))
    opts = {"max_new_tokens": max_turn_tokens, **({"temperature": temperature} if temperature is not None else {})}

    renderers, states = [], []
    shared: dict[str, TurnRenderer] = {}  # one renderer (and delta cache) per distinct tool set
    for i, env in enumerate(envs):
        schemas = [t.schema for t in getattr(env, "tools", ())]
        key = json.dumps(schemas, sort_keys=True, default=str)
        renderer = shared.get(key)
        if renderer is None:
            renderer = shared[key] = TurnRenderer(tokenizer, schemas, template_kwargs, stop_text)
        try:
            opening = env.reset()
        except Exception as error:  # a broken factory or row is a set-up bug: stop, naming the episode
            raise EnvFailureError(f"environment {i} ({type(env).__name__}).reset() raised "
                                  f"{type(error).__name__}: {error}") from error
        if opening is None:
            if prompt_ids is None:
                raise ValueError(f"run_episodes: environment {i} ({type(env).__name__}) returned no opening messages "
                                 "and no prompt_ids were given; pass prompt_ids or return messages from reset()")
            state = EpisodeState(prompt=[int(t) for t in prompt_ids[i]])
        else:
            state = EpisodeState(prompt=renderer.prompt_ids(opening), messages=[dict(m) for m in opening])
        renderers.append(renderer)
        states.append(state)

    if n:
        session = open_session(engine, [s.prompt for s in states], max_total_tokens=max_total_tokens, **opts)
        try:
            _run_turns(session, envs, states, renderers, keys, tokenizer, stops, max_turns, max_total_tokens,
                       step_timeout_s, reasoning_tags)
        finally:
            session.close()
    for state in states:  # the loop ran out of turns before these were stepped
        if state.end_reason is None:
            state.end_reason = "max_turns"
    return _assemble(states, tokenizer, max_total_tokens)


def _run_turns(session, envs, states, renderers, keys, tokenizer, stops, max_turns, max_total_tokens,
               step_timeout_s, reasoning_tags) -> None:
    """The turns of `run_episodes`: every live episode's turn in one session call, then its step."""
    new_ids: dict[int, list[int]] = {i: [] for i in range(len(states))}  # ids since each episode's last turn
    for turn in range(max_turns):
        live = [i for i, s in enumerate(states) if not s.done]
        if not live:
            break
        out = session.turn(live, [new_ids[i] for i in live], _turn_keys(keys, turn)[live])  # all N: one shape, one compile
        texts, stopped = [], []
        for row, i in enumerate(live):
            state = states[i]
            count = int(np.asarray(out.completion_mask[row]).sum())
            ids = [int(t) for t in np.asarray(out.completion_ids[row])[:count]]
            logps = np.asarray(out.logps[row], np.float32)[:count]
            room = max_total_tokens - len(state.tokens)
            cut = count > room
            state.add_model_turn(ids[:room], logps[:room])
            state.turns += 1
            text = tokenizer.decode(ids[:room])
            reasoning, answer = split_reasoning(text, reasoning_tags) if reasoning_tags else ("", text)
            message = {"role": "assistant", "content": answer}
            if reasoning or answer != text:  # the raw turn is in the transcript
                message["reasoning_content"] = reasoning
            state.messages.append(message)
            texts.append(answer)
            stopped.append(count > 0 and ids[min(count, room) - 1] in stops)
            if cut:  # the budget ended the turn: the environment never sees a turn it did not finish
                state.end_reason = "budget"
        stepping = [(row, i) for row, i in enumerate(live) if not states[i].done]
        results = _step_all([envs[i] for _, i in stepping], [texts[row] for row, _ in stepping], step_timeout_s)
        for (row, i), result in zip(stepping, results):
            state = states[i]
            if isinstance(result, str):
                state.end_reason, state.error = "env_error", result
                continue
            state.reward += float(result.reward)
            state.tool_calls += int(result.tool_calls)
            state.tool_errors += int(result.tool_errors)
            state.tool_time_s += float(result.tool_time_s)
            state.messages.extend(dict(m) for m in result.messages)
            if result.done:
                state.end_reason = "done"
            elif turn == max_turns - 1:
                state.end_reason = "max_turns"
            else:
                try:
                    delta = renderers[i].delta_ids(result.messages, stopped[row])
                except Exception as error:  # noqa: BLE001 - e.g. a reply the tokenizer cannot encode
                    state.end_reason = "env_error"
                    state.error = f"the environment's reply could not be rendered: {type(error).__name__}: {error}"
                    continue
                if len(state.tokens) + len(delta) >= max_total_tokens:  # no room left for a model id
                    state.add_env_tokens(delta[:max_total_tokens - len(state.tokens)])
                    state.end_reason = "budget"
                else:
                    state.add_env_tokens(delta)
                    new_ids[i] = delta


def _assemble(states: Sequence[EpisodeState], tokenizer: Any, width: int) -> EpisodeBatch:
    n = len(states)
    ids = np.full((n, width), tokenizer.pad_id, np.int32)
    model = np.zeros((n, width), bool)
    seq = np.zeros((n, width), bool)
    logps = np.zeros((n, width), np.float32)
    for i, s in enumerate(states):
        k = len(s.tokens)
        ids[i, :k], model[i, :k], seq[i, :k], logps[i, :k] = s.tokens, s.model_mask, True, s.logps
    transcripts = np.empty(n, dtype=object)
    for i, s in enumerate(states):
        transcripts[i] = tokenizer.decode(s.prompt + s.tokens, skip_special_tokens=False)
    return EpisodeBatch(
        prompt_ids=[list(s.prompt) for s in states], completion_ids=ids, completion_mask=model, sequence_mask=seq,
        sampler_logps=logps, env_reward=np.asarray([s.reward for s in states], np.float32),
        turns=np.asarray([s.turns for s in states], np.int32),
        tool_calls=np.asarray([s.tool_calls for s in states], np.int32),
        tool_errors=np.asarray([s.tool_errors for s in states], np.int32),
        tool_time_s=np.asarray([s.tool_time_s for s in states], np.float32),
        end_reason=np.asarray([s.end_reason for s in states], dtype=object), transcript=transcripts,
        messages=[s.messages for s in states], errors={i: s.error for i, s in enumerate(states) if s.error})
