"""GRPO and the sampler on 8 CPU devices (a fresh process each) against one device.

Tolerances (float32): a sharded matmul adds its partial sums in another order, so losses and
logps differ by float rounding; sampled tokens, rewards and data positions must not differ at
all. `mesh_checks.py train` trains with SGD + momentum (update linear in the gradient) at lr 0.5
for two steps, where rounding moves parameters by ~1e-8; the bound 1e-6 would still catch any
real difference (a wrong or missing gradient term moves them by ~1e-2).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rlbolt.distributed.mesh import BATCH_AXES
from cpu_devices import child_env

SCRIPT = Path(__file__).with_name("mesh_checks.py")


def run_checks(what: str, arg, devices: int = 8) -> dict:
    env = child_env(MESH_CHECK_DEVICES=str(devices))  # the script asks for its devices itself
    done = subprocess.run([sys.executable, str(SCRIPT), what, json.dumps(arg)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# The rules, written out: which mesh axes shard each dimension. The vocabulary is the built-in
# tokenizer's 99 ids, which tp=2 cannot split: that dimension is replicated ("V"), every other divides.
HAND_SPECS = {"embedding": ["V", "fsdp"], "lm_head": ["fsdp", "V"], "qkv_proj": ["fsdp", "tp"],
              "o_proj": ["tp", "fsdp"], "gate_up_proj": ["fsdp", "tp"], "down_proj": ["tp", "fsdp"], "scale": ["fsdp"]}
VOCAB = 99


def check_training(result: dict) -> None:
    mesh = result["mesh"]
    assert result["completions_equal"]  # every sampled token, every step
    for ref, got in zip(result["ref_steps"], result["steps"], strict=True):
        assert got["reward/mean"] == ref["reward/mean"]
        assert abs(got["loss"] - ref["loss"]) <= 1e-6
        assert math.isclose(got["grad_norm"], ref["grad_norm"], rel_tol=1e-5)
        assert abs(got["kl"] - ref["kl"]) <= 1e-6
    assert result["max_param_diff"] <= 1e-6
    # Sharded for real: each live shard holds 1/shards of its array, shards from the spec.
    for tree in ("params", "opt_state"):
        total = per_device = 0
        for leaf in result[tree]:
            name = next(k for k in HAND_SPECS if k in leaf["path"])
            want = [("tp" if VOCAB % mesh["tp"] == 0 else None) if a == "V" else a for a in HAND_SPECS[name]]
            want = [a if a and mesh[a] > 1 else None for a in want]
            assert [a for a in leaf["spec"]] + [None] * (len(want) - len(leaf["spec"])) == want, leaf
            shards = math.prod(mesh[a] for a in want if a)
            assert leaf["shard_bytes"] * shards == leaf["bytes"], leaf
            total, per_device = total + leaf["bytes"], per_device + leaf["bytes"] // shards
        reported = result["params_per_device" if tree == "params" else "opt_per_device"]
        assert 0 <= reported - per_device <= 8  # + replicated scalars (an optimizer's step count)
        assert per_device <= total / mesh["fsdp"]  # (the vocabulary rows are replicated over tp)
    plan = result["memory_plan"]
    assert plan["params"] == result["params_per_device"] and plan["reference"] == plan["params"]
    # A Hugging Face folder loads straight into the shardings, with the same values.
    assert result["hf_equal"] and result["hf_sharded_as_planned"]
    if mesh["fsdp"] * mesh["tp"] == 1:  # no axis splits parameters (context 8 alone): each device holds them whole
        assert result["hf_per_device"] == result["hf_total"]
        return
    replicated = result["hf_replicated"]  # a few small vectors: < 1% of the model
    assert replicated < result["hf_total"] / 100
    assert result["hf_per_device"] <= (result["hf_total"] - replicated) / mesh["fsdp"] + replicated


def test_grpo_on_tp2_x_fsdp4_equals_one_device():
    """The default tier's representative (~30 CPU-seconds, mostly compiling).

    One device runs each prompt once per group of 4; fsdp=4 (four batch shards) runs every
    sample's prompt: so this also checks the shared path against the unshared one, end to end."""
    result = run_checks("train", {"fsdp": 4, "tp": 2})
    check_training(result)
    assert result["train_group_size"] == [4, 1]


@pytest.mark.slow
def test_grpo_on_a_tp_only_mesh_shares_the_prompt_and_equals_one_device():
    """One batch shard (tp=2 on 2 devices): the prompt is shared on the mesh too."""
    result = run_checks("train", {"fsdp": 1, "tp": 2}, devices=2)
    check_training(result)
    assert result["train_group_size"] == [4, 4]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [{"fsdp": 8}, {"data": 2, "fsdp": 2, "tp": 2}])
def test_grpo_on_other_meshes_equals_one_device(mesh):
    check_training(run_checks("train", mesh))


@pytest.mark.slow
def test_sampler_on_meshes_is_token_identical_and_never_holds_the_whole_model():
    out = run_checks("sampler", [{"fsdp": 8}, {"fsdp": 4, "tp": 2}, {"data": 2, "fsdp": 2, "tp": 2},
                                 {"fsdp": 2, "tp": 4}])
    assert out["distinct_sampled_rows"] == 12  # the sampled comparison is not vacuous
    assert out["architectures_greedy_equal"] == {"Qwen2ForCausalLM": True, "Qwen3ForCausalLM": True}
    for r in out["results"]:
        assert r["greedy_equal"] and r["sampled_equal"], r["mesh"]
        assert r["logp_diff"] <= 1e-5
        shards = r["mesh"]["fsdp"] * r["mesh"]["tp"] * r["mesh"]["data"]
        # Weights stay sharded inside the compiled call: arguments ~ params / devices (data
        # replicates), and the temporaries hold far less than a whole model.
        assert r["heavy_params_per_device"] <= r["heavy_param_bytes"] * r["mesh"]["data"] / shards * 1.05
        assert r["argument_bytes"] < r["heavy_param_bytes"] / 2
        assert r["temp_bytes"] < r["heavy_param_bytes"] / 4
    # Two key/value heads: split over tp=2, replicated over tp=4 (GQA heads that do not divide tp).
    specs = {json.dumps(r["mesh"], sort_keys=True): r["cache_key_spec"] for r in out["results"]}
    batch = list(BATCH_AXES)  # the batch axes of the mesh (data, fsdp, expert)
    assert specs[json.dumps({"data": 2, "fsdp": 2, "expert": 1, "context": 1, "tp": 2}, sort_keys=True)] == [batch, "tp"]
    assert specs[json.dumps({"data": 1, "fsdp": 2, "expert": 1, "context": 1, "tp": 4}, sort_keys=True)] == [batch, None]


@pytest.mark.slow
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_lora_and_qlora_on_a_mesh_equal_one_device(quantize):
    """LoRA adapters (and QLoRA's int8 base) train on fsdp=4 x tp=2 as on one device; the frozen
    base is sharded like the model it came from."""
    r = run_checks("lora", [{"fsdp": 4, "tp": 2}, {"rank": 4, "quantize": quantize}])
    assert r["completions_equal"]
    for ref, got in zip(r["ref_steps"], r["steps"], strict=True):
        assert got["reward/mean"] == ref["reward/mean"] and abs(got["loss"] - ref["loss"]) <= 1e-6
    assert r["max_param_diff"] <= 1e-6
    assert r["frozen_per_device"] <= r["frozen_one_device"] / 4
    assert r["adapters_per_device"] < r["adapters_one_device"]


# Context parallelism: three GRPO steps (the harness's default is two) on context 2, 4 and 8, with fsdp
# and tp where 8 host devices allow. The third step trains on completions sampled from parameters
# already moved twice by the ring's gradients, so rounding compounds over one more step than above;
# measured: parameters 6e-8 apart after three steps on context 2 x fsdp 2 x tp 2, 1e-6 still holds.
CONTEXT_MESHES = [{"context": 2, "fsdp": 2, "tp": 2}, {"context": 4, "fsdp": 2}, {"context": 8, "fsdp": 1},
                  {"context": 2, "fsdp": 2, "packing": "on"}]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", CONTEXT_MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items()))
def test_grpo_with_context_parallelism_equals_one_device(mesh):
    """mesh.context splits each sequence's tokens (ring attention): the same three steps as one device.
    The update runs unshared there (train group size 1): the ring splits the unshared forward.
    With plan.packing: on (both runs) the ring takes the packed rows' segment ids."""
    devices = mesh["context"] * mesh["fsdp"] * mesh.get("tp", 1)
    result = run_checks("train", {**mesh, "steps": 3}, devices=devices)
    assert len(result["steps"]) == 3
    check_training(result)
    assert result["train_group_size"] == [4, 1]
    # the ring ran: the mesh's compiled forwards (update, old and reference log-probs) went through it
    assert result["ring_traces"][0] == 0 and result["ring_traces"][1] >= 2


@pytest.mark.slow
@pytest.mark.parametrize("mesh, quantize", [({"context": 2, "fsdp": 2}, None), ({"context": 2, "fsdp": 2, "tp": 2}, "int8")])
def test_lora_and_qlora_with_context_parallelism_equal_one_device(mesh, quantize):
    """LoRA adapters sit in the projections, the ring in attention: three GRPO steps on a context mesh
    (QLoRA's int8 base with tp too) equal one device's; the frozen base is sharded over fsdp x tp only."""
    r = run_checks("lora", [{**mesh, "steps": 3}, {"rank": 4, "quantize": quantize}],
                   devices=mesh["context"] * mesh["fsdp"] * mesh.get("tp", 1))
    assert r["completions_equal"] and len(r["steps"]) == 3
    for ref, got in zip(r["ref_steps"], r["steps"], strict=True):
        assert got["reward/mean"] == ref["reward/mean"] and abs(got["loss"] - ref["loss"]) <= 1e-6
        assert math.isclose(got["grad_norm"], ref["grad_norm"], rel_tol=1e-5)
    assert r["max_param_diff"] <= 1e-6
    assert r["ring_traces"][0] == 0 and r["ring_traces"][1] >= 2
    assert r["frozen_per_device"] <= r["frozen_one_device"] / mesh["fsdp"]
