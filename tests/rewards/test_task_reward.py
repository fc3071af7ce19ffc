"""reasoning_gym_reward: the task's scorer on the extracted final answer; the substring exploit closed.

The rows are written by hand (the gold answers are computed here), so the tests do not depend
on what reasoning-gym generates; only its scorers are used.
"""

import functools
import pickle

import pytest

pytest.importorskip("reasoning_gym")
import reasoning_gym  # noqa: E402

from rlbolt.rewards.runner import RewardRunner  # noqa: E402
from rlbolt.rewards.task_reward import extract_task_answer, reasoning_gym_reward  # noqa: E402

SUM = {"question": "State the final answer to the following arithmetic problem: 57 + 87 + 70 =", "answer": "214",
       "task": "chain_sum", "task_options": {"min_terms": 2, "max_terms": 6},
       "metadata": {"expression": "57 + 87 + 70"}}
NEG = dict(SUM, question="... 205 - 838 + 505 =", answer="-128")
SPELL = {"question": "Spell this word backward (example: sun -> nus): canroyer", "answer": "reyornac",
         "task": "spell_backward", "task_options": {}, "metadata": {"word": "canroyer"}}


def raw_score(row, text):
    return reasoning_gym.create_dataset(row["task"], seed=0, size=1, **row["task_options"]).score_answer(
        text, {"question": row["question"], "answer": row["answer"], "metadata": row["metadata"]})


@pytest.mark.parametrize("completion", [
    "57 + 87 = 144, 144 + 70 = 214", "The answer is 214.", "<think>57+87=144</think><answer>214</answer>",
    "so \\boxed{214}", "#### 214", "<answer> 214 </answer>", "The total is 214 apples",
])
def test_right_answers_score_one(completion):
    assert reasoning_gym_reward(completion, SUM) == 1.0


def test_negative_answer_and_wrong_answers():
    assert reasoning_gym_reward("205 - 838 = -633, -633 + 505 = -128", NEG) == 1.0
    assert reasoning_gym_reward("The answer is 128", NEG) == 0.0
    assert reasoning_gym_reward("<answer>213</answer>", SUM) == 0.0


@pytest.mark.parametrize("completion", [
    "1 2 214 9 10 11",               # the gold among other numbers: the raw scorer pays len(gold)/len(text)
    "<answer>214 215</answer>",      # hedging inside the tag
    "2140",                          # the gold as a substring of one number
    "The answer is 2140",
    "<answer>214, 213, 212</answer>",
])
def test_substring_exploit_is_closed(completion):
    assert raw_score(SUM, completion) > 0.0  # the exploit exists in the task's own scorer
    assert reasoning_gym_reward(completion, SUM) == 0.0


def test_text_tasks_use_the_tag_or_the_last_line_and_keep_task_partial_credit():
    assert reasoning_gym_reward("<answer>reyornac</answer>", SPELL) == 1.0
    assert reasoning_gym_reward("Reversed, the word reads:\nreyornac", SPELL) == 1.0
    for exploit in ("<answer>reyornac canroyer</answer>", "<answer>REYORNACXYZ</answer>"):
        # Python float64 ratios of small integers: approx's 1e-6 relative is ~1e10 float64 ulps
        assert raw_score(SPELL, exploit.removeprefix("<answer>").removesuffix("</answer>")) == pytest.approx(0.8)  # a prefix earns 0.8
        assert reasoning_gym_reward(exploit, SPELL) == 0.0
    assert reasoning_gym_reward("<answer>Reyornac</answer>", SPELL) == 1.0  # the task ignores case
    near = "<answer>reyornax</answer>"  # spell_backward's own per-character credit: 7 of 8 right
    assert reasoning_gym_reward(near, SPELL) == pytest.approx(raw_score(SPELL, "reyornax")) == pytest.approx(7 / 8)
    assert reasoning_gym_reward(near, SPELL, binary=True) == 0.0


def test_extraction_modes_and_hostile_completions():
    assert extract_task_answer("no tag, answer 214", "214", "answer_tag") is None
    assert reasoning_gym_reward("answer 214", SUM, extract="answer_tag") == 0.0
    assert reasoning_gym_reward("<answer>214</answer>", SUM, extract="answer_tag") == 1.0
    assert extract_task_answer("first 3, then 7 and x", "abc", "last_number") == "7"
    assert extract_task_answer("first 3, then 7 and x", "abc", "auto") == "first 3, then 7 and x"
    for hostile in ("", "   \n\n", "<answer></answer>", "no numbers at all", "\x00" * 50, "9" * 5000):
        assert reasoning_gym_reward(hostile, SUM) == 0.0
    with pytest.raises(ValueError, match="extract='first'"):
        reasoning_gym_reward("214", SUM, extract="first")
    with pytest.raises(KeyError, match=r"no field\(s\) \['task'\]"):
        reasoning_gym_reward("214", {"answer": "214"})


def test_reward_pickles_and_runs_in_worker_processes():
    reward = functools.partial(reasoning_gym_reward, extract="auto")
    assert pickle.loads(pickle.dumps(reward))("The answer is 214", SUM) == 1.0
    texts = ["<answer>214</answer>", "1 2 214 9", "<answer>reyornac</answer>", "<answer>reyornax</answer>"]
    with RewardRunner(reward, executor="process", max_workers=2, timeout_s=60) as runner:
        result = runner.score(texts, [SUM, SUM, SPELL, SPELL])
    assert runner.executor == "process"
    assert list(result.rewards) == pytest.approx([1.0, 0.0, 1.0, 7 / 8])
