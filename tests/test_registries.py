"""One registry per kind: the entries register where they are defined, the config takes its
choices from them, a user's entry is accepted once its file is imported and refused once gone,
and the ready objectives' settings are the papers' (the table the config used to keep)."""

from __future__ import annotations

import pytest

from rlbolt.config import ConfigError, load_config
from rlbolt.config.registries import objective_names, reward_term_names
from rlbolt.utils.registry import Registry


def test_a_registry_refuses_a_taken_name_and_names_the_closest():
    reg: Registry[int] = Registry("colour", "paint.colour")
    reg.register("red", 1, owner="a.red")
    reg.register("red", 2, owner="a.red")  # the same owner again (a reload) replaces it
    assert reg["red"] == 2 and reg.names() == ("red",)
    with pytest.raises(ValueError, match="colour 'red' is already a.red; register b.red under another name"):
        reg.register("red", 3, owner="b.red")
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("", 4, owner="c")
    with pytest.raises(KeyError, match=r"paint.colour='rde' is not a registered colour \(did you mean 'red'\?\)"):
        reg.get("rde")
    reg.unregister("red")
    assert "red" not in reg and len(reg) == 0


# The papers' settings the config kept in one table before the objectives registered them
# (MiniMax-M1 arXiv 2506.13585; GSPO 2507.18071; SAPO 2511.20347; GMPO 2507.20673; Clip-Cov / KL-Cov 2505.22617).
PAPER_SETTINGS = {
    "ppo": {},
    "gspo": {"loss_aggregation": "seq-mean-token-mean"},
    "cispo": {"clip_low": 1.0, "clip_high": 4.0, "loss_aggregation": "token-mean"},
    "sapo": {"loss_aggregation": "seq-mean-token-mean"},
    "gmpo": {"clip_low": 0.4, "clip_high": 0.4, "loss_aggregation": "seq-mean-token-mean"},
    "clip_cov": {"cov_select_ratio": 2e-4},
    "kl_cov": {"cov_select_ratio": 2e-3},
}


def test_the_ready_objectives_carry_their_papers_settings():
    from rlbolt.algorithms import OBJECTIVES

    assert objective_names() == tuple(PAPER_SETTINGS)
    assert {name: OBJECTIVES[name].fills() for name in OBJECTIVES} == PAPER_SETTINGS
    assert reward_term_names() == ("answer", "format", "digits", "task", "env")


def test_a_registered_reward_term_is_weighed_and_a_removed_one_refused():
    from rlbolt.modules.rewarding import build_reward
    from rlbolt.rewards.terms import REWARD_TERMS, register_reward_term

    @register_reward_term("has-42")
    def has_42(answer_field):
        return lambda completion, row: float("42" in completion)

    try:
        cfg = load_config({"reward": {"weights": {"has-42": 0.5, "digits": 0.25}}})
        reward = build_reward(cfg.reward.weights)
        # by hand: 0.5 * 1 + 0.25 * (2 digits of 4 characters) = 0.625; exact in binary
        assert reward("x42y", {"answer": "1"}) == 0.625
        assert reward("none", {"answer": "1"}) == 0.0
    finally:
        REWARD_TERMS.unregister("has-42")
    with pytest.raises(ConfigError, match=r"reward.weights has unknown term\(s\) \['has-42'\]"):
        load_config({"reward": {"weights": {"has-42": 1.0}}})


def test_the_config_package_imports_no_registry_home():
    """The config reads the registries by name when a value is checked: importing it loads no JAX."""
    import subprocess
    import sys

    code = ("import sys, rlbolt.config; "
            "print(sorted(m for m in ('jax', 'rlbolt.algorithms.objectives') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# The framework's columns as `modules/policy_rollout.py` listed them before each registered itself.
FRAMEWORK_COLUMNS_BEFORE = {
    "group_ids", "policy_version", "sample_keys", "prompt_ids", "prompt_mask", "completion_ids",
    "completion_mask", "sampler_logps", "old_logps", "ref_logps", "rewards", "advantages", "completion_text",
    "old_values", "returns", "importance_weights", "keep_mask", "mini_batch_num_tokens", "mini_batch_num_samples",
    "dock_index", "teacher_logps", "sequence_mask", "prompt_routing", "completion_routing",
}


def test_the_columns_rewards_do_not_see_are_the_registered_ones():
    import numpy as np

    import rlbolt.modules  # noqa: F401 - the writers of the optional columns register on import
    import rlbolt.producer.handoff  # noqa: F401
    from rlbolt.batch import COLUMNS, Batch, register_column, row_fields

    assert set(COLUMNS.names()) == FRAMEWORK_COLUMNS_BEFORE
    n = 2
    batch = Batch({**{c: np.zeros(n) for c in sorted(FRAMEWORK_COLUMNS_BEFORE)}, "question": np.array(["a", "b"]),
                   "env_reward": np.zeros(n), "prompt_index": np.arange(n), "my_values": np.zeros(n)})
    assert row_fields(batch) == ["question", "env_reward", "prompt_index", "my_values"]
    register_column("my_values", "[N]", "float32", "a user module's column", by="user_module")
    try:
        assert row_fields(batch) == ["question", "env_reward", "prompt_index"]  # no longer shown to rewards
        with pytest.raises(ValueError, match="batch column 'my_values' is already user_module"):
            register_column("my_values", "[N]", "float32", "taken", by="another_module")
    finally:
        COLUMNS.unregister("my_values")


def test_an_objective_in_the_objects_module_file_is_registered_before_the_field_is_checked(tmp_path, monkeypatch):
    """The how-to's command-line route: the file `objects.module` names registers the objective."""
    import sys
    import textwrap

    from rlbolt.algorithms import OBJECTIVES
    from rlbolt.config import algorithms

    (tmp_path / "user_objective.py").write_text(textwrap.dedent('''
        from rlbolt.algorithms import clipped_surrogate, objective_inputs, register_objective
        from rlbolt.modules import GRPO

        @register_objective("narrow-clip", defaults={"clip_high": 0.1}, aggregation="token-mean")
        def narrow_clip(logps, batch, algo):
            return clipped_surrogate(logps, *objective_inputs(batch), clip_low=algo.clip_low, clip_high=algo.clip_high)

        class NarrowGRPO(GRPO):
            algorithm_name = "narrow-grpo"
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        algo = load_config({"algorithm": {"policy_loss": "narrow-clip"},
                            "objects": {"module": "user_objective:NarrowGRPO"}}).algorithm
        assert (algo.name, algo.clip_high, algo.loss_aggregation) == ("narrow-grpo", 0.1, "token-mean")
    finally:
        sys.modules.pop("user_objective", None)
        OBJECTIVES.unregister("narrow-clip")
        algorithms._REGISTRY.pop("narrow-grpo", None)
