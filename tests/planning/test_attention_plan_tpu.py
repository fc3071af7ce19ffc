"""model.attention on a TPU slice, compiled on this CPU with libtpu (`rlbolt plan`'s path): the
update's compiled scratch grows linearly with sequence length under flash (Pallas splash, under
shard_map over the slice's batch axes) and quadratically under xla. Marked `tpu` (run with -m tpu
in a venv with the rlbolt[tpu] extra); skipped without libtpu. Slow: one compile per point (about
10 to 60 s each on two cores)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from rlbolt.config import load_config  # noqa: E402
from plan_tiny import RUN  # noqa: E402

TOPOLOGY = "v5p:2x2x2"  # 8 chips: the 8 rows of a micro batch, one per chip


def _update_temp_bytes(attention: str, tokens: int) -> tuple[str, int]:
    from rlbolt.distributed.topology import target_devices
    from rlbolt.planning import build_abstract, plan_run

    config = {**RUN, "model": {**RUN["model"], "attention": attention,
                               "tiny": {**RUN["model"]["tiny"], "max_position_embeddings": 2 * tokens}},
              "data": {"max_prompt_tokens": tokens // 2}, "rollout": {"max_new_tokens": tokens // 2}}
    run = build_abstract(load_config(config), target_devices(TOPOLOGY))
    (update,) = plan_run(run, TOPOLOGY, names=("update",)).executables
    return run.module.model.attention_kernel, update.temp_bytes


def test_update_scratch_is_linear_in_length_with_flash_and_quadratic_with_xla():
    """Bytes of scratch per token: flat under flash from 2k to 8k tokens (measured 12.2 and 13.1 KiB,
    the compiler's layouts shift a little with shape: within 1.5x), growing with length under xla
    (136 KiB at 2k, 260 KiB at 4k: the [T, T] scores; >= 1.7x), and xla above flash by far at 4k."""
    flash = {t: _update_temp_bytes("flash", t) for t in (2048, 8192)}
    assert {kernel for kernel, _ in flash.values()} == {"splash"}  # flash resolved for the slice's platform
    per_token = {t: b / t for t, (_, b) in flash.items()}
    assert per_token[8192] <= 1.5 * per_token[2048], per_token
    xla = {t: _update_temp_bytes("xla", t) for t in (2048, 4096)}
    assert {kernel for kernel, _ in xla.values()} == {"xla"}
    assert xla[4096][1] / 4096 >= 1.7 * xla[2048][1] / 2048, xla
    assert xla[4096][1] / 4096 > 4 * per_token[8192], (xla, per_token)
