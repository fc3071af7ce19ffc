"""`rlbolt plan` with `mesh.context`: does one long sequence's update fit a TPU slice when the
sequence is split over `context` chips?

The rows of `plan_table.py` (Qwen2.5 and the other config.json shapes, GRPO beta 0.04, bf16, AdamW
with float32 masters, 512-token prompts) on `mesh: {context: N, fsdp: -1}`; 2 prompts x 4 samples per
step, the train micro batch one row per batch shard (chips / context; the 8 rows accumulated over
8 / shards micro batches), so each chip holds 1/N of one sequence at a time. Only the update
executable is compiled by default (the one that holds the long sequence's activations and gradients).
Every figure is the TPU compiler's buffer assignment or cost estimate for the described slice,
compiled on this CPU with libtpu (the rlbolt[tpu] extra): nothing runs on a TPU.

    python benchmarks/context_plan.py --rows qwen2.5-7b:32768:v5p:2x2x2:2 --remat full --scan [--layers 4]

Prints one line and one JSON record per row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

GIB = 1 << 30


def plan_context_row(model: str, tokens: int, topology: str, context: int, only: tuple[str, ...], remat: str,
                     scan: bool, layers: int | None) -> dict:
    """Builds and compiles one row on `{context, fsdp: -1}`; returns its JSON record."""
    from plan_table import MODELS, run_config

    from rlbolt.config import load_config
    from rlbolt.distributed.topology import target_devices
    from rlbolt.planning import build_abstract, plan_run

    devices = target_devices(topology)
    micro = len(devices) // context  # one row per batch shard
    with tempfile.TemporaryDirectory() as folder:
        shapes = MODELS[model] if layers is None else {**MODELS[model], "num_hidden_layers": layers}
        (Path(folder) / "config.json").write_text(json.dumps({**shapes, "max_position_embeddings": max(
            tokens, shapes["max_position_embeddings"])}))
        config = run_config(folder, tokens, micro, "moe" in MODELS[model]["model_type"], remat, scan)
        config["mesh"] = {**config["mesh"], "context": context}
        config["plan"] = {"prompts_per_step": 2, "num_generations": 4, "train_micro_batch_size": micro}
        started = time.perf_counter()
        run = build_abstract(load_config(config), devices)
        report = plan_run(run, topology, only)
    record = report.to_json()
    record.update(model=model, tokens=tokens, topology=topology, context=context, micro_batch=micro, remat=remat,
                  scan_layers=scan, layers=shapes["num_hidden_layers"], wall_seconds=time.perf_counter() - started)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", required=True, help="MODEL:TOKENS:TOPOLOGY:CONTEXT, e.g. "
                        "qwen2.5-7b:32768:v5p:2x2x2:2")
    parser.add_argument("--only", default="update")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--scan", action="store_true", help="model.scan_layers: true")
    parser.add_argument("--layers", type=int, default=None, help="a proxy with this many layers at full width")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from machine import cpu_model

    print(f"# {cpu_model()}; compiled with libtpu for each slice; memory is the compiler's buffer assignment")
    records = []
    for row in args.rows:
        parts = row.split(":")
        model, tokens, topology, context = parts[0], int(parts[1]), ":".join(parts[2:-1]), int(parts[-1])
        r = plan_context_row(model, tokens, topology, context, tuple(args.only.split(",")), args.remat, args.scan,
                             args.layers)
        records.append(r)
        update = next(e for e in r["executables"] if e["name"] == "update") if "update" in args.only else None
        temps = f"{update['temp_bytes'] / GIB:.2f}" if update else "-"
        print(f"{model} {tokens} {topology} context={context} micro={r['micro_batch']} layers={r['layers']}: "
              f"{'FITS' if r['fits'] else 'DOES NOT FIT'}, peak {r['peak_bytes'] / GIB:.2f} GiB, update temps "
              f"{temps} GiB, floor {r['floor_bytes'] / GIB:.2f} GiB, {r['wall_seconds']:.0f} s", flush=True)
    for r in records:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
