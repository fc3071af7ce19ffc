"""Config loading: YAML + dotted overrides, validation messages, algorithm defaults, round trip."""

import dataclasses

import pytest
import yaml

from rlbolt.config import (
    algorithm_names,
    ConfigError,
    RunConfig,
    config_to_dict,
    describe_fields,
    load_config,
    save_config,
)


def test_defaults_resolve_to_grpo_paper_settings():
    cfg = load_config()
    assert cfg.algorithm.name == "grpo"
    assert cfg.algorithm.loss_aggregation == "seq-mean-token-mean"
    assert (cfg.algorithm.clip_low, cfg.algorithm.clip_high) == (0.2, 0.2)
    assert cfg.algorithm.dynamic_sampling is False
    assert cfg.plan.max_refill_rounds == 0
    assert cfg.algorithm.overlong_cache_length == 0


def test_yaml_file_and_overrides_apply_in_order(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("plan:\n  prompts_per_step: 2\ntrainer:\n  max_steps: 5\nalgorithm:\n  name: dapo\n")
    cfg = load_config(path, ["trainer.max_steps=7", "algorithm.beta=0.04", "model.path=/local/qwen",
                             "callbacks.metrics=[jsonl]", "trainer.val_every_n_steps=null"])
    assert cfg.plan.prompts_per_step == 2
    assert cfg.trainer.max_steps == 7
    assert cfg.algorithm.beta == 0.04 and isinstance(cfg.algorithm.beta, float)
    assert cfg.model.path == "/local/qwen"
    assert cfg.callbacks.metrics == ("jsonl",)
    # DAPO's own defaults fill the None fields: clip-higher, token-mean, dynamic sampling with refills.
    assert cfg.algorithm.clip_high == 0.28 and cfg.algorithm.clip_low == 0.2
    assert cfg.algorithm.loss_aggregation == "token-mean"
    assert cfg.algorithm.dynamic_sampling is True and cfg.plan.max_refill_rounds == 4
    assert cfg.algorithm.overlong_cache_length == cfg.rollout.max_new_tokens // 4


def test_explicit_values_beat_algorithm_defaults():
    cfg = load_config({"algorithm": {"name": "gspo", "clip_high": 0.5}}, ["algorithm.loss_aggregation=token_mean"])
    assert cfg.algorithm.clip_low == 3e-4 and cfg.algorithm.clip_high == 0.5
    assert cfg.algorithm.loss_aggregation == "token-mean"


def test_int_is_accepted_for_float_and_comma_list_for_tuple():
    cfg = load_config(None, ["algorithm.lr=1", "callbacks.metrics=console,jsonl"])
    assert cfg.algorithm.lr == 1.0 and isinstance(cfg.algorithm.lr, float)
    assert cfg.callbacks.metrics == ("console", "jsonl")


def test_numbers_as_people_type_them(tmp_path):
    # YAML 1.1 reads 1e-4 (no dot) as a string; the config reads it as the number it obviously is,
    # from the command line and from a file alike.
    cfg = load_config(None, ["algorithm.lr=1e-4", "algorithm.weight_decay=+2E-3", "trainer.max_steps=1e3",
                             "algorithm.max_grad_norm=1_000.5"])
    assert cfg.algorithm.lr == 1e-4 and cfg.algorithm.weight_decay == 2e-3 and cfg.algorithm.max_grad_norm == 1000.5
    assert cfg.trainer.max_steps == 1000 and isinstance(cfg.trainer.max_steps, int)
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  lr: 5e-6\n")
    assert load_config(path).algorithm.lr == 5e-6
    with pytest.raises(ConfigError, match=r"trainer.max_steps=1.5 has type float; expected int"):
        load_config(None, ["trainer.max_steps=1.5"])
    with pytest.raises(ConfigError, match="has type str"):
        load_config(None, ["algorithm.lr=1e-4x"])  # not a number: still named
    for bad in (".nan", ".inf", "-.inf"):
        with pytest.raises(ConfigError, match=r"algorithm.lr=.* is not a finite number"):
            load_config(None, [f"algorithm.lr={bad}"])


def test_ranges_are_checked_when_read_and_listed():
    for override, message in [("trainer.max_steps=0", r"trainer.max_steps=0 must be >= 1 \(or null\)"),
                              ("algorithm.lr=0", r"algorithm.lr=0.0 must be > 0"),
                              ("rollout.top_p=1.5", r"rollout.top_p=1.5 must be <= 1"),
                              ("algorithm.gamma=-0.1", r"algorithm.gamma=-0.1 must be >= 0"),
                              ("plan.max_refill_rounds=-1", r"plan.max_refill_rounds=-1 must be >= 0")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [override])
    assert "trainer.max_steps = None: global steps to run; None: until max_epochs (>= 1)" in describe_fields()


def test_unknown_key_names_it_suggests_and_lists_allowed():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.max_step=3"])
    msg = str(err.value)
    assert "trainer.max_step" in msg and "'max_steps'" in msg and "allowed keys" in msg and "max_epochs" in msg


def test_unknown_section_suggests_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainr:\n  max_steps: 1\n")
    with pytest.raises(ConfigError, match=r"unknown section 'trainr'.*did you mean 'trainer'"):
        load_config(path)


def test_wrong_type_names_field_value_and_expected_type():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["plan.prompts_per_step=four"])
    msg = str(err.value)
    assert "plan.prompts_per_step='four'" in msg and "expected int" in msg
    with pytest.raises(ConfigError, match="expected bool"):
        load_config({"data": {"shuffle": "yes please"}})
    with pytest.raises(ConfigError, match=r"trainer.seed=null is not allowed; expected int"):
        load_config(None, ["trainer.seed=null"])


def test_enum_fields_list_allowed_values():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["algorithm.name=grpoo"])
    msg = str(err.value)
    for name in algorithm_names():
        assert name in msg
    assert "did you mean 'grpo'" in msg
    with pytest.raises(ConfigError, match="k1"):
        load_config(None, ["algorithm.kl_kind=k4"])
    with pytest.raises(ConfigError, match="unknown writer"):
        load_config(None, ["callbacks.metrics=[console, slack]"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["max_steps"])
    with pytest.raises(ConfigError, match="section.key"):
        load_config(None, ["max_steps=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="overlong_cache_length"):
        load_config(None, ["rollout.max_new_tokens=8", "algorithm.overlong_cache_length=9"])
    with pytest.raises(ConfigError, match="dual_clip"):
        load_config(None, ["algorithm.dual_clip=0.5"])
    with pytest.raises(ConfigError, match="reward.weights"):
        load_config(None, ["reward.weights={length: 1.0}"])
    with pytest.raises(ConfigError, match="non-zero weight"):
        load_config(None, ["reward.weights={answer: 0, format: 0}"])
    with pytest.raises(ConfigError, match=r"trainer.mode=async needs trainer.max_staleness >= 3 \(got None\)"):
        load_config(None, ["trainer.mode=async", "plan.mini_batch_size=8"])  # 2 updates per step
    with pytest.raises(ConfigError, match=r"trainer.max_staleness=2 is only used with trainer.mode=async"):
        load_config(None, ["trainer.max_staleness=2"])
    with pytest.raises(ConfigError, match=r"trainer.val_every_n_steps=5 but the run has no validation rows"):
        load_config(None, ["trainer.val_every_n_steps=5"])
    assert load_config(None, ["trainer.val_every_n_steps=5", "data.builtin_val_rows=4"]).trainer.val_every_n_steps == 5
    with pytest.raises(ConfigError, match=r"trainer.val_at_start=true but the run has no validation rows"):
        load_config(None, ["trainer.val_at_start=true"])
    assert load_config(None, ["trainer.val_at_start=true", "data.builtin_val_rows=4"]).trainer.val_at_start is True
    # Settings that would silently do nothing:
    with pytest.raises(ConfigError, match=r"early_stopping_metric=val/accuracy .* validates never"):
        load_config(None, ["callbacks.early_stopping_metric=val/accuracy"])
    with pytest.raises(ConfigError, match=r"validates only after the last step; set trainer.val_every_n_steps"):
        load_config(None, ["callbacks.early_stopping_metric=val/accuracy", "data.builtin_val_rows=2"])
    assert load_config(None, ["callbacks.early_stopping_metric=reward/mean"]).callbacks.early_stopping_metric
    with pytest.raises(ConfigError, match=r"plan.max_refill_rounds=0 cannot refill"):
        load_config(None, ["algorithm.name=dapo", "plan.max_refill_rounds=0"])


def test_save_then_load_round_trips_the_resolved_config(tmp_path):
    cfg = load_config(None, ["algorithm.name=drgrpo", "model.tiny={hidden_size: 32}", "callbacks.metrics=[jsonl]"])
    path = save_config(cfg, tmp_path / "sub" / "config.yaml")
    written = yaml.safe_load(path.read_text())
    assert written["algorithm"]["loss_aggregation"] == "seq-mean-token-sum-norm"
    assert written["callbacks"]["metrics"] == ["jsonl"]
    assert load_config(path) == cfg
    assert set(config_to_dict(cfg)) == {f.name for f in dataclasses.fields(RunConfig)}


def test_every_field_has_help_text():
    text = describe_fields()
    for section in dataclasses.fields(RunConfig):
        for f in dataclasses.fields(section.default_factory):
            assert f.metadata.get("help"), f"{section.name}.{f.name} has no help"
            assert f"{section.name}.{f.name} =" in text


def test_callbacks_section_builds_the_configured_callbacks(tmp_path):
    from rlbolt import callbacks as cb
    from rlbolt.app.build import build_callbacks
    from rlbolt.config import load_config

    cfg = load_config(None, ["callbacks.checkpoint_every_n_steps=5", "callbacks.offload=true",
                             "callbacks.early_stopping_metric=val/accuracy", "callbacks.progress=false",
                             "data.builtin_val_rows=2", "trainer.val_every_n_steps=5"])
    kinds = [type(c) for c in build_callbacks(cfg, tmp_path)]
    assert kinds == [cb.NaNGuard, cb.LearningRateMonitor, cb.Throughput, cb.CPUOffload, cb.ModelCheckpoint,
                     cb.MetricsLogger, cb.TimelineLogger, cb.EarlyStopping]
    plain = load_config(None, ["callbacks.nan_guard=false", "callbacks.lr_monitor=false", "callbacks.throughput=false",
                               "callbacks.metrics=[]", "callbacks.progress=false", "callbacks.timeline=false"])
    kept = build_callbacks(plain, tmp_path)  # `rlbolt fit` checkpoints by default: only the last step
    assert [type(c) for c in kept] == [cb.ModelCheckpoint] and kept[0].every_n_steps is None
    assert kept[0].config == config_to_dict(plain)  # the config a resume is compared with
    assert build_callbacks(load_config(None, ["callbacks.checkpoint=false", "callbacks.nan_guard=false",
                                              "callbacks.lr_monitor=false", "callbacks.throughput=false",
                                              "callbacks.metrics=[]", "callbacks.progress=false",
                                              "callbacks.timeline=false"]), tmp_path) == []


def test_trainer_placement_is_checked_when_the_config_is_read():
    from rlbolt.config import ConfigError, load_config

    assert load_config(None, []).trainer.placement == "colocated"
    cfg = load_config(None, ['trainer.placement={train: {devices: [0, 1]}, rollout: {devices: [1, 2]}}'])
    assert cfg.trainer.placement == {"train": {"devices": [0, 1]}, "rollout": {"devices": [1, 2]}}
    with pytest.raises(ConfigError, match=r"^trainer.placement has unknown role\(s\) \['critic'\]"):
        load_config(None, ['trainer.placement={train: {devices: [0, 1]}, rollout: {devices: [1, 2]}, '
                           'critic: {devices: [2, 3]}}'])
    with pytest.raises(ConfigError, match="trainer.placement='split': use 'colocated'"):
        load_config(None, ["trainer.placement=split"])
