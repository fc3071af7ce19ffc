"""How grpo_step.py reads and prints a step's figures: each phase against its matmul-only bound,
update MFU and decode bandwidth against the device's data-sheet peaks, and the table it prints
beside its JSON line."""

from __future__ import annotations

from flops import decode_bytes


def phase_over_bound(split: dict, bound_times: dict) -> dict:
    """Each phase of the step against its products alone: rollout / (prefill + decode), logps / ref, update / update."""
    return {"rollout": split["rollout"] / (bound_times["prefill"] + bound_times["decode"]),
            "logps": split["logps"] / bound_times["ref"], "update": split["update"] / update_bound(bound_times)}


def update_bound(bound_times: dict) -> float:
    """The update's products: dense, plus attention's where measured (real shapes: `update_attention`)."""
    return bound_times["update"] + bound_times.get("update_attention", 0.0)


def utilisation(config, p: dict, flops: dict, split: dict) -> dict:
    """Update MFU and decode memory-bandwidth utilisation against the device's data-sheet peaks.

    Decode is bandwidth-bound: each of the C - 1 decode steps reads every weight once plus the KV
    cache filled so far (`flops.decode_bytes`). Rollout time includes the (compute-bound) prefill,
    so the utilisation is a lower bound. None where the peak is unknown (CPU).
    """
    import jax

    kind = jax.devices()[0].device_kind.lower()
    peak_flops = next((v for k, v in _PEAK_BF16_FLOPS.items() if k in kind), None)
    peak_bw = next((v for k, v in _PEAK_BYTES_PER_S.items() if k in kind), None)
    sequences = p["prompts"] * p["generations"]
    update_flops_per_s = flops["update"] / split["update"] if split["update"] else float("nan")
    read = decode_bytes(config, sequences, p["prompt_len"], p["new_tokens"])
    return {
        "update_gflops": update_flops_per_s / 1e9,
        "update_mfu": update_flops_per_s / peak_flops if peak_flops else None,
        "decode_gb_per_s": read / split["rollout"] / 1e9 if split["rollout"] else None,
        "decode_bw_util": read / split["rollout"] / peak_bw if peak_bw and split["rollout"] else None,
    }


# Data-sheet peaks (dense bf16 FLOP/s, HBM bytes/s) of the GPUs a session may be lent.
_PEAK_BF16_FLOPS = {"h200": 989e12, "h100": 989e12, "a100": 312e12}
_PEAK_BYTES_PER_S = {"h200": 4.8e12, "h100": 3.35e12, "a100": 2.0e12}


def print_table(r: dict, flops: dict) -> None:
    """Prints the step's figures `r` (grpo_step.py's result) as a table, with the FLOPs of each phase."""
    floor = r["floor_step_s"] is not None
    rows = [
        ("step s (median of the measured steps)", f"{r['step_s_median']:.3f}"),
        ("floor step s (bare loop)", f"{r['floor_step_s']:.3f}" if floor else "not run (--floor)"),
        ("overhead ratio (target <= 1.05)", f"{r['overhead_ratio']:.3f}" if floor else "-"),
        ("generated tokens / s", f"{r['gen_tokens_per_s']:.0f}"),
        ("GFLOP per step", f"{r['gflops_per_step']:.1f} (rollout {flops['rollout'] / 1e9:.1f}, ref {flops['ref'] / 1e9:.1f}, update {flops['update'] / 1e9:.1f})"),
        ("achieved GFLOP/s", f"{r['achieved_gflops']:.1f}"),
        ("matmul GFLOP/s (ceiling)", f"{r['matmul_gflops']:.1f}"),
        ("achieved / matmul (target >= 0.70)", f"{r['achieved_gflops'] / r['matmul_gflops']:.2f}"),
        *([("matmul-only bound s (ceiling.py)", f"{r['bound_step_s']:.3f} (best achieved / matmul {r['bound_ratio']:.2f})"),
           ("step / bound (target <= 1.30)", f"{r['step_over_bound']:.2f}"),
           *([("step / unshared bound", f"{r['step_over_unshared_bound']:.2f} (bound {r['unshared_bound_step_s']:.3f} s)")]
             if r["unshared_bound_step_s"] else []),
           *[(f"  bound {k}", f"{v:.3f}") for k, v in r["bound_split"].items()],
           *[(f"  {k} / its bound", f"{v:.2f}") for k, v in (r["phase_over_bound"] or {}).items()],
           *([("  update / its dense products only", f"{r['update_over_dense_bound']:.2f}")]
             if "update_attention" in r["bound_split"] else [])]
          if r["bound_step_s"] else []),
        ("shared prompt", f"{'on' if r['shared_prompt'] else 'off'} (duplicate prompt tokens of an unshared "
                          f"forward: {100 * r['duplicate_prompt_token_share']:.0f}%)"),
        ("compiles after warm-up (target 0)", str(r["compiles_after_warmup"])),
        ("peak RSS MB of fit (target <= 1000)", f"{r['peak_rss_mb']:.0f}"),
        ("load average at start / end", " / ".join(f"{x:.1f}" for x in (r["load_avg"][0], r["load_avg"][3]))
         + f" on {r['cpu_model']}"),
        ("trainable params", f"{r['trainable_params']:,}" + (f" (LoRA {r['lora']}, rollout {r['lora_rollout']})" if r["lora"] else "")),
        ("live device MB after fit", f"{r['live_mb']:.1f}"),
        ("update MB: scratch / arguments", f"{r['update_temp_mb']:.1f} / {r['update_arg_mb']:.1f}"),
        ("update GFLOP/s (MFU)", f"{r['update_gflops']:.1f} ({_pct(r['update_mfu'])})"),
        ("decode GB/s (of bandwidth peak)", f"{r['decode_gb_per_s']:.1f} ({_pct(r['decode_bw_util'])})"),
        *[(f"  time/{k} (floor)", f"{v:.3f} ({r['floor_split'][k]:.3f})" if k in r["floor_split"] else f"{v:.3f}")
          for k, v in r["split"].items()],
    ]
    width = max(len(k) for k, _ in rows)
    print(f"rlbolt GRPO step benchmark, preset {r['preset']} ({r['layers']} layers, vocab {r['vocab']}, "
          f"{r['sequences']} x {r['prompt_len']} + {r['completion']} tokens) on {r['device']} x {r['devices']}, mesh {r['mesh']}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def _pct(x) -> str:
    return "peak unknown" if x is None else f"{100 * x:.1f}%"
