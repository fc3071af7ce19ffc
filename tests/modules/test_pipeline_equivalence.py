"""GRPO with the real tiny model through the producer pipeline equals the sequential reference
bit for bit: a reference forward for the KL (beta > 0), an old-logps forward (two iterations),
rollout and logps micro sizes that differ, and the reward stage (LMPolicyModule.on_reward)."""

import jax
import pytest
from module_helpers import G, TINY, module_config, tiny_model
from sequential_producer import assert_same_fit, fit_both

from rlbolt.data import gsm8k_style_rows
from rlbolt.modules import GRPO
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer


@pytest.mark.slow  # ~45 s of compiling on the 2-core box; the toy settings in tests/core run by default
def test_grpo_through_the_pipeline_equals_the_sequential_reference(tokenizer, monkeypatch):
    cfg = module_config("grpo", lr=1e-3, beta=0.04)
    cfg["model"] = {"tiny": TINY}
    # a fresh model per fit: the sampler writes the weights it rolls out with into its model
    make_module = lambda: GRPO(cfg, model=tiny_model(tokenizer), tokenizer=tokenizer)
    plan = BatchPlan(prompts_per_step=2, num_generations=G, mini_batch_size=4, rollout_micro_batch_size=4,
                     logps_micro_batch_size=8, num_iterations=2)
    make_trainer = lambda callbacks: Trainer(plan, max_steps=2, seed=5, shuffle=False, callbacks=callbacks)
    run, reference = fit_both(make_trainer, make_module, gsm8k_style_rows(16), monkeypatch)
    assert_same_fit(run, reference, lambda state: jax.tree.leaves(state.params))
    _, steps = run
    assert any(m["kl"] != 0 for m, _ in steps)  # the reference forward ran (the KL moved off zero)
