"""What fit refuses before anything is built: silent no-learning set-ups (rlbolt.fit_checks)."""

from __future__ import annotations

import numpy as np
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.algorithms import grpo_advantages, reinforcepp_advantages
from rlbolt.callbacks import EarlyStopping
from rlbolt.config import algorithm_class, algorithm_names
from rlbolt.plan import BatchPlan, PlanError
from rlbolt.trainer import Trainer

# By the papers' formulas (checked by hand below for GRPO and REINFORCE++): an advantage taken
# relative to the sample's own group is 0 when the group holds one sample; REINFORCE++ whitens
# over the whole batch and PPO uses a learned value baseline, so both still learn with G = 1.
GROUP_RELATIVE = {"grpo", "dapo", "drgrpo", "rloo", "gspo"}


def test_the_reference_split_by_hand():
    rewards, singletons = np.array([0.0, 1.0, 0.25]), np.arange(3)
    assert not np.any(np.asarray(grpo_advantages(rewards, singletons)))
    returns = np.asarray(reinforcepp_advantages(rewards, np.ones((3, 1), bool)))[:, 0]
    # float32 whitening of a few rewards against float64: < 20 ulps of each value, rtol=1e-5 is 84
    np.testing.assert_allclose(returns, (rewards - rewards.mean()) / (rewards.std() + 1e-8), rtol=1e-5)


@pytest.mark.parametrize("name", sorted(algorithm_names()))
def test_groups_of_one_refused_exactly_for_group_relative_algorithms(name):
    module = algorithm_class(name)()
    if name in GROUP_RELATIVE:
        with pytest.raises(PlanError, match=r"num_generations=1 .*every advantage is 0.*num_generations >= 2"):
            module.check_plan(BatchPlan(prompts_per_step=4, num_generations=1))
    else:
        module.check_plan(BatchPlan(prompts_per_step=4, num_generations=1))
    module.check_plan(BatchPlan(prompts_per_step=4, num_generations=2))  # two samples: fine for all


class _Recorder(ToyModule):
    """Fails the test if fit got as far as building anything."""

    def setup(self, trainer):
        raise AssertionError("setup ran although fit should have refused first")


class _GroupRelative(_Recorder):
    def check_plan(self, plan):
        if plan.num_generations < 2:
            raise PlanError("num_generations=1: nothing learns")


@pytest.mark.parametrize("kwargs, data, val, match", [
    ({}, 3, None, r"3 prompt\(s\), fewer than prompts_per_step=4"),  # a step would repeat prompts
    ({"max_steps": 5}, 3, None, r"fewer than prompts_per_step=4"),  # max_steps no longer hides it
    ({"val_every_n_steps": 2}, 16, None, r"val_every_n_steps=2 but fit got no val_data"),
    ({"val_at_start": True}, 16, None, r"val_at_start=True but fit got no val_data"),
    ({}, 16, [], r"val_data is empty"),
    # EarlyStopping on a validation metric that fit would never produce mid-run
    ({"callbacks": [EarlyStopping("val/accuracy")]}, 16, None,
     r"EarlyStopping\(monitor='val/accuracy'\).*pass val_data=\.\.\. and val_every_n_steps"),
    ({"callbacks": [EarlyStopping("val/accuracy")]}, 16, prompt_rows(2),
     r"pass val_every_n_steps \(fit validates only after the last step\)"),
])
def test_fit_refuses_before_setup(kwargs, data, val, match):
    trainer = Trainer(BatchPlan(prompts_per_step=4, num_generations=4), **{"max_epochs": 1, **kwargs})
    with pytest.raises(ValueError, match=match):
        trainer.fit(_Recorder(), prompt_rows(data), val)


def test_fit_asks_the_module_about_the_plan_before_setup():
    with pytest.raises(PlanError, match="nothing learns"):
        Trainer(BatchPlan(prompts_per_step=4, num_generations=1), max_steps=1).fit(_GroupRelative(), prompt_rows(8))


def test_early_stopping_on_a_step_metric_or_with_periodic_validation_is_accepted():
    """The check refuses only what could never fire: a step metric needs no validation."""
    from rlbolt.fit_checks import check_fit

    plan = BatchPlan(prompts_per_step=4, num_generations=4)
    rows = prompt_rows(16)
    assert check_fit(plan, _Recorder(), rows, None, callbacks=[EarlyStopping("reward/mean")]) == plan
    assert check_fit(plan, _Recorder(), rows, prompt_rows(2), val_every_n_steps=2,
                     callbacks=[EarlyStopping("val/accuracy")]) == plan
