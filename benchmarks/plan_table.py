"""`rlbolt plan` over the scale grid: does a GRPO run (beta > 0, bf16, AdamW) fit a TPU slice, and
how close is the compiled peak to the analytic floor?

Each row writes a config.json (the model's shapes only: nothing is downloaded, no weights exist)
and a run config into a temporary folder, builds the run abstractly and compiles its executables
for the slice with libtpu's TPU compiler on this CPU (the rlbolt[tpu] extra). Every time is the
compiler's cost-model estimate, not a measurement.

    python benchmarks/plan_table.py --rows qwen2.5-1.5b:4096:v5p:2x2x2 [--only update] [--micro 8]
    python benchmarks/plan_table.py --all          # the whole grid (hours of CPU with unrolled layers)

Prints a table, then one JSON line per row.
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
_QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "max_position_embeddings": 32768, "use_sliding_window": False,
          "torch_dtype": "bfloat16"}
MODELS = {  # Hugging Face config.json values (shapes only)
    "qwen2.5-1.5b": {**_QWEN2, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "tie_word_embeddings": True},
    "qwen2.5-7b": {**_QWEN2, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                   "tie_word_embeddings": False},
    "qwen2.5-32b": {**_QWEN2, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064,
                    "tie_word_embeddings": False},
    "qwen3-30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                      "max_position_embeddings": 40960, "tie_word_embeddings": False, "hidden_act": "silu",
                      "use_sliding_window": False, "torch_dtype": "bfloat16"},
    "gemma-3-12b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 3840,
                    "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
                    "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 262208, "sliding_window": 1024,
                    "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256,
                    "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "hidden_activation": "gelu_pytorch_tanh",
                    "tie_word_embeddings": True, "torch_dtype": "bfloat16"},
    "llama-3.1-70b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
                      "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu",
                      "torch_dtype": "bfloat16"},
}
LENGTHS = (4096, 16384, 32768)
TOPOLOGIES = ("v5e:4x4", "v5p:2x2x2", "v5p:4x4x4", "v6e:2x4")
PROMPT_TOKENS = 512


def run_config(folder: str, tokens: int, micro: int, moe: bool, remat: str = "none", scan: bool = False,
               moe_matmul: str = "auto", expert: int = 1, model_extra: dict | None = None) -> dict:
    """The GRPO run of one row: beta 0.04, bf16 parameters, AdamW, one micro batch per update
    (`model_extra`: more model settings, e.g. mlp_chunk_positions; None: the defaults)."""
    return {"algorithm": {"name": "grpo", "beta": 0.04, "lr": 1e-6},
            "model": {"path": folder, "param_dtype": "bfloat16", "remat": remat, "scan_layers": scan,
                      "moe_matmul": moe_matmul, **(model_extra or {})},
            "plan": {"prompts_per_step": micro // 4, "num_generations": 4, "train_micro_batch_size": micro},
            "data": {"max_prompt_tokens": PROMPT_TOKENS},
            "rollout": {"max_new_tokens": tokens - PROMPT_TOKENS},
            "mesh": {"fsdp": -1, **({"expert": expert} if moe else {})}}


def plan_row(model: str, tokens: int, topology: str, micro: int, only: tuple[str, ...], remat: str = "none",
             scan: bool = False, layers: int | None = None, moe_matmul: str = "auto", expert: int = 1,
             model_extra: dict | None = None) -> dict:
    """Builds and compiles one row (`layers`: a shallower proxy of the model at full width); returns its JSON record."""
    from rlbolt.config import load_config
    from rlbolt.distributed.topology import target_devices
    from rlbolt.planning import build_abstract, plan_run

    devices = target_devices(topology)
    micro = max(micro, len(devices))  # every batch shard gets at least one row
    with tempfile.TemporaryDirectory() as folder:
        shapes = MODELS[model] if layers is None else {**MODELS[model], "num_hidden_layers": layers}
        (Path(folder) / "config.json").write_text(json.dumps(shapes))
        cfg = load_config(run_config(folder, tokens, micro, "moe" in MODELS[model]["model_type"], remat, scan,
                                     moe_matmul, expert, model_extra))
        started = time.perf_counter()
        run = build_abstract(cfg, devices)
        report = plan_run(run, topology, only)
    record = report.to_json()
    record.update(model=model, tokens=tokens, topology=topology, micro_batch=micro, remat=remat, scan_layers=scan,
                  layers=shapes["num_hidden_layers"], moe_matmul=moe_matmul, expert=expert,
                  mlp_chunk_positions=cfg.model.mlp_chunk_positions, mlp_block_size=cfg.model.mlp_block_size,
                  expert_block_size=cfg.model.expert_block_size,
                  wall_seconds=time.perf_counter() - started)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=["qwen2.5-1.5b:4096:v5p:2x2x2"],
                        help="MODEL:TOKENS:TOPOLOGY rows, e.g. qwen2.5-7b:4096:v5p:2x2x2")
    parser.add_argument("--all", action="store_true", help="the whole grid")
    parser.add_argument("--micro", type=int, default=8, help="train micro batch (raised to the device count)")
    parser.add_argument("--only", default="update,optimizer,logps,rollout")
    parser.add_argument("--remat", default="none", help="model.remat for every row (none, full, dots_saveable, ...)")
    parser.add_argument("--scan", action="store_true", help="model.scan_layers: true (compile time flat in depth)")
    parser.add_argument("--layers", type=int, default=None, help="a proxy with this many layers at full width")
    parser.add_argument("--moe-matmul", default="auto", help="model.moe_matmul for MoE rows (auto, gmm, ragged_dot)")
    parser.add_argument("--mlp-chunk", type=int, default=None,
                        help="model.mlp_chunk_positions for every row (default: the config's)")
    parser.add_argument("--mlp-block", type=int, default=None,
                        help="model.mlp_block_size for every row (default: the config's; 0: whole MLP kernels)")
    parser.add_argument("--expert-block", type=int, default=None,
                        help="model.expert_block_size for MoE rows (default: the config's; 0: whole expert kernels)")
    parser.add_argument("--expert", type=int, default=1, help="mesh.expert for MoE rows (the rest of the chips: fsdp)")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = [(m, t, p) for m in MODELS for t in LENGTHS for p in TOPOLOGIES] if args.all else [
        (r.split(":")[0], int(r.split(":")[1]), ":".join(r.split(":")[2:])) for r in args.rows]
    from machine import cpu_model

    print(f"# {cpu_model()}; compiled with libtpu for each slice; times are compiler estimates")
    print(f"{'model':<15}{'tokens':>7} {'slice':<10}{'micro':>6} {'fits':<5}{'peak GiB':>9}{'floor GiB':>10}"
          f"{'ratio':>6}{'compile s':>10}{'step s (est.)':>14}{'MFU (est.)':>11}")
    records = []
    for model, tokens, topology in rows:
        r = plan_row(model, tokens, topology, args.micro, tuple(args.only.split(",")), args.remat, args.scan, args.layers,
                     args.moe_matmul, args.expert, {key: value for key, value in (
                         ("mlp_chunk_positions", args.mlp_chunk), ("mlp_block_size", args.mlp_block),
                         ("expert_block_size", args.expert_block)) if value is not None})
        records.append(r)
        step = f"{r['step_seconds_estimate']:.2f}" if r["step_seconds_estimate"] else "-"
        mfu = f"{r['mfu_estimate']:.1%}" if r["mfu_estimate"] else "-"
        compile_s = sum(e["compile_seconds"] for e in r["executables"])
        print(f"{model:<15}{tokens:>7} {topology:<10}{r['micro_batch']:>6} {'yes' if r['fits'] else 'no':<5}"
              f"{r['peak_bytes'] / GIB:>9.1f}{r['floor_bytes'] / GIB:>10.1f}{r['peak_bytes'] / r['floor_bytes']:>6.2f}"
              f"{compile_s:>10.0f}{step:>14}{mfu:>11}", flush=True)
    for r in records:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main())
