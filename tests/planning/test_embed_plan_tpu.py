"""The update compiled for a TPU slice moves no whole embedding table between chips (`rlbolt.models.embed_lookup`).

Read as an fsdp weight, the table [V, H] was all-gathered whole for the lookup and its gradient, a
scatter-add into a whole [V, H], all-reduced whole (benchmarks/RESULTS.md: 0.43 GiB each at Qwen2.5-1.5B
on v5e:4x4). Now each chip reads and forms only its [V, H / fsdp] shard: no collective of the compiled
update has a [V, H] result; nor an [H, V] one (the head reads its weight a vocabulary block at a time). Marked `tpu` (libtpu's compiler for v5e:2x2 on this CPU); skipped without libtpu.
"""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("libtpu")
pytestmark = pytest.mark.tpu
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from plan_tiny import H, I, RUN  # noqa: E402


def _collective_shapes(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every array in the results of the all-gathers, all-reduces and reduce-scatters."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"= (\(.*?\)|\S+) (all-gather|all-reduce|reduce-scatter)(-start)?\(", line)
        if m:
            out += [(dt, tuple(int(d) for d in dims.split(",")))
                    for dt, dims in re.findall(r"(\w+)\[([\d,]+)\]", m.group(1))]
    return out


def test_the_update_never_gathers_or_all_reduces_the_whole_embedding_table():
    from rlbolt.config import load_config
    from rlbolt.distributed.topology import target_devices
    from rlbolt.planning import build_abstract
    from rlbolt.planning.compile import _lower_update

    v = 384  # not plan_tiny's 256: the MLP's gate|up is [H, 256], which would match a [H, V] search
    # logits_chunk_tokens 32: the head's forward and backward each take several vocabulary blocks (with
    # the default 1,024 a tiny batch's one block is the whole [H, V] weight, gathered whole as it should be)
    model = {**RUN["model"], "remat": "full", "logits_chunk_tokens": 32, "tiny": {**RUN["model"]["tiny"], "vocab_size": v}}
    run = build_abstract(load_config({**RUN, "model": model}), target_devices("v5e:2x2"))
    assert run.sharding.mesh.shape["fsdp"] == 4
    shapes = _collective_shapes(_lower_update(run).compile().as_text())
    assert any(s[-2:] == (H, 2 * I) for _, s in shapes), "no layer weight gathered whole: the measure is blind"
    whole = [(dt, s) for dt, s in shapes if s[-2:] in ((v, H), (H, v))]
    assert not whole, f"a whole embedding table or head weight crosses the chips: {whole}"
