import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlbolt.plan import BatchPlan, PlanError


def test_derived_sizes():
    p = BatchPlan(prompts_per_step=8, num_generations=4, mini_batch_size=16, train_micro_batch_size=4,
                  logps_micro_batch_size=8, rollout_micro_batch_size=32, num_iterations=2)
    assert p.global_batch_size == 32
    assert p.updates_per_iteration == 2 and p.updates_per_step == 4
    assert p.grad_accum_steps == 4
    assert p.service_batch_size == 32


def test_defaults_mean_one_update_no_accumulation():
    p = BatchPlan(prompts_per_step=3, num_generations=5)
    assert (p.mini_batch_size, p.train_micro_batch_size, p.logps_micro_batch_size, p.rollout_micro_batch_size) == (15, 15, 15, 15)
    assert p.updates_per_step == 1 and p.grad_accum_steps == 1


def test_message_names_fields_and_suggests_nearest():
    with pytest.raises(PlanError) as e:
        BatchPlan(prompts_per_step=6, num_generations=4, mini_batch_size=16)
    assert "prompts_per_step=6 x num_generations=4 = 24 samples is not divisible by mini_batch_size=16; use 8, 12 or 24" in str(e.value)


def test_all_problems_reported_at_once():
    with pytest.raises(PlanError) as e:
        BatchPlan(prompts_per_step=6, num_generations=4, mini_batch_size=12, train_micro_batch_size=5, rollout_micro_batch_size=7)
    msg = str(e.value)
    assert "train_micro_batch_size=5" in msg and "rollout_micro_batch_size=7" in msg


def test_reward_micro_size_defaults_to_the_global_batch_and_must_divide_it():
    assert BatchPlan(prompts_per_step=6, num_generations=4).reward_micro_batch_size == 24
    with pytest.raises(PlanError, match="not divisible by reward_micro_batch_size=5; use 3, 4 or 6"):
        BatchPlan(prompts_per_step=6, num_generations=4, reward_micro_batch_size=5)


def test_whole_groups_rule():
    with pytest.raises(PlanError, match=r"train_micro_batch_size=2 splits groups of num_generations=4.*stage 'train'.*4, 8 or 12"):
        BatchPlan(prompts_per_step=6, num_generations=4, train_micro_batch_size=2, whole_groups=("train",))
    BatchPlan(prompts_per_step=6, num_generations=4, train_micro_batch_size=2)  # fine when no group stat there


@pytest.mark.parametrize("field,value,match", [
    ("num_generations", 0, "num_generations=0 must be >= 1"),
    ("num_iterations", 1.5, "num_iterations=1.5 must be an integer"),
    ("whole_groups", ("decode",), "unknown stage"),
])
def test_bad_values(field, value, match):
    with pytest.raises(PlanError, match=match):
        BatchPlan(**{"prompts_per_step": 2, "num_generations": 2, field: value})


def test_service_batch_is_lcm_of_stage_micros():
    p = BatchPlan(prompts_per_step=6, num_generations=2, rollout_micro_batch_size=4, logps_micro_batch_size=6, train_micro_batch_size=3)
    assert p.service_batch_size == 12


@st.composite
def valid_plans(draw):
    prompts, gen = draw(st.integers(1, 12)), draw(st.integers(1, 8))
    g = prompts * gen
    divisors = [d for d in range(1, g + 1) if g % d == 0]
    mini = draw(st.sampled_from(divisors))
    train = draw(st.sampled_from([d for d in divisors if mini % d == 0]))
    rollout = draw(st.sampled_from(divisors))
    logps = draw(st.sampled_from([d for d in divisors if g % math.lcm(rollout, d, train) == 0]))
    return dict(prompts_per_step=prompts, num_generations=gen, mini_batch_size=mini, train_micro_batch_size=train,
                logps_micro_batch_size=logps, rollout_micro_batch_size=rollout, num_iterations=draw(st.integers(1, 4)))


@settings(max_examples=200, deadline=None)
@given(valid_plans())
def test_valid_plans_derive_consistent_sizes(kwargs):
    p = BatchPlan(**kwargs)
    assert p.updates_per_step * p.mini_batch_size == p.num_iterations * p.global_batch_size
    assert p.grad_accum_steps * p.train_micro_batch_size == p.mini_batch_size
    assert p.global_batch_size % p.service_batch_size == 0
    for micro in (p.rollout_micro_batch_size, p.logps_micro_batch_size, p.train_micro_batch_size):
        assert p.service_batch_size % micro == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.integers(1, 8), st.integers(1, 100))
def test_invalid_mini_is_refused_and_every_suggestion_is_valid(prompts, gen, mini):
    g = prompts * gen
    if g % mini == 0:
        assert BatchPlan(prompts_per_step=prompts, num_generations=gen, mini_batch_size=mini).updates_per_iteration == g // mini
        return
    with pytest.raises(PlanError) as e:
        BatchPlan(prompts_per_step=prompts, num_generations=gen, mini_batch_size=mini)
    msg = str(e.value)
    assert f"mini_batch_size={mini}" in msg
    suggested = msg.split("; use ")[1].split("\n")[0].replace(" or ", ", ").split(", ")
    for s in suggested:  # each suggestion fixes the problem
        BatchPlan(prompts_per_step=prompts, num_generations=gen, mini_batch_size=int(s))
