"""The benchmarks run in quick mode so they never rot; their numbers are not asserted here (speed
is measured in benchmarks/, never in tests), only that each prints its table and ends with one
JSON line holding every field the speed issue names. The default tier runs grpo_step.py (which
also runs ceiling.py's bound) and the cheap scripts; the ones that compile a model several times
(ceiling, sampler, length sweep, LoRA, meshes, agents, real shapes, update breakdown) are slow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
GRPO_FIELDS = {"system", "step_s_median", "step_s_all", "gen_tokens_per_s", "peak_rss_mb", "split",
               "compiles_after_warmup", "gflops_per_step", "achieved_gflops", "matmul_gflops", "floor_step_s",
               "overhead_ratio", "step_over_bound", "shared_prompt", "step_over_unshared_bound"}


def _last_json(script: str, *args: str) -> tuple[str, dict]:
    # The user's XLA flags, not the tests' fast-compile ones (tests/conftest.py): a benchmark runs as shipped.
    env = {**os.environ, "XLA_FLAGS": os.environ.get("RLBOLT_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick", *args], capture_output=True, text=True,
                         timeout=600, check=True, env=env).stdout
    lines = [line for line in out.splitlines() if line.strip()]
    return out, json.loads(lines[-1])


@pytest.mark.slow  # ~20 s: the whole quick benchmark run; its schema rots only with the benchmark
def test_grpo_step_benchmark_quick_mode():
    out, result = _last_json("grpo_step.py")
    assert "overhead ratio" in out  # the table came before the JSON line
    assert GRPO_FIELDS <= set(result) and result["system"] == "rlbolt"
    assert set(result["split"]) == {"rollout", "logps", "reward", "update", "other"}
    assert len(result["step_s_all"]) == 2 and all(v > 0 for v in result["step_s_all"])
    assert result["gflops_per_step_unshared"] > 90  # the workload's ~95 GFLOP (benchmarks/flops.py), not a timing
    # The prompt runs once per group of 4 by default: a quarter of the unshared forward's tokens are
    # duplicate prompt tokens (8 x 3 x 32 of 32 x 96), so the shared step computes fewer FLOPs.
    assert result["shared_prompt"] is True and result["duplicate_prompt_token_share"] == 0.25
    assert 0.7 * result["gflops_per_step_unshared"] < result["gflops_per_step"] < 0.8 * result["gflops_per_step_unshared"]
    assert result["step_over_unshared_bound"] == result["step_s_median"] / result["unshared_bound_step_s"]
    assert result["unshared_bound_step_s"] > 0 and set(result["bound_split"]) == {"prefill", "decode", "ref", "update"}
    # the matmul-only bound (benchmarks/ceiling.py) is measured in the same process and used consistently
    assert 0 < result["bound_step_s"] and 0 < result["bound_ratio"]
    assert result["step_over_bound"] == result["step_s_median"] / result["bound_step_s"]
    # both ratios share the one matmul timed in this run
    assert result["bound_ratio"] == result["gflops_per_step"] / result["bound_step_s"] / result["matmul_gflops"]


REAL_SHAPE_FIELDS = {"completion", "runs", "step_s_median", "split", "bound_split", "bound_step_s", "phase_over_bound",
                     "update_over_bound", "update_over_dense_bound", "gen_tokens_per_s", "peak_rss_mb", "update_temp_mb", "matmul_gflops",
                     "compiles_after_warmup", "load_avg", "train_micro", "layers", "vocab", "sequences", "prompt_len"}


@pytest.mark.slow  # ~40 s of CPU (90 s wall on a quiet 2-core box): the 49k-vocabulary lm_head dominates even on 2 layers
def test_real_shape_benchmark_quick_mode():
    """`--preset smollm2 --quick`: SmolLM2-135M's shapes on 2 layers, 32 new tokens, in a child process."""
    out, result = _last_json("grpo_step.py", "--preset", "smollm2")
    assert "upd/bnd" in out and "rollout / its bound" in out  # the summary table and the child's own table
    assert result["system"] == "rlbolt-real-shapes" and result["quick"] is True and result["rounds"] == 1
    (line,) = result["lengths"]
    assert REAL_SHAPE_FIELDS <= set(line) and line["runs"] == 1
    # the shapes asked for: 8 prompts x G=4 of 48 tokens, 32 new tokens, the 49,152 vocabulary (2 layers in quick mode)
    assert (line["completion"], line["sequences"], line["prompt_len"], line["vocab"], line["layers"]) == (32, 32, 48, 49152, 2)
    assert set(line["split"]) == {"rollout", "logps", "reward", "update", "other"}
    assert set(line["bound_split"]) == {"prefill", "decode", "ref", "update", "update_attention"}
    assert all(v > 0 for v in line["bound_split"].values())
    # each phase is set against its own products (benchmarks/ceiling.py), the update's ratio being the target's:
    # its dense products plus its attention products (q . k and p . v at their causal share)
    split, bound, ratio = line["split"], line["bound_split"], line["phase_over_bound"]
    assert ratio["update"] == line["update_over_bound"] == split["update"] / (bound["update"] + bound["update_attention"])
    assert line["update_over_dense_bound"] == split["update"] / bound["update"]
    assert ratio["rollout"] == split["rollout"] / (bound["prefill"] + bound["decode"])
    assert ratio["logps"] == split["logps"] / bound["ref"]
    assert line["peak_rss_mb"] > 0 and len(line["load_avg"][0]) == 6


def test_chat_prompt_ids_are_a_chatml_frame_of_the_asked_length():
    import numpy as np

    sys.path.insert(0, str(BENCHMARKS))
    from shapes import chat_prompt_ids

    ids = chat_prompt_ids(np.random.default_rng(0), 49152, 48)
    assert len(ids) == 48 and all(0 < i < 49152 for i in ids)
    # <|im_start|>system\n ... <|im_end|>\n<|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n
    assert ids[:3] == [3, 9690, 198] and ids[12:17] == [2, 198, 3, 4093, 198] and ids[-5:] == [2, 198, 3, 520, 198]
    assert len(chat_prompt_ids(np.random.default_rng(0), 49152, 23)) == 23  # one content id
    with pytest.raises(ValueError, match="length=22 must be at least 23"):
        chat_prompt_ids(np.random.default_rng(0), 49152, 22)


def test_bound_pieces_must_hold_whole_groups():
    sys.path.insert(0, str(BENCHMARKS))
    from ceiling import measure_bound

    from rlbolt.models import tiny_config

    # 12 sequences in groups of 2 split into 3 or 6 pieces, not 4 (a piece of 3 would cut a group)
    with pytest.raises(ValueError, match="pieces=4 must split the 12 sequences into whole groups of 2"):
        measure_bound(tiny_config(), 12, 4, 4, group=2, pieces=4)


SWEEP_FIELDS = {"system", "completion", "prompt", "group", "sequences", "shared_prompt", "step_s", "split",
                "gen_tokens_per_s", "forward_tokens_per_s", "peak_rss_mb", "decode_attention_share",
                "whole_cache_attention_share", "rollout_s_whole_cache", "rollout_s_segmented"}


@pytest.mark.slow  # ~27 s: a fit per point; the default tier keeps grpo_step.py's quick mode
def test_length_sweep_quick_mode_prints_one_json_line_per_point():
    env = {**os.environ, "XLA_FLAGS": os.environ.get("RLBOLT_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, str(BENCHMARKS / "length_sweep.py"), "--quick"], capture_output=True,
                         text=True, timeout=600, check=True, env=env).stdout
    point, eos = (json.loads(line) for line in out.strip().splitlines())
    assert SWEEP_FIELDS <= set(point) and point["system"] == "rlbolt-length-sweep" and point["shared_prompt"]
    assert set(point["split"]) == {"rollout", "logps", "reward", "update", "other"}
    assert 0 <= point["decode_attention_share"] <= 1 and 0 <= point["whole_cache_attention_share"] <= 1
    assert eos["eos"] is True and set(eos["with_stop"]) >= {"rollout_s", "decode_steps", "mean_length", "max_length"}
    # Stops end rows early: every row of the no-stop call is full length, the stop call's are not all.
    assert eos["no_stop"]["mean_length"] == eos["completion"] > eos["with_stop"]["mean_length"]
    # Compaction and the segment length change the cost, never the samples.
    stopped = [v for k, v in eos.items() if k.startswith("with_stop")]
    assert len(stopped) == 3 and len({(v["mean_length"], v["max_length"]) for v in stopped}) == 1
    assert eos["compaction_speedup"] > 0


@pytest.mark.slow
def test_ceiling_benchmark_quick_mode():
    out, result = _last_json("ceiling.py")
    assert "best achieved / matmul" in out and result["system"] == "rlbolt-ceiling"
    times = result["times_s"]
    assert set(times) == {"prefill", "decode", "ref", "update"} and all(t > 0 for t in times.values())
    assert abs(result["bound_step_s"] - sum(times.values())) < 1e-12
    # same FLOP formula as grpo_step.py: the ratios of the two scripts are comparable
    ratio = result["gflops_per_step"] / result["bound_step_s"] / result["matmul_gflops"]
    assert abs(result["bound_ratio"] - ratio) < 1e-9 and 90 < result["gflops_per_step"] < 110


@pytest.mark.slow
def test_sampler_benchmark_quick_mode():
    _, result = _last_json("sampler.py")
    assert result["system"] == "rlbolt-sampler" and result["gen_tokens_per_s"] > 0
    assert result["compiles_after_warmup"] == 0


def test_dock_benchmark_quick_mode():
    out, result = _last_json("dock.py")
    assert "dock us/sample" in out and result["system"] == "rlbolt-dock"
    (size,) = result["sizes"].values()
    assert size["dock_ms"] > 0 and size["concat_ms"] > 0
    assert abs(size["dock_us_per_sample"] - 1e3 * size["dock_ms"] / 64) < 1e-9


@pytest.mark.slow  # ~5 s: a second process serves the dock
def test_dock_flight_benchmark_quick_mode():
    out, result = _last_json("dock_flight.py")
    assert "put MB/s" in out and result["system"] == "rlbolt-dock-flight"
    assert set(result["results"]) == {"64/local", "64/thread", "64/process"}
    for r in result["results"].values():
        assert r["payload_mb"] == 64 * 4096 * 8 / 1e6  # exact: int32 ids + float32 logps
        assert abs(r["put_mb_s"] - r["payload_mb"] / (r["put_ms"] / 1e3)) <= 1e-9 * r["put_mb_s"]


@pytest.mark.slow  # ~28 s: two fresh processes building and compiling LoRA rollouts both ways
def test_lora_ab_benchmark_quick_mode():
    out, result = _last_json("lora_ab.py")
    assert "merged" in out and result["system"] == "rlbolt-lora-ab"
    assert all(result[f"{k}_s"] > 0 for k in ("full", "adapters", "merged", "update_full", "update_lora"))
    # neither LoRA rollout keeps weights on the device after it: merging makes a transient copy
    assert result["adapters_held_mb"] == 0 and result["merged_held_mb"] == 0 and result["merged_transient_mb"] > 0


def test_reward_executors_benchmark_quick_mode():
    out, result = _last_json("reward_executors.py")
    assert "us/sample" in out and result["system"] == "rlbolt-reward-executors" and result["samples_per_call"] == 32
    for executor in ("thread", "process"):
        assert result[f"{executor}_us_per_sample"] > 0 and result[f"{executor}_first_call_s"] > 0


def test_checkpoint_integrity_benchmark_quick_mode():
    out, result = _last_json("checkpoint_integrity.py")
    assert "checksum share of a save" in out and result["system"] == "rlbolt-checkpoint-integrity"
    assert result["checkpoint_mb"] == 3 * result["param_mb"]  # params + Adam's two moments (+ tiny count, rng)
    for key in ("checksum_s", "sum64_s", "save_total_s", "restore_s"):
        assert result[key] > 0


@pytest.mark.slow
def test_mesh_benchmark_quick_mode():
    """Two fresh processes (1 and 2 CPU devices): slow, so outside the default tier."""
    out, result = _last_json("mesh_step.py")
    assert "overhead, not speedup" in out and result["system"] == "rlbolt-mesh"
    runs = result["runs"]
    assert [r["devices"] for r in runs] == [1, 2]
    assert [r["mesh"]["fsdp"] for r in runs] == [1, 2]
    assert result["same_rewards"]  # the mesh changes no sample
    assert runs[1]["memory_plan_bytes"]["params"] * 2 == runs[0]["memory_plan_bytes"]["params"]


@pytest.mark.slow  # ~19 s: three rollouts of 32 episodes compiled; tests/agents pin the session path's samples
def test_agents_overhead_benchmark_quick_mode():
    out, result = _last_json("agents_overhead.py")
    assert "multi-turn overhead per sampled token" in out
    # No stop token on either side: both sample every one of 32 x 64 tokens, so the ratio compares like with like.
    # Episodes run twice: with the engine's session (KV cache kept) and with whole histories.
    assert result["sampled_tokens"] == {"session": 32 * 64, "history": 32 * 64, "single": 32 * 64}
    assert result["turns_per_episode"] == 4.0 and result["env_tokens_per_episode"] > 0
    for path in ("session", "history"):
        assert result["overhead_per_token"][path] == (result["seconds_per_sampled_token"][path]
                                                     / result["seconds_per_sampled_token"]["single"])


@pytest.mark.slow  # ~20 s: the 49k-vocabulary lm_head's gradient, two layers, traced once
def test_update_breakdown_quick_mode_prints_its_split_and_the_costliest_ops(tmp_path):
    out, result = _last_json("update_breakdown.py", "--rounds", "1", "--profile", str(tmp_path))
    assert result["system"] == "rlbolt-update-breakdown" and result["vocab"] == 49152
    assert set(result["seconds"]) == {"full", "no_head", "products", "layer_products", "attention_products"}
    parts = result["seconds"]
    assert result["full_over_products"] == parts["full"] / parts["products"]
    assert result["full_over_all_products"] == parts["full"] / (parts["products"] + parts["attention_products"])
    assert result["layers_beyond_products_s"] == parts["no_head"] - parts["layer_products"]
    # The op table read the trace against the compiled HLO: the lm_head's [tokens, V] product is named with its shape.
    assert "ops of one call" in out and "f32[128,49152]" in out
    assert (tmp_path / "full.hlo.txt").read_text().count("ENTRY") == 1


def test_decode_products_benchmark_quick_mode():
    """XLA's decode products (both lm_head layouts, weights on either side) and, where torch is
    installed, torch's; vLLM's oneDNN kernels only in vLLM's venv (absent here: not in the JSON)."""
    out, result = _last_json("decode_products.py")
    assert "total ms per step" in out and result["system"] == "rlbolt-decode-products"
    assert result["rows"] == 32 and result["layers"] == 2 and result["quick"] is True
    times = result["ms_per_step"]
    for product in ("qkv", "o_proj", "gate_up", "down"):
        assert times[f"xla/{product}"] > 0 and times[f"xla_weights_left/{product}"] > 0
    assert times["xla/lm_head [B, V]"] > 0 and times["xla/lm_head [V, B]"] > 0
    totals = result["total_ms_per_step"]
    # float64 sums of the same four timings in another order: approx's 1e-6 relative is ~1e10 ulps
    assert totals["xla"] == pytest.approx(sum(times[f"xla/{p}"] for p in ("qkv", "o_proj", "gate_up", "down"))
                                          + times["xla/lm_head [V, B]"], abs=0.02)
    assert (totals["vllm_onednn"] is None) == (not result["vllm_onednn"])


def _gpu_attention():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_attention", BENCHMARKS / "gpu_attention.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_gpu_attention_benchmark_bound():
    """benchmarks/gpu_attention.py's derived bf16 bound: hand values, and max|s| against float64 NumPy."""
    import numpy as np

    bench = _gpu_attention()
    assert bench.bf16_bound(4.0, 2.0) == 2.0 * (4.0 / 128 + 2.0 / 128)  # exact: dyadic values
    q, k, _, _, _ = bench._inputs(256)
    q64, k64 = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 7, axis=2)
    want = 0.125 * np.abs(np.einsum("bqhd,bkhd->bhqk", q64, k64)).max()
    # float32 products of bfloat16 inputs (exact) summed over 64 terms: 64 eps32 relative at most
    assert abs(bench.max_abs_score(q, k, 0.125) - want) <= 64 * 2.0 ** -23 * want


@pytest.mark.slow  # ~10 s of CPU: two attention gradients compiled
def test_gpu_attention_benchmark_dry_run_on_cpu():
    """`--dry-run`'s rows at T=128 (the cuDNN column through jax's XLA backend): fields and the check."""
    xla, cudnn = _gpu_attention().measure(128, 1, "xla")
    assert (xla["path"], cudnn["path"], cudnn["implementation"], cudnn["tokens"]) == ("xla", "cudnn", "xla", 128)
    assert cudnn["within_bound"] and cudnn["max_abs_diff"] <= cudnn["bound"]


@pytest.mark.slow  # two updates compiled at SmolLM2's 49k vocabulary (one layer), then two rounds of each
def test_packing_benchmark_quick_mode():
    out, result = _last_json("packing_ab.py")
    assert "packed" in out and "padded" in out  # the table came before the JSON line
    assert result["system"] == "rlbolt-packing-ab" and result["cpu"]
    assert {"update_s_padded", "update_s_packed", "speedup", "update_cpu_s_padded", "update_cpu_s_packed"} <= set(result)
    assert result["packed_tokens"] < result["padded_tokens"]  # 8 samples of 32..128 tokens fill fewer than 8 rows
    # Same tokens, same loss: the layouts differ in float32 rounding only. Written reason for 1e-3: the
    # script does not expose its model for decoder_logps_tolerance; each logp is a 49k-term log-sum-exp
    # (49k x EPS32 ~ 6e-3 absolute at worst, ~1e-5 in practice: the two runs matched to the bit here) and the
    # loss is a mean of them, so a relative 1e-3 flags a wrong token or mask, not another summation order.
    assert abs(result["loss_packed"] - result["loss_padded"]) <= 1e-3 * abs(result["loss_padded"])
