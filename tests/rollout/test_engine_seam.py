"""The rollout-engine seam: a ready module samples only through the RolloutEngine protocol, with
the real policy version of its weights, from the engine its config or its `engine=` argument
names; native through the seam is the old path bit for bit; rollout correction is wired."""

from __future__ import annotations

import re
from pathlib import Path

import engine_fakes
import jax
import numpy as np
import pytest

from rlbolt.callback import Callback
from rlbolt.config import ConfigError, load_config
from rlbolt.data import gsm8k_style_rows
from rlbolt.modules import GRPO
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)


def _config(**sections):
    config = {"model": {"tiny": TINY}, "rollout": {"max_new_tokens": 6}, "algorithm": {"lr": 1e-2},
              "reward": {"executor": "thread", "weights": {"digits": 1.0}}}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


class Metrics(Callback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, trainer, info):
        self.seen.append(dict(info.metrics))


def _fit(module, steps=3, **trainer):
    metrics = Metrics()
    state = Trainer(BatchPlan(2, 2), max_steps=steps, seed=3, callbacks=[metrics], **trainer).fit(
        module, gsm8k_style_rows(8))
    return state, metrics.seen


@pytest.fixture(autouse=True)
def _clear_calls():
    engine_fakes.CALLS.clear()


def test_the_engine_gets_each_steps_policy_version_through_the_protocol():
    _fit(GRPO(_config(), engine=engine_fakes.recording_engine))
    pushes = [v for call, v in engine_fakes.CALLS if call == "update_weights"]
    assert pushes == [0, 1, 2]  # one push per step, stamped with the updates behind the weights
    assert [c for c, _ in engine_fakes.CALLS] == ["update_weights", "generate"] * 3


def test_async_rollouts_carry_the_engines_version_into_staleness():
    _, seen = _fit(GRPO(_config(), engine=engine_fakes.recording_engine), steps=4, mode="async", max_staleness=1)
    pushes = [v for call, v in engine_fakes.CALLS if call == "update_weights"]
    # The producer runs one step ahead: steps 0 and 1 roll out with version 0 (pushed once), step s
    # with version s - 1 after that.
    assert pushes == [0, 1, 2] and sum(call == "generate" for call, _ in engine_fakes.CALLS) == 4
    assert [m["staleness/max"] for m in seen] == [0.0, 1.0, 1.0, 1.0]


def test_native_through_a_factory_equals_the_default_bit_for_bit():
    state_default, _ = _fit(GRPO(_config()))
    state_factory, _ = _fit(GRPO(_config(), engine=engine_fakes.recording_engine))
    for a, b in zip(jax.tree.leaves(state_default.params), jax.tree.leaves(state_factory.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert engine_fakes.CALLS  # the factory really ran


def test_a_config_names_an_engine_factory_by_reference():
    config = load_config(_config(rollout={"engine": "engine_fakes:recording_engine"}))
    assert config.algorithm.rollout_correction == "tis"  # another engine's logps are corrected by default
    _fit(GRPO(config), steps=1)
    assert ("update_weights", 0) in engine_fakes.CALLS


def test_an_engine_that_generated_with_other_weights_is_an_error():
    with pytest.raises(RuntimeError, match="generated with policy version 0, but was given the weights of version 1"):
        _fit(GRPO(_config(), engine=engine_fakes.stale_engine), steps=3)


@pytest.mark.parametrize("value, match", [
    ("vlm", "rollout.engine='vlm': use native, vllm, or a factory"),
    ("not a reference", "rollout.engine='not a reference'"),
])
def test_bad_engine_names_are_refused_in_one_line(value, match):
    with pytest.raises(ConfigError, match=re.escape(match)) as error:
        load_config(_config(rollout={"engine": value}))
    assert "\n" not in str(error.value)


def test_an_engine_reference_that_does_not_import_is_refused_when_built():
    module = GRPO(_config(rollout={"engine": "engine_fakes:no_such_factory"}))
    with pytest.raises(ConfigError, match="rollout.engine='engine_fakes:no_such_factory' does not import"):
        _fit(module, steps=1)


def test_no_ready_module_names_the_native_sampler_or_an_engines_private_parts():
    modules = Path(__file__).resolve().parents[2] / "src" / "rlbolt" / "modules"
    offending = []
    for path in sorted(modules.glob("*.py")):
        text = path.read_text()
        if "NativeSampler" in text or re.search(r"(engine|sampler)\w*\._[a-z]", text):
            offending.append(path.name)
    assert offending == []


def test_rollout_correction_with_the_native_engine_changes_nothing_but_adds_its_metrics():
    """With the native sampler in float32 the engine's logps are the trainer's up to rounding, so
    TIS weights are 1 to float32 precision and the run trains as without correction."""
    plain, _ = _fit(GRPO(_config(algorithm={"rollout_correction": "none"})))
    corrected, seen = _fit(GRPO(_config(algorithm={"rollout_correction": "tis"})))
    # The weights exp(logp_trainer - logp_engine) differ from 1 only by the two float32 forwards'
    # rounding (~1e-6 here, well under decoder_logps_tolerance's worst case); a real correction
    # (a weight of 0.8 or a masked token) moves them by 0.1 and the parameters by ~lr, 1e4x more.
    for a, b in zip(jax.tree.leaves(plain.params), jax.tree.leaves(corrected.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=1e-5)
    for m in seen:
        assert abs(m["rollout_corr/kl_k1"]) < 1e-5 and m["rollout_corr/token_masked_frac"] == 0.0
        assert m["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_vllm_on_cpu_refuses_a_head_dim_it_has_no_kernel_for():
    """Checked before vLLM is imported, so the refusal is one line here too (without the extra)."""
    from flax import nnx

    from rlbolt.models import Decoder, tiny_config
    from rlbolt.rollout.engines import EngineSpec, build_engine

    model = Decoder(tiny_config(vocab_size=32, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16),
                    rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="no kernel for head_dim=16; use a model whose head_dim is at least 32"):
        build_engine("vllm", model, EngineSpec(max_new_tokens=4))


def test_vllm_cpu_cache_is_sized_by_the_run_not_by_the_machine():
    """The CPU KV cache holds max_num_seqs sequences of max_model_len tokens, by the model's shapes
    (hand count), whole 16-token blocks, capped at 4 GiB but never below one sequence; before, vLLM
    reserved half the machine's memory and refused to start on a busy machine."""
    from rlbolt.models import tiny_config
    from rlbolt.rollout.vllm_engine import CPU_KV_CACHE_CAP, kv_cache_need

    config = tiny_config(vocab_size=128, num_layers=2, num_kv_heads=1, head_dim=32)
    per_token = 2 * 2 * 1 * 32 * 4  # keys and values x layers x kv heads x head_dim x float32
    assert kv_cache_need(config, 160, 16, "float32") == 16 * 160 * per_token
    assert kv_cache_need(config, 161, 16, "float32") == 16 * 176 * per_token  # 11 blocks of 16
    assert kv_cache_need(config, 160, 16, "bfloat16") == 16 * 160 * per_token // 2
    huge = tiny_config(vocab_size=128, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128)
    assert kv_cache_need(huge, 4096, 256, "float32") == CPU_KV_CACHE_CAP
    one = 2 * 80 * 8 * 128 * 4 * 131072
    assert kv_cache_need(huge, 131072, 256, "float32") == one > CPU_KV_CACHE_CAP
