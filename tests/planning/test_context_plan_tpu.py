"""mesh.context on a TPU slice, compiled on this CPU with libtpu (`rlbolt plan`'s path): the ring
(`rlbolt.models.context_attention`, `shard_map` + `ppermute`) compiles for the slice, and a long
sequence's update needs less memory per chip on context 2 than on context 1. Marked `tpu` (run with
-m tpu in a venv with the rlbolt[tpu] extra); skipped without libtpu. Slow: one compile per point
(minutes each on two loaded cores)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from rlbolt.config import load_config  # noqa: E402
from plan_tiny import RUN  # noqa: E402

TOPOLOGY = "v5e:2x2"  # 4 chips, one host
TOKENS = 4096


def _plan(context: int):
    """The tiny run's update at TOKENS per row with XLA attention on {context, fsdp: 4 / context}: 2 prompts
    x 4 samples, the train micro batch one row per batch shard (a chip holds 1 / context of one row)."""
    from rlbolt.distributed.topology import target_devices
    from rlbolt.planning import build_abstract, plan_run

    shards = 4 // context
    config = {**RUN, "model": {**RUN["model"], "attention": "xla",
                               "tiny": {**RUN["model"]["tiny"], "max_position_embeddings": 2 * TOKENS}},
              "plan": {"prompts_per_step": 2, "num_generations": 4, "train_micro_batch_size": shards},
              "data": {"max_prompt_tokens": TOKENS // 2}, "rollout": {"max_new_tokens": TOKENS // 2},
              "mesh": {"context": context, "fsdp": -1}}
    run = build_abstract(load_config(config), target_devices(TOPOLOGY))
    return run, plan_run(run, TOPOLOGY, names=("update",))


def test_context_2_update_compiles_for_the_slice_and_holds_less_than_context_1():
    """Both with the same XLA attention products: context 1 keeps a row's [T, T] scores per chip for the
    backward (quadratic in T), the ring a (512 x T/2) block at a time and the sequence's keys and
    values (linear). Measured (libtpu 0.0.42.1): update temporaries 631.7 MiB on context 1 against 25.6 MiB
    on context 2, peaks 648.4 and 44.6 MiB. Against splash on context 1 the tiny model's ring is larger (benchmarks/RESULTS.md)."""
    one_run, one = _plan(1)
    two_run, two = _plan(2)
    assert dict(two_run.sharding.mesh.shape) == {"data": 1, "fsdp": 2, "expert": 1, "context": 2, "tp": 1}
    assert two_run.module.model.token_sharding is not None  # the residual stream's tokens split over context
    (u1,), (u2,) = one.executables, two.executables
    assert u1.refused is None and u2.refused is None
    # The floor counts half a row's residuals per chip on context 2 (one row per batch shard both times):
    # L x T/2 x H x 2 bytes against L x T x H x 2.
    h, layers = RUN["model"]["tiny"]["hidden_size"], RUN["model"]["tiny"]["num_layers"]
    assert one.floor_bytes - sum(one.state.values()) == layers * TOKENS * h * 2
    assert two.floor_bytes - sum(two.state.values()) == layers * TOKENS // 2 * h * 2
    # Per chip the ring's update holds far less than context 1's quadratic scores: under a tenth.
    assert 10 * u2.temp_bytes < u1.temp_bytes, (u2.temp_bytes, u1.temp_bytes)
    assert two.peak_bytes < one.peak_bytes
