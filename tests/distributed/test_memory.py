"""The memory plan: per-device bytes against hand counts, and refusal before anything compiles."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import AbstractMesh

from rlbolt.data import gsm8k_style_rows
from rlbolt.distributed import AXES, MemoryPlan, MemoryPlanError, ShardingPlan, kv_cache_bytes, per_device_bytes
from rlbolt.models import tiny_config
from rlbolt.modules import GRPO
from rlbolt.plan import BatchPlan
from rlbolt.rollout import NativeSampler
from rlbolt.trainer import Trainer

TINY = {"vocab_size": 128, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
        "intermediate_size": 64}


def hand_param_count(c) -> int:
    """The decoder's parameters from its shape (untied, no bias, no qk-norm)."""
    per_layer = (c.hidden_size  # attn_norm
                 + c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim  # qkv
                 + c.num_heads * c.head_dim * c.hidden_size  # o_proj
                 + c.hidden_size  # mlp_norm
                 + c.hidden_size * 2 * c.intermediate_size + c.intermediate_size * c.hidden_size)
    return 2 * c.vocab_size * c.hidden_size + c.num_layers * per_layer + c.hidden_size


def test_kv_cache_bytes_by_hand():
    c = tiny_config(**TINY)
    split = ShardingPlan(AbstractMesh((2, 2, 1, 1, 2), AXES))  # 4 batch shards, 2 kv heads over tp=2
    # rows 8/4 = 2, heads 2/2 = 1: layers x (k, v) x rows x heads x head_dim x slots x 4 bytes + bool mask
    assert kv_cache_bytes(c, 8, 40, split) == 2 * 2 * 2 * 1 * 8 * 40 * 4 + 2 * 40
    gqa = ShardingPlan(AbstractMesh((1, 2, 1, 1, 4), AXES))  # tp=4 does not divide 2 kv heads: every tp device holds both
    assert kv_cache_bytes(c, 8, 40, gqa) == 2 * 2 * 4 * 2 * 8 * 40 * 4 + 4 * 40
    ragged = ShardingPlan(AbstractMesh((1, 8, 1, 1, 1), AXES))  # 3 rows on 8 shards: a device holds at most 1
    assert kv_cache_bytes(c, 3, 10, ragged) == 2 * 2 * 1 * 2 * 8 * 10 * 4 + 10


def test_plan_text_and_refusal_carry_the_numbers_and_a_fix():
    plan = MemoryPlan({"params": 3 << 30, "gradients": 3 << 30, "optimizer state": 6 << 30, "kv cache": 1 << 29},
                      device_bytes=8 << 30, mesh="data=2 fsdp=1 tp=1 (2 devices, 1 process)",
                      axes={"data": 2, "fsdp": 1, "tp": 1})
    assert plan.total == (12 << 30) + (1 << 29)
    with pytest.raises(MemoryPlanError) as info:
        plan.check()
    text = str(info.value)
    for piece in ("params 3.00 GiB", "optimizer state 6.00 GiB", "kv cache 512.00 MiB", "total 12.50 GiB of 8.00 GiB",
                  "cannot fit", "mesh.fsdp", "callbacks.offload", "bfloat16"):
        assert piece in text, piece
    MemoryPlan({"params": 1}, device_bytes=None, mesh="m").check()  # memory not reported: logged, never refused
    assert "device memory not reported" in MemoryPlan({"params": 1}, None, "m").text()


def _grpo(**algorithm):
    return GRPO({"rollout": {"max_new_tokens": 8}, "algorithm": {"beta": 0.04, **algorithm},
                 "model": {"tiny": dict(TINY)}}, reward=lambda completion, sample: 0.0)


def test_trainer_logs_the_plan_and_refuses_one_that_cannot_fit_before_compiling(tmp_path):
    c = tiny_config(**TINY)
    params = hand_param_count(c) * 4
    plan = BatchPlan(prompts_per_step=2, num_generations=4)  # rollout micro 8 -> 8 rows
    kv = kv_cache_bytes(c, 8, 256 + 8 - 1, ShardingPlan(AbstractMesh((1, 1, 1, 1, 1), AXES)))  # prompt width 256 (config)
    # AdamW state: two params-sized moments + an int32 step count; clip_by_global_norm has none.
    want = {"params": params, "gradients": params, "optimizer state": 2 * params + 4, "reference": params,
            "kv cache": kv}
    budget = sum(want.values()) - 1
    compiled_before = NativeSampler.compiled_count()
    trainer, module = Trainer(plan, max_steps=1, run_dir=tmp_path, device_memory_bytes=budget), _grpo()
    with pytest.raises(MemoryPlanError, match="cannot fit") as info:
        trainer.fit(module, gsm8k_style_rows(4))
    # Refused in set-up: no sampler was built or compiled, no step ran.
    assert module.rollout.handle is None and NativeSampler.compiled_count() == compiled_before
    assert getattr(trainer, "last_state", None) is None
    for name in want:
        assert name in str(info.value), name
    fits = Trainer(plan, max_steps=1, run_dir=tmp_path / "b", device_memory_bytes=budget + 1)
    fits._setup(_grpo(), gsm8k_style_rows(4), None)
    assert fits.memory_plan.items == want
    assert per_device_bytes(fits.last_state.params) == params
    assert np.isclose(fits.memory_plan.total, budget + 1)
