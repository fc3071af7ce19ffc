"""NativeSession (the KV cache kept across turns) against the full-history path: `generate` over
each episode's whole history with the same keys (HistorySession), on a tiny random model."""

import jax
import numpy as np
import pytest
from flax import nnx

from float_tolerance import decoder_logps_tolerance
from rlbolt.models import Decoder, tiny_config
from rlbolt.rollout import NativeSampler, native_session
from rlbolt.rollout.session_decode import compiled_count
from rlbolt.rollout.sessions import HistorySession



def _logp_tolerance(model) -> float:
    """Both paths compute the same products; only the float32 summation order differs (a history
    prefilled in one pass vs in pieces against the cached prefix): the network's log-prob bound at
    the longest sequence the model holds."""
    return decoder_logps_tolerance(model, model.config.max_position_embeddings)

VOCAB, STOP, PAD = 16, 3, 0
TURN_TOKENS = 6


def _model(**overrides):
    config = tiny_config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=128, **overrides)
    return Decoder(config, rngs=nnx.Rngs(5))


def _sampler(model, temperature, prompt_buckets=(8, 16, 32, 64, 128), **kw):
    return NativeSampler(model, max_new_tokens=TURN_TOKENS, temperature=temperature, stop_token_ids=(STOP,),
                         pad_id=PAD, prompt_buckets=prompt_buckets, **kw)


def _reference(model, temperature, prompts=None):
    """The full-history path: `generate` over whole histories, in one fixed shape (micro batches of 8
    rows, nothing shared, one prompt bucket of 64: the full path samples C ids past a budget, so its
    histories outgrow MAX_TOTAL) so the reference compiles one program."""
    sampler = _sampler(model, temperature, prompt_buckets=(64,), micro_batch_size=8, share_prompts=False)
    return HistorySession(sampler.generate, PROMPTS if prompts is None else prompts)


def _keys(n, seed=0):
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)), np.uint32)


def _turn_keys(keys, turn):
    return np.asarray(jax.vmap(lambda k: jax.random.fold_in(k, turn))(keys), np.uint32)


# Three groups of two episodes: prompts of 1 (nothing to share but the last id), 9 and 21 ids.
RNG = np.random.default_rng(0)
PROMPTS = [p for p in ([7], list(RNG.integers(4, VOCAB, 9)), list(RNG.integers(4, VOCAB, 21))) for _ in range(2)]
# The environment's reply to each episode's turns 0..3: lengths 0 to 12 (two new-id buckets).
DELTAS = [[list(RNG.integers(4, VOCAB, RNG.integers(0, 13))) for _ in range(4)] for _ in PROMPTS]
LEAVE_AT = [4, 1, 3, 4, 2, 4]  # the turn before which each episode leaves (4: plays every turn)
MAX_TOTAL = 30  # some episodes reach it mid-turn (both temperatures)


def _drive(session, keys):
    """Runs the script's turns; returns {(turn, episode): (ids, logps, count)} and the cut episodes."""
    n = len(PROMPTS)
    used, live, results, cut = [0] * n, list(range(n)), {}, set()
    for turn in range(4):
        live = [e for e in live if LEAVE_AT[e] > turn and e not in cut]
        new = {e: DELTAS[e][turn - 1] if turn else [] for e in live}
        live = [e for e in live if used[e] + len(new[e]) < MAX_TOTAL]  # room for one sampled id
        if not live:
            break
        out = session.turn(live, [new[e] for e in live], _turn_keys(keys[live], turn))
        for row, e in enumerate(live):
            count = int(out.completion_mask[row].sum())
            room = MAX_TOTAL - used[e] - len(new[e])
            results[turn, e] = (out.completion_ids[row, :count], out.logps[row, :count], count, room)
            used[e] += len(new[e]) + count
            if count > room:
                cut.add(e)
    return results, cut


def _compare(model, temperature):
    sampler = _sampler(model, temperature)
    keys = _keys(len(PROMPTS), seed=int(temperature * 10))
    session = sampler.open_session(PROMPTS, max_total_tokens=MAX_TOTAL)
    assert session._group == 2  # each group's prompt is prefilled once
    kept, kept_cut = _drive(session, keys)
    full, full_cut = _drive(_reference(model, temperature), keys)
    assert kept.keys() == full.keys() and kept_cut == full_cut
    for key, (ids, logps, count, room) in kept.items():
        f_ids, f_logps, f_count, _ = full[key]
        # The full path always samples up to C ids; the session stops one past the budget.
        assert count == min(f_count, room + 1), key
        np.testing.assert_array_equal(ids, f_ids[:count], err_msg=str(key))
        np.testing.assert_allclose(logps, f_logps[:count], atol=_logp_tolerance(model), rtol=0, err_msg=str(key))
    return kept, kept_cut


def _assert_episodes_vary(kept: dict, cut: bool) -> None:
    turns = {}
    for turn, e in kept:
        turns[e] = turns.get(e, 0) + 1
    assert len(set(turns.values())) >= 3  # episodes finish at different turns
    assert cut  # some episode's budget ran out mid-turn
    counts = [c for (_, _, c, _) in kept.values()]
    assert min(counts) < TURN_TOKENS <= max(counts)  # stop tokens end turns early, others run to C


# Slow tier: the full-attention model (the sliding-window test below runs the same comparison at 1.0 with
# the same episode checks, plus cache growth) and greedy.
@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_kept_cache_samples_what_the_whole_history_samples(temperature):
    _assert_episodes_vary(*_compare(_model(), temperature))


def test_a_kept_cache_matches_on_sliding_window_layers_and_grows_in_steps(monkeypatch):
    monkeypatch.setattr(native_session, "MIN_CACHE_SLOTS", 8)  # caches of 8, 16, then 31 slots
    model = _model(sliding_window=5, layer_types=("sliding_attention", "full_attention"))
    sizes = []
    real_turn = native_session.NativeSession.turn

    def turn(self, *args):
        out = real_turn(self, *args)
        sizes.append(self._state.mask.shape[1])
        return out

    monkeypatch.setattr(native_session.NativeSession, "turn", turn)
    _assert_episodes_vary(*_compare(model, 1.0))
    assert sizes[0] == 8 and sizes[-1] == 31 and sizes == sorted(sizes)  # grown as the episodes got longer


def test_cache_sizes_are_max_total_tokens_and_a_few_halvings():
    assert native_session.cache_sizes(513) == (72, 136, 264, 513)  # ceil(513 / 2^k) rounded up to 8
    assert native_session.cache_sizes(129) == (72, 129)  # 40 and 24 are below the smallest (64)
    assert native_session.cache_sizes(31) == (31,)
    assert native_session.cache_sizes(31, smallest=8) == (8, 16, 31)


def test_turns_compile_nothing_new_once_their_shapes_were_seen():
    sampler = _sampler(_model(), 1.0)
    keys = _keys(4, seed=3)
    prompts = [[5, 6, 7, 8]] * 2 + [[9, 10]] * 2

    def run(turns):
        session = sampler.open_session(prompts, max_total_tokens=60)
        counts = []
        for turn in range(turns):
            session.turn([0, 1, 2, 3], [[] if turn == 0 else [4, 5, 6]] * 4, _turn_keys(keys, turn))
            counts.append(compiled_count())
        session.close()
        return counts

    counts = run(6)
    assert counts[0] >= 2  # open + the turn: compiled at the first turn
    assert counts[1:] == [counts[1]] * 5  # turn 1 may add one bucket (3 new ids + 1); then nothing
    assert run(6) == [counts[-1]] * 6  # a second session of the same shapes compiles nothing


def test_leaving_episodes_shrink_the_cache_and_the_rest_continue():
    model = _model()
    prompts = [[4 + i, 5, 6] for i in range(8)]
    keys = _keys(8, seed=4)
    session = _sampler(model, 1.0).open_session(prompts, max_total_tokens=40)
    full = _reference(model, 1.0, prompts)
    assert session.rows == 8
    for turn, live in enumerate(([0, 1, 2, 3, 4, 5, 6, 7], [1, 3, 6], [6])):
        new = [[] if turn == 0 else [8, 9]] * len(live)
        a = session.turn(live, new, _turn_keys(keys[live], turn))
        b = full.turn(live, new, _turn_keys(keys[live], turn))
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_allclose(a.logps, b.logps, rtol=0, atol=_logp_tolerance(model))
    assert session.rows == 2  # 8 -> 4 -> 2: the smallest of B, B/2, B/4 that holds the live ones


def test_bad_turns_are_refused_in_one_line():
    # The session shapes of test_turns_compile_nothing_new_once_their_shapes_were_seen: compiled already.
    sampler = _sampler(_model(), 1.0)
    session = sampler.open_session([[5, 6, 7, 8]] * 2 + [[9, 10]] * 2, max_total_tokens=60)
    keys = _keys(4, seed=3)
    with pytest.raises(ValueError, match="ascending"):
        session.turn([1, 0, 2, 3], [[]] * 4, keys)
    with pytest.raises(ValueError, match="new_ids rows"):
        session.turn([0, 1, 2, 3], [[]], keys)
    with pytest.raises(ValueError, match="rng_keys"):
        session.turn([0, 1, 2, 3], [[]] * 4, keys[:1])
    with pytest.raises(ValueError, match="vocab_size"):
        session.turn([0, 1, 2, 3], [[VOCAB], [], [], []], keys)
    with pytest.raises(ValueError, match="max_total_tokens=60"):
        session.turn([0, 1, 2, 3], [[4] * 61, [], [], []], keys)
    session.turn([1, 2, 3], [[]] * 3, keys[1:])  # episode 0 leaves
    with pytest.raises(ValueError, match="left the session"):
        session.turn([0, 1], [[], []], keys[:2])
    with pytest.raises(ValueError, match="max_total_tokens=0"):
        sampler.open_session([[4]], max_total_tokens=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        sampler.open_session([[4]], max_total_tokens=128)
    with pytest.raises(TypeError, match="unknown options"):
        sampler.open_session([[4]], max_total_tokens=8, beam=2)


def test_the_sampler_declines_a_session_where_it_cannot_keep_caches():
    # Recording MoE routing: the caller falls back to whole histories (HistorySession).
    moe = tiny_config(vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    sampler = NativeSampler(Decoder(moe, rngs=nnx.Rngs(0)), max_new_tokens=2, record_routing=True)
    assert sampler.open_session([[4, 5]], max_total_tokens=8) is None
