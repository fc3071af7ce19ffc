"""Ring attention over a `context` mesh axis (models/context_attention.py) equals one device.

The meshes run in a fresh process with 8 CPU devices (context_checks.py), all cases of a tier in
one process (one start-up). Tolerances: `attention_tolerance` for the output and
`attention_grad_tolerance` for dq, dk, dv (tests/float_tolerance.py); the teeth check that a mask
bug (segments ignored) moves the output and each gradient by more than its tolerance. Decoders:
`decoder_tolerance` for logits and each gradient (tests/float_tolerance.py); the masks on the
ORIGINAL slots are what they test (the ring given the permuted order's own slots instead misses
the logits by 0.21 against a tolerance of 3.3e-5). GRPO on context meshes: tests/distributed/
test_multi_device.py (slow).
"""

import json
import logging
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from rlbolt.models import tiny_config
from rlbolt.models.context_attention import balanced_order, padded_length, query_chunk
from rlbolt.models.context_parallel import context_kernel_calls
from cpu_devices import child_env

GEMMA_LIKE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  intermediate_size=48, attn_logit_softcapping=5.0, sliding_window=7,
                  layer_types=("sliding_attention", "full_attention"))

SCRIPT = Path(__file__).with_name("context_checks.py")


def _check(checks: dict) -> dict:
    env = child_env()  # the script asks for its 8 devices itself
    done = subprocess.run([sys.executable, str(SCRIPT), json.dumps(checks)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_equal(results: dict) -> None:
    assert results.pop("teeth") > 100 * max(r["out_tol"] for r in results.values() if "out_tol" in r)
    if "grad_teeth" in results:
        assert min(results.pop("grad_teeth")) > 1.0
    for case, r in results.items():
        assert r["out_diff"] <= r["out_tol"], (case, r)
        for diff, tol in zip(r["grad_diff"], r["grad_tol"]):
            assert diff <= tol, (case, r)
        assert r["pad_rows_finite"], case  # the all-padding row: zeros, never NaN


def test_balanced_order_by_hand():
    # n = 2, T = 8: chunks of 2; device 0 holds chunks 0 and 3, device 1 chunks 1 and 2
    assert balanced_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert balanced_order(4, 1).tolist() == [0, 1, 2, 3]
    assert sorted(balanced_order(48, 8).tolist()) == list(range(48))  # a permutation
    assert [padded_length(t, 4) for t in (1, 8, 9, 37)] == [8, 8, 16, 40]
    # a piece of 1,034 tokens has no divisor in [128, 512]: padded to 2 x 1,152 (chunks of 384)
    assert padded_length(2068, 2) == 2304 and query_chunk(1152) == 384 and query_chunk(550) == 275
    assert query_chunk(1034) is None and query_chunk(512) == 512
    with pytest.raises(ValueError, match=r"length 10 is not a multiple of 2 x mesh.context = 4"):
        balanced_order(10, 2)


def _assert_decoder_equal(results: dict) -> None:
    for mesh, r in results.items():
        assert r["ring"], mesh  # the ring's collective permutes are in the program
        assert r["logit_diff"] <= r["logit_tol"], (mesh, r)
        assert r["grad_excess"] <= 0, (mesh, r)  # every gradient within decoder_tolerance of one device's


def test_context_parallel_decoder_equals_one_device():
    """The default tier's one process (one start-up, ~10 s): a Gemma-2-like decoder (a sliding layer
    with a window of 7, soft-capping, GQA 4/2) on context 2 x fsdp 2, 4 rows of 37 tokens (padded to 40
    inside) with left padding of 0 to 20: logits and every parameter gradient equal one device. The
    ring itself on packed and all-padding rows, and n = 2, 4, 8: the slow test below."""
    _assert_decoder_equal(_check({"decoder": {"meshes": [{"context": 2, "fsdp": 2}]}})["decoder"])


@pytest.mark.slow
def test_context_parallel_on_context_2_4_8():
    """Ring attention against attend() on left-padded, packed and all-padding rows (3 rows; padded to 4
    over fsdp, or every row on every fsdp device), T = 37 padded inside, GQA 4/2, windows, soft-capping,
    pieces over QUERY_CHUNK; decoders (Gemma-2-like, packed, Qwen3-MoE, scanned under remat) on
    context 2, 4, 8 composed with fsdp, tp and expert."""
    results = _check({"attention": [{"context": 4, "rows": 2, "window": 6, "cap": 5.0},
                                    {"context": 2}, {"context": 4}, {"context": 8, "window": 6},
                                    {"context": 8, "cap": 5.0, "grad_teeth": True},
                                    # pieces over QUERY_CHUNK: 550 rows in chunks of 275; 1,034 rows (no divisor in
                                    # [128, 512]) padded to 1,152 in chunks of 384
                                    {"context": 2, "length": 1100}, {"context": 2, "length": 2068, "window": 300},
                                    {"context": 2, "rows": 2, "replicated_rows": True},  # 3 rows on every fsdp device
                                    {"context": 4, "balanced": False}],  # every block whole (no causal halving)
                      "decoder": {"meshes": [{"context": 4}, {"context": 8}, {"context": 2, "fsdp": 2, "tp": 2}]},
                      "packed": {"meshes": [{"context": 2, "fsdp": 2}, {"context": 8}]},
                      "moe": {"meshes": [{"context": 2, "fsdp": 2}, {"context": 2, "expert": 2}]},
                      "scanned": {"meshes": [{"context": 4, "fsdp": 2}]}})
    _assert_equal(results["attention"])
    _assert_decoder_equal(results["decoder"])
    _assert_decoder_equal(results["packed"])  # packed rows (segment ids, positions restarting per sample)
    _assert_decoder_equal(results["moe"])  # a Qwen3-MoE layer, also with expert parallelism beside the ring
    _assert_decoder_equal(results["scanned"])  # model.scan_layers and model.remat: full around the ring


def test_flash_with_context_runs_the_ring_and_says_so_once(caplog):
    """model.attention: flash (splash / cuDNN) with mesh.context > 1: every layer runs the ring (its
    blocks XLA products), a sliding layer with its window; one WARNING line says so."""
    config = tiny_config(**GEMMA_LIKE)
    segments, slots = jnp.ones((2, 8), jnp.int32), jnp.arange(8)
    with caplog.at_level(logging.WARNING, logger="rlbolt.models"):
        for _ in range(2):
            calls = context_kernel_calls(config, "splash", segments, slots, None, packed=False)
    assert [(c.kernel, c.window) for c in calls] == [("context", 7), ("context", None)]
    lines = [r.getMessage() for r in caplog.records if "mesh.context" in r.getMessage()]
    assert lines == ["model.attention: every layer runs XLA attention instead of splash: mesh.context > 1 runs ring "
                     "attention (XLA products per block)"]


def test_mesh_context_in_the_config_and_the_mesh_spec():
    from rlbolt.config import ConfigError, load_config
    from rlbolt.distributed import MeshError, MeshSpec

    assert load_config({"mesh": {"context": 4, "fsdp": -1}}).mesh.context == 4
    with pytest.raises(ConfigError, match="mesh.context=0"):
        load_config({"mesh": {"context": 0}})
    assert MeshSpec(fsdp=-1, context=4).resolve(8) == (1, 2, 1, 4, 1)  # data, fsdp, expert, context, tp
    with pytest.raises(MeshError, match=r"needs 16 devices but 8 are visible; make data x fsdp x expert x context x tp"):
        MeshSpec(fsdp=4, context=4).resolve(8)
