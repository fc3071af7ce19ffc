"""The demo tasks' environments, scored by hand, and (slow) a tiny model learning each from scratch."""

import numpy as np
import pytest

from rlbolt.demo.agent_tasks import GuessEnvironment, demo_tokenizer, guess_env, guess_rows, lookup_env, lookup_rows


def _play(env, turns):
    env.reset()
    results = [env.step(t) for t in turns]
    return results, sum(r.reward for r in results)


def test_lookup_rewards_by_hand():
    row = {"prompt": "3", "key": "3", "table": "5555755555"}  # the value under key 3 is "5", under key 4 "7"
    right, total = _play(lookup_env(row), ["?3", "5"])
    assert right[0].messages[0]["content"] == "5" and not right[0].done and right[1].done and total == 1.0
    assert _play(lookup_env(row), ["?3", "4"])[1] == pytest.approx(0.3)
    assert _play(lookup_env(row), ["?4", "7"])[1] == pytest.approx(0.1)  # right value of the wrong key
    assert _play(lookup_env(row), ["5"])[1] == 0.0  # a right answer without the lookup earns nothing
    bad, total = _play(lookup_env(row), ["?x", "?", "5"])
    assert [m["content"] for r in bad[:2] for m in r.messages] == ["!", "!"]
    assert [r.tool_errors for r in bad] == [1, 1, 0] and total == 0.0


def test_guess_feedback_and_rewards_by_hand():
    results, total = _play(GuessEnvironment(secret=5, num_values=8, max_turns=4), ["3", "7", "x", "5"])
    assert [r.messages[0]["content"] for r in results[:3]] == [">", "<", "!"]
    assert results[3].done and total == pytest.approx(1.0)
    _, missed = _play(GuessEnvironment(secret=5, num_values=8, max_turns=4), ["3", "9", "x", "0"])
    assert missed == pytest.approx(0.1 * 2 / 4)  # two well-formed guesses ("9" is out of range)
    assert guess_env({"secret": 2, "num_values": 4}).step("2").done


def test_rows_are_seeded_and_checked():
    assert lookup_rows(5, seed=1) == lookup_rows(5, seed=1) != lookup_rows(5, seed=2)
    assert all(len(r["table"]) == 10 and r["prompt"] == r["key"] for r in lookup_rows(20))
    assert {r["secret"] for r in guess_rows(200, num_values=8)} == set(range(8))
    with pytest.raises(ValueError, match="num_values=11"):
        guess_rows(3, num_values=11)
    tok = demo_tokenizer()
    assert tok.decode(tok.encode("?3\n<>!")) == "?3\n<>!"
    # a turn's text drops the stop token only: a sampled pad or bos makes the turn malformed
    four = tok.encode("4")[0]
    assert tok.decode([four, tok.eos_id]) == "4" and tok.decode([tok.pad_id, four]) == "<pad>4"
    assert not guess_env({"secret": 4}).step(tok.decode([tok.bos_id, four])).done


@pytest.mark.slow
@pytest.mark.parametrize("task", ["tool", "guess"])
def test_a_tiny_model_learns_the_task_from_scratch(task, tmp_path):
    from rlbolt.demo.episodes import train_demo

    rewards = train_demo(task, run_dir=str(tmp_path))  # the task's steps: 600 (tool and guess)
    assert np.mean(rewards[:5]) < 0.1
    assert np.mean(rewards[-20:]) >= 0.9
