"""benchmarks/memory_table.py reports the memory plan's items for abstract models: checked here
against a hand count of a small model's parameters, AdamW's state and the KV cache."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "memory_table.py"
# A small Qwen2-style shape: fused q|k|v with bias, tied embeddings.
SHAPE = dict(vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=128, tie_word_embeddings=True, attention_bias=True, architecture="Qwen2ForCausalLM")


def _table():
    spec = importlib.util.spec_from_file_location("memory_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _hand_param_count(s: dict) -> int:
    h, d, n_q, n_kv = s["hidden_size"], s["head_dim"], s["num_heads"], s["num_kv_heads"]
    qkv = h * (n_q + 2 * n_kv) * d + (n_q + 2 * n_kv) * d  # kernel + bias
    per_layer = qkv + n_q * d * h + 3 * h * s["intermediate_size"] + 2 * h  # o, gate|up|down, two norms
    return s["vocab_size"] * h + s["num_layers"] * per_layer + h  # embeddings (tied), final norm


@pytest.fixture(scope="module")
def sharding():
    from rlbolt.distributed.mesh import as_mesh
    from rlbolt.distributed.sharding import ShardingPlan

    return ShardingPlan(as_mesh({"data": 1, "fsdp": 1, "tp": 1}))


def test_full_plan_matches_a_hand_count(sharding):
    items = _table().plan_items(SHAPE, "full", rollout_rows=3, max_len=10, sharding=sharding)
    params = _hand_param_count(SHAPE) * 2  # bfloat16
    assert items["params"] == params == items["reference"]
    # model.master_weights auto: float32 masters, gradients summed in float32, float32 moments
    assert items["master weights"] == 2 * params == items["gradients"]
    assert items["optimizer state"] == 4 * params + 4  # Adam's two float32 moments + an int32 count
    rows = 4  # 3 rows padded to a power of two
    kv = SHAPE["num_layers"] * 2 * rows * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * 10 * 2 + rows * 10  # + bool mask
    assert items["kv cache"] == kv


def test_lora_plan_trains_only_the_adapters(sharding):
    items = _table().plan_items(SHAPE, "lora", rollout_rows=1, max_len=4, sharding=sharding)
    h, q, kv, i = 64, 4 * 16, 2 * 16, 128  # hidden, query width, key/value width, MLP width
    # rank 16 x (in + out) per target: q, k, v, o, gate, up, down; two layers; float32 adapters
    adapters = 2 * 16 * ((h + q) + (h + kv) + (h + kv) + (q + h) + (h + i) + (h + i) + (i + h)) * 4
    assert items["params"] == adapters == items["gradients"]
    assert items["optimizer state"] == 2 * adapters + 4
    assert items["frozen base"] == _hand_param_count(SHAPE) * 2
    assert "reference" not in items  # the base with the adapters off is the reference


@pytest.mark.parametrize("total, card, word", [(75, 100, "fits"), (76, 100, "tight"), (100, 100, "tight"),
                                               (101, 100, "no"), (0, 100, "fits")])
def test_fit_words_leave_a_quarter_for_activations(total, card, word):
    assert _table().fit_word(total, card) == word
