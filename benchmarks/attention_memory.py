"""The update's compiled scratch per device against sequence length, `model.attention` flash vs xla,
compiled for a TPU slice with libtpu on this CPU (`rlbolt plan`'s path; the rlbolt[tpu] extra).

The tiny planner run (tests/plan_tiny.py: H=64, 2 layers, 4/2 heads of 16, bfloat16, GRPO with a
reference; 8 rows, one per chip of v5p:2x2x2), half prompt and half completion. Nothing runs: the
figures are the TPU compiler's buffer assignment. A length the compiler refuses for memory is
printed as refused with the bytes it asked for.

    python benchmarks/attention_memory.py [--flash 1024,...,131072] [--xla 1024,...,8192]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from machine import cpu_model  # noqa: E402  (benchmarks/machine.py)

TOPOLOGY = "v5p:2x2x2"
MB = 1e6


def scratch(attention: str, tokens: int) -> dict:
    """The update executable's temporaries per device for one length (or the compiler's refusal)."""
    from plan_tiny import RUN

    from rlbolt.config import load_config
    from rlbolt.distributed.topology import target_devices
    from rlbolt.planning import build_abstract, plan_run

    config = {**RUN, "model": {**RUN["model"], "attention": attention,
                               "tiny": {**RUN["model"]["tiny"], "max_position_embeddings": 2 * tokens}},
              "data": {"max_prompt_tokens": tokens // 2}, "rollout": {"max_new_tokens": tokens // 2}}
    started = time.perf_counter()
    run = build_abstract(load_config(config), target_devices(TOPOLOGY))
    (update,) = plan_run(run, TOPOLOGY, names=("update",)).executables
    return {"attention": attention, "kernel": run.module.model.attention_kernel, "tokens": tokens,
            "temp_mb": round(update.temp_bytes / MB, 1), "refused": update.refused is not None,
            "compile_s": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> None:
    """Compiles each length and prints the table and a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    lengths = lambda text: [int(t) for t in text.split(",") if t]  # noqa: E731
    parser.add_argument("--flash", type=lengths, default=lengths("1024,4096,16384,32768,65536,131072"))
    parser.add_argument("--xla", type=lengths, default=lengths("1024,2048,4096,8192"))
    args = parser.parse_args(argv)
    rows = [scratch("flash", t) for t in args.flash] + [scratch("xla", t) for t in args.xla]
    print(f"update scratch per device, {TOPOLOGY} (TPU compiler on {cpu_model()})")
    print("| attention | tokens | scratch MB | KiB per token | compiled | compile s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['attention']} ({r['kernel']}) | {r['tokens']:,} | {r['temp_mb']:,.1f} | "
              f"{r['temp_mb'] * MB / r['tokens'] / 1024:.1f} | {'refused: asked' if r['refused'] else 'yes'} | {r['compile_s']} |")
    print(json.dumps({"benchmark": "attention_memory", "topology": TOPOLOGY, "cpu": cpu_model(), "rows": rows}))


if __name__ == "__main__":
    main()
