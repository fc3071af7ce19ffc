"""Compile time of the whole GRPO update against depth (`rlbolt plan`'s update executable): looped vs scanned
layers, on this CPU and for a TPU slice (`benchmarks/compile_depth.py` times the gradient alone on this CPU).
Scanned layers come in two storages: `stacked` (what a run with `model.scan_layers` does: one [L, ...]
array per parameter kind, `rlbolt.models.stacked_layers`) and `per_layer` (the layers stored one by
one and stacked inside the update at every forward, as before stacked storage).

Each row writes a small Qwen2-shaped config.json (width 512; no weights exist), builds the run
abstractly and compiles only the update executable (`rlbolt.planning`): with `--target host` for
this process's CPU device, with `--target v5p:2x2x2` (any slice name) with libtpu's TPU compiler.
Rows run interleaved (every depth and layout once per round) so a load change on a shared box
hits them alike; the table gives the median over the rounds.

    python benchmarks/update_compile_depth.py --layers 2 8 28 --targets host v5p:2x2x2 --rounds 3 \
        --variants looped per_layer stacked
    python benchmarks/update_compile_depth.py --model qwen2.5-7b --layers 28 --targets v5p:2x2x2 \
        --variants before stacked --rounds 3      # the planner issue's 7B update, as found and now

Prints one JSON line per compile, then the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SMALL = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6,
         "rope_theta": 1000000.0, "max_position_embeddings": 4096, "use_sliding_window": False,
         "torch_dtype": "bfloat16", "hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 32000, "tie_word_embeddings": False}


# scan off; scanned with per-layer storage; scanned, stored stacked; and "before": the update as the
# planner issue found it (layers looped, the attention's query chunks unrolled, XLA attention, no remat)
VARIANTS = ("looped", "per_layer", "stacked", "before")


def compile_update(layers: int, variant: str, target: str, tokens: int, remat: str, model: str | None = None) -> float:
    """Seconds to build the abstract run and compile its update (lowering included).

    `model`: a `plan_table.MODELS` name (its real widths, `layers` of its layers), or None for the
    width-512 model above."""
    from plan_table import MODELS, run_config

    import rlbolt.models.attention_chunks as attention_chunks
    import rlbolt.modules.policy_setup as policy_setup
    from rlbolt.config import load_config
    from rlbolt.distributed.topology import target_devices
    from rlbolt.planning import build_abstract, plan_run

    devices = target_devices(None if target == "host" else target)
    micro = max(8, len(devices))
    stack, groups = policy_setup.stack_layers, attention_chunks.CHUNK_GROUPS
    if variant == "per_layer":  # the layers stay stored per layer: the scan stacks them in every forward
        policy_setup.stack_layers = lambda model: model
    if variant == "before":  # every query chunk its own copy in the program (CHUNK_GROUPS past the chunk count)
        attention_chunks.CHUNK_GROUPS = 10 ** 6
    shape = SMALL if model is None else MODELS[model]
    try:
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "config.json").write_text(json.dumps({**shape, "num_hidden_layers": layers}))
            cfg = run_config(folder, tokens, micro, False, "none" if variant == "before" else remat,
                             variant in ("per_layer", "stacked"))
            if variant == "before":
                cfg["model"]["attention"] = "xla"
            run = build_abstract(load_config(cfg), devices)
            report = plan_run(run, target, ("update",))
    finally:
        policy_setup.stack_layers, attention_chunks.CHUNK_GROUPS = stack, groups
    return report.executables[0].compile_seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 28])
    parser.add_argument("--targets", nargs="+", default=["host", "v5p:2x2x2"], help="host, or TPU slice names")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sequence (512 of them prompt)")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS[:3]), choices=VARIANTS)
    parser.add_argument("--model", default=None, help="a plan_table.py model name (real widths); default width 512")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from machine import cpu_model

    print(f"# {cpu_model()}; update compile seconds (wall, lowering + compile)", flush=True)
    times: dict[tuple, list[float]] = {}
    for _ in range(args.rounds):
        for target in args.targets:
            for layers in args.layers:
                for variant in args.variants:
                    seconds = compile_update(layers, variant, target, args.tokens, args.remat, args.model)
                    times.setdefault((target, layers, variant), []).append(seconds)
                    print(json.dumps({"target": target, "layers": layers, "variant": variant, "seconds": seconds,
                                      "load": os.getloadavg()[0]}), flush=True)
    print(f"{'target':<12}{'layers':>7}" + "".join(f"{v + ' s':>13}" for v in args.variants))
    for target in args.targets:
        for layers in args.layers:
            medians = (statistics.median(times[(target, layers, v)]) for v in args.variants)
            print(f"{target:<12}{layers:>7}" + "".join(f"{m:>13.1f}" for m in medians))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
