"""Format reward cases and WeightedReward sums, checked by hand."""

import functools
import math
import pickle

import numpy as np
import pytest

from rlbolt.rewards import RewardFn, RewardTermError, WeightedReward, as_weighted, format_reward, make_format_reward


@pytest.mark.parametrize(
    ("completion", "lenient", "strict"),
    [
        ("<think>24 + 48 = 72</think>\n<answer>72</answer>", 1.0, 1.0),
        ("  <think>a</think><answer>b</answer>\n", 1.0, 1.0),
        # Text outside the blocks: checks 1-3 pass, check 4 fails.
        ("Sure! <think>a</think><answer>b</answer>", 0.75, 0.0),
        # Answer before think: blocks fine, order and layout fail.
        ("<answer>b</answer><think>a</think>", 0.5, 0.0),
        # Empty answer: think block, order, and layout pass.
        ("<think>a</think><answer> </answer>", 0.75, 0.0),
        # Empty think block: answer, order, layout pass.
        ("<think></think><answer>7</answer>", 0.75, 0.0),
        # Only an answer block.
        ("<answer>7</answer>", 0.25, 0.0),
        # Two answer blocks: the answer check fails, so order and layout cannot be judged.
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.25, 0.0),
        # Closing tag before opening tag.
        ("</think>a<think><answer>7</answer>", 0.25, 0.0),
        ("plain text", 0.0, 0.0),
    ],
)
def test_format_reward_cases(completion, lenient, strict):
    assert format_reward(completion, {}) == lenient
    assert format_reward(completion, {}, strict=True) == strict


def test_format_reward_custom_tags_and_prefilled_think():
    custom = make_format_reward(think_tag="reasoning", answer_tag="solution", strict=True)
    assert isinstance(custom, RewardFn)
    assert custom("<reasoning>r</reasoning><solution>s</solution>", {}) == 1.0
    assert custom("<think>r</think><answer>s</answer>", {}) == 0.0
    # The chat template opened <think> already: the completion starts inside the block.
    prefilled = make_format_reward(think_prefilled=True)
    assert prefilled("I add them.</think><answer>7</answer>", {}) == 1.0
    assert format_reward("I add them.</think><answer>7</answer>", {}) == 0.25
    with pytest.raises(ValueError, match="think_tag"):
        make_format_reward(think_tag="<think>")
    assert pickle.loads(pickle.dumps(custom))("<reasoning>r</reasoning><solution>s</solution>", {}) == 1.0


def _exact(completion, sample):
    return 1.0 if completion.strip() == sample["answer"] else 0.0


def _length(completion, sample):
    return len(completion) / 10.0


def test_weighted_reward_sums_by_hand():
    reward = WeightedReward([("exact", _exact, 2.0), ("length", _length, -0.5), ("format", format_reward, 1)])
    completion, sample = "<think>x</think><answer>7</answer>", {"answer": "nope"}
    raw = reward.raw_scores(completion, sample)
    assert raw == {"exact": 0.0, "length": 3.4, "format": 1.0}
    assert math.isclose(reward(completion, sample), 2.0 * 0.0 - 0.5 * 3.4 + 1.0 * 1.0)
    assert reward.names == ["exact", "length", "format"]
    assert reward.weights == {"exact": 2.0, "length": -0.5, "format": 1.0}
    # Python float64 sums of a few constants: approx's 1e-6 relative is ~1e10 float64 ulps
    assert reward("7", {"answer": "7"}) == pytest.approx(2.0 - 0.05 + 0.0)
    # Picklable when its functions are, as the process executor needs.
    assert pickle.loads(pickle.dumps(reward))("7", {"answer": "7"}) == pytest.approx(1.95)


def test_weighted_reward_rejects_bad_terms_and_bad_values():
    with pytest.raises(ValueError, match="duplicate"):
        WeightedReward([("a", _exact, 1.0), ("a", _length, 1.0)])
    with pytest.raises(ValueError, match="weight"):
        WeightedReward([("a", _exact, float("nan"))])
    with pytest.raises(ValueError, match="name"):
        WeightedReward([("a b", _exact, 1.0)])
    with pytest.raises(ValueError, match="empty"):
        WeightedReward([])
    with pytest.raises(RewardTermError, match="'nan' returned nan, not a finite number"):
        WeightedReward([("nan", lambda c, s: float("nan"), 1.0)]).raw_scores("", {})
    with pytest.raises(RewardTermError, match="not a number"):
        WeightedReward([("text", lambda c, s: "high", 1.0)]).raw_scores("", {})


@pytest.mark.parametrize("value", ["0.75", b"1", None, [1.0], 1j, np.array([0.5]), float("inf")])
def test_a_reward_that_returns_a_non_number_fails_instead_of_being_converted(value):
    reward = WeightedReward([("parsed", lambda c, s: value, 1.0), ("exact", _exact, 1.0)])
    with pytest.raises(RewardTermError, match="reward 'parsed' returned") as caught:
        reward.raw_scores("x", {"answer": "x"})
    assert caught.value.term == "parsed"


def test_real_numbers_of_any_flavour_are_scores():
    for value, expected in ((True, 1.0), (np.float32(0.25), 0.25), (np.int64(3), 3.0), (np.array(0.5), 0.5), (2, 2.0)):
        assert WeightedReward([("v", lambda c, s, v=value: v, 1.0)]).raw_scores("", {}) == {"v": expected}


def test_a_raising_term_is_named_and_its_exception_chained():
    def broken(completion, sample):
        raise KeyError("answer")

    with pytest.raises(RewardTermError, match="reward 'broken' raised KeyError: 'answer'") as caught:
        WeightedReward([("exact", _exact, 1.0), ("broken", broken, 0.5)]).raw_scores("x", {"answer": "x"})
    assert isinstance(caught.value.__cause__, KeyError)


def test_as_weighted_names_single_functions():
    assert as_weighted(_exact).names == ["exact"]  # leading "_" dropped
    assert as_weighted(format_reward).names == ["format"]
    assert as_weighted(functools.partial(format_reward, strict=True)).names == ["format"]
    assert as_weighted(lambda c, s: 1.0).names == ["lambda"]
