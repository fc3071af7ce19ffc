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


GEMMA3 = dict(architecture="Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh", norm_unit_offset=True,
              sandwich_norms=True, scale_embeddings=True, qk_norm=True, sliding_window=64, rope_local_theta=1000.0)


def _gemma3_run(layers: int):
    from rlbolt.distributed.topology import target_devices
    from rlbolt.planning import build_abstract

    kinds = ("sliding_attention", "sliding_attention", "full_attention") * (layers // 3)
    config = {**RUN, "model": {**RUN["model"], "attention": "flash", "scan_layers": True,
                               "tiny": {**RUN["model"]["tiny"], **GEMMA3, "num_layers": layers, "layer_types": kinds,
                                        "max_position_embeddings": 1024}},
              "data": {"max_prompt_tokens": 256}, "rollout": {"max_new_tokens": 256}}
    return build_abstract(load_config(config), target_devices(TOPOLOGY))


def test_gemma3_layers_scan_with_their_two_splash_kernels():
    """Gemma 3's sliding and full layers need two splash kernels (static masks); the scanned update picks
    the layer's in the body (a `case`), so its program does not grow with depth, and it compiles for
    the slice. Before, the two kernels sent the layers to the loop: the 6-layer program was longer
    than the 3-layer one and held no case."""
    from rlbolt.planning import plan_run
    from rlbolt.planning.compile import _lower_update

    texts = {layers: _lower_update(_gemma3_run(layers)).as_text() for layers in (3, 6)}
    assert "stablehlo.case" in texts[6]
    assert texts[6].count("\n") == texts[3].count("\n")  # one body whatever the depth
    run = _gemma3_run(6)
    assert run.module.model.attention_kernel == "splash"
    (update,) = plan_run(run, TOPOLOGY, names=("update",)).executables
    assert update.refused is None and update.temp_bytes > 0
