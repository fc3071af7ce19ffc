"""run_episodes through an engine's multi-turn session: the kept KV cache gives the episodes the
full-history path gives, an engine's session sees only new ids, and engines without the
capability (or that decline it) get whole histories through `generate`."""

import jax
import numpy as np
import pytest
from agents_helpers import ChatTokenizer, ScriptedEngine
from flax import nnx

from rlbolt.agents import StepResult, run_episodes
from rlbolt.demo.agent_tasks import demo_tokenizer, guess_env, guess_rows
from rlbolt.models import Decoder, tiny_config
from rlbolt.rollout import NativeSampler
from rlbolt.rollout.engine import SessionEngine
from rlbolt.rollout.sessions import HistorySession

from float_tolerance import decoder_logps_tolerance

LIMITS = dict(max_turns=4, max_turn_tokens=3, max_total_tokens=20)
TOK = ChatTokenizer()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_native_sessions_give_the_episodes_of_the_full_history_path(temperature):
    tok = demo_tokenizer()
    config = tiny_config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=48)
    model = Decoder(config, rngs=nnx.Rngs(3))
    sampler = NativeSampler(model, max_new_tokens=LIMITS["max_turn_tokens"],
                            stop_token_ids=(tok.eos_id,), pad_id=tok.pad_id, prompt_buckets=(8, 16, 24))
    rows = [r for r in guess_rows(4, seed=2) for _ in range(2)]  # groups of two episodes of one task
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(1), len(rows))), np.uint32)
    kept = run_episodes(sampler, [guess_env(r) for r in rows], keys, tokenizer=tok, temperature=temperature, **LIMITS)
    # The full-history path in one shape (8 rows, the largest bucket): one compiled reference program.
    reference = NativeSampler(model, max_new_tokens=LIMITS["max_turn_tokens"], stop_token_ids=(tok.eos_id,),
                              pad_id=tok.pad_id, prompt_buckets=(24,), micro_batch_size=8, share_prompts=False)
    full = run_episodes(reference.generate, [guess_env(r) for r in rows], keys, tokenizer=tok,
                        temperature=temperature, **LIMITS)
    assert kept.turns.max() >= 2 and (kept.sequence_mask & ~kept.completion_mask).any()  # replies were fed
    for name in ("completion_ids", "completion_mask", "sequence_mask", "turns", "end_reason", "env_reward"):
        np.testing.assert_array_equal(getattr(kept, name), getattr(full, name), err_msg=name)
    # float32 rounding only: a history prefilled at once vs in pieces (derived, tests/float_tolerance.py)
    tol = decoder_logps_tolerance(model, config.max_position_embeddings)
    np.testing.assert_allclose(kept.sampler_logps, full.sampler_logps, atol=tol, rtol=0)


class Replies:
    """Replies "r<turn>" to each turn; done after `turns` steps."""

    tools = ()

    def __init__(self, turns):
        self.turns, self.steps = turns, 0

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, text):
        self.steps += 1
        return StepResult(messages=[{"role": "user", "content": f"r{self.steps}"}], done=self.steps >= self.turns)


class RecordingSessionEngine(ScriptedEngine):
    """A ScriptedEngine with the session capability: its session records what each turn is given."""

    def __init__(self, tokenizer, script, decline=False):
        super().__init__(tokenizer, script)
        self.decline, self.turns, self.histories = decline, [], []

    def generate(self, prompt_ids, rng_keys, **opts):
        self.histories.append([list(p) for p in prompt_ids])
        return super().generate(prompt_ids, rng_keys, **opts)

    def open_session(self, prompt_ids, *, max_total_tokens, **opts):
        if self.decline:
            return None
        engine = self

        class Session(HistorySession):
            def turn(self, episodes, new_ids, rng_keys):
                engine.turns.append((list(episodes), [list(x) for x in new_ids]))
                return super().turn(episodes, new_ids, rng_keys)

        return Session(super().generate, prompt_ids, **opts)


def test_an_engine_session_is_given_only_each_episodes_new_ids():
    engine = RecordingSessionEngine(TOK, lambda history, key: "ab")
    assert isinstance(engine, SessionEngine)
    out = run_episodes(engine, [Replies(1), Replies(3)], np.zeros((2, 2), np.uint32), tokenizer=TOK, max_turns=4,
                       max_total_tokens=200, max_turn_tokens=8)
    assert [e for e, _ in engine.turns] == [[0, 1], [1], [1]]  # episode 0 left after its one turn
    assert engine.turns[0][1] == [[], []]
    # Turn 2 of episode 1 is given the environment's reply to turn 1, nothing sampled or older.
    reply = engine.turns[1][1][0]
    assert "r1" in TOK.decode(reply) and "ab" not in TOK.decode(reply)
    seq = out.completion_ids[1][out.sequence_mask[1]].tolist()
    turn_ids = TOK.encode("ab") + [TOK.eos_id]
    assert seq[:len(turn_ids) + len(reply)] == turn_ids + reply


@pytest.mark.parametrize("engine_kind", ["no capability", "declines"])
def test_engines_without_sessions_get_whole_histories(engine_kind):
    script = lambda history, key: "ab"  # noqa: E731
    engine = ScriptedEngine(TOK, script) if engine_kind == "no capability" else RecordingSessionEngine(
        TOK, script, decline=True)
    calls = []
    plain_generate = engine.generate

    def generate(prompt_ids, rng_keys, **opts):
        calls.append([list(p) for p in prompt_ids])
        return plain_generate(prompt_ids, rng_keys, **opts)

    engine.generate = generate
    out = run_episodes(engine, [Replies(3)], np.zeros((1, 2), np.uint32), tokenizer=TOK, max_turns=4,
                       max_total_tokens=200, max_turn_tokens=8)
    assert len(calls) == 3
    prompt = TOK.encode(TOK.apply_chat_template([{"role": "user", "content": "go"}]))
    ids = out.completion_ids[0][out.sequence_mask[0]].tolist()
    assert calls[0] == [prompt]
    # Each later call is the whole history: the prompt, every sampled id and every reply so far.
    assert calls[2][0] == prompt + ids[:len(calls[2][0]) - len(prompt)]
    assert len(calls[2][0]) > len(calls[1][0]) > len(prompt)
    assert not getattr(engine, "turns", [])


def test_turn_keys_compile_once_whatever_the_live_count():
    """Episodes leave at different turns, so the live count changes every turn; the turn keys are
    computed for all N episodes and indexed, so no turn compiles a new program for its count (they
    did, one per count: 125 compiles in 100 demo steps), and the keys are the per-episode ones."""
    from rlbolt.agents.rollout import _turn_keys

    n = 12
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(5), n)), np.uint32)
    live = np.array([0, 3, 4, 9])
    np.testing.assert_array_equal(_turn_keys(keys, 2)[live], _turn_keys(keys[live], 2))  # the same keys

    def run(turns_per_episode):
        engine = ScriptedEngine(TOK, lambda history, key: "ok")
        envs = [Replies(t) for t in turns_per_episode]
        return run_episodes(engine, envs, keys, tokenizer=TOK, max_turns=4, max_turn_tokens=3, max_total_tokens=2000)

    run([1, 2, 3, 4] * 3)  # warm-up: every turn's key program for N = 12
    compiles = []
    listener = lambda event, *a, **k: compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        batch = run([4, 1, 1, 2, 3, 1, 4, 2, 2, 1, 3, 4])  # live counts 12, 8, 5, 3: new counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert batch.turns.tolist() == [4, 1, 1, 2, 3, 1, 4, 2, 2, 1, 3, 4]
    assert compiles == []
