"""What fits on one 24 GB or 80 GB GPU: the memory plan's own numbers for real model shapes.

For Qwen2.5-0.5B / 1.5B / 3B and Llama-3-8B shapes (bfloat16 parameters) this builds each model
abstractly (`nnx.eval_shape`: shapes and dtypes, no weights allocated, nothing downloaded), the
optimizer state the LM modules use (AdamW after global-norm clipping) with `jax.eval_shape`, and
asks `rlbolt.distributed.memory.plan_memory` for the per-device items the Trainer logs before
anything compiles: params, gradients, the float32 master weights of bfloat16 params (the default
`model.master_weights: auto`; gradients are then float32 too), optimizer state, the KL reference or LoRA's frozen base,
and the sampler's KV cache (`kv_cache_bytes`) for one rollout micro batch. Three set-ups:

    full   every parameter trained, KL reference copy kept (algorithm.beta > 0)
    lora   rank-16 adapters on all seven projections, the base frozen (its own KL reference)
    qlora  the same with the frozen base stored as nf4 (qwix)

Activations and compiler scratch are NOT in the plan (they grow with the train / logps micro
batch sizes, which are the knobs to turn), so "fits" below means the plan leaves at least
25% of the card for them; "tight" means the plan alone fits but leaves less; "no" means the
Trainer would refuse it. Nothing here was measured on a GPU.

    python benchmarks/memory_table.py [--rollout-rows 32] [--prompt-tokens 256] [--new-tokens 512]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json

GIB = 1 << 30
# Hugging Face config.json values of each model (the shapes only; no file is read).
MODELS = {
    "0.5B (Qwen2.5)": dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                           head_dim=64, intermediate_size=4864, tie_word_embeddings=True, attention_bias=True,
                           architecture="Qwen2ForCausalLM"),
    "1.5B (Qwen2.5)": dict(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2,
                           head_dim=128, intermediate_size=8960, tie_word_embeddings=True, attention_bias=True,
                           architecture="Qwen2ForCausalLM"),
    "3B (Qwen2.5)": dict(vocab_size=151936, hidden_size=2048, num_layers=36, num_heads=16, num_kv_heads=2,
                         head_dim=128, intermediate_size=11008, tie_word_embeddings=True, attention_bias=True,
                         architecture="Qwen2ForCausalLM"),
    "8B (Llama 3)": dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                         head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
                         architecture="LlamaForCausalLM"),
}
SETUPS = ("full", "lora", "qlora")
CARDS = {"24 GB": 24 * 10**9, "80 GB": 80 * 10**9}
HEADROOM = 0.25  # share of the card left for activations before a plan counts as "fits"


def fit_word(total: int, card: int) -> str:
    """'fits', 'tight' or 'no' for a plan total on a card of `card` bytes."""
    if total > card:
        return "no"
    return "fits" if total <= (1 - HEADROOM) * card else "tight"


def plan_items(shape: dict, setup: str, rollout_rows: int, max_len: int, sharding) -> dict[str, int]:
    """The memory plan's items (bytes on one device) for one model and set-up.

    Args:
      shape: ModelConfig fields (one of MODELS' values); parameters are bfloat16.
      setup: "full", "lora" or "qlora".
      rollout_rows: plan.rollout_micro_batch_size (the sampler pads it to a power of two).
      max_len: the KV cache's slots (prompt tokens + new tokens - 1).
      sharding: the ShardingPlan of the device (one device here).
    """
    import jax
    import optax
    from flax import nnx

    from rlbolt import master_weights
    from rlbolt.distributed.memory import kv_cache_bytes, plan_memory
    from rlbolt.distributed.sharding import per_device_bytes
    from rlbolt.models.config import ModelConfig
    from rlbolt.models.decoder import Decoder
    from rlbolt.models.lora import LoraConfig, apply_lora
    from rlbolt.models.quantize import quantize_base

    config = ModelConfig(**shape, param_dtype="bfloat16")
    # What the LM modules' configure_optimizers builds (AdamW after clipping; the lr is irrelevant).
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6))
    if setup == "full":
        model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
        trainable = nnx.state(model, nnx.Param)
        extra = {"reference": per_device_bytes(trainable)}  # beta > 0: a frozen copy of the initial weights
    else:
        lora = LoraConfig.from_mapping({"rank": 16, "alpha": 32, "quantize": "nf4" if setup == "qlora" else None})

        def build():
            adapted = apply_lora(Decoder(config, rngs=nnx.Rngs(0)), lora, rngs=nnx.Rngs(1))
            return quantize_base(adapted, "nf4") if setup == "qlora" else adapted

        model = nnx.eval_shape(build)
        trainable = nnx.state(model, nnx.LoRAParam)
        base = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
        extra = {"frozen base": per_device_bytes(base)}
    optimizer = master_weights.wrap(optimizer, trainable, "auto")  # the default: float32 masters for bf16 params
    opt_state = jax.eval_shape(optimizer.init, trainable)
    rows = 1 << max(0, (rollout_rows - 1).bit_length())  # the sampler pads a call to a power of two
    extra["kv cache"] = kv_cache_bytes(config, rows, max_len, sharding)
    return dict(plan_memory(sharding, trainable, opt_state, extra, device_bytes=0).items)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rollout-rows", type=int, default=32, help="plan.rollout_micro_batch_size (default 32)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="data.max_prompt_tokens (default 256)")
    ap.add_argument("--new-tokens", type=int, default=512, help="rollout.max_new_tokens (default 512)")
    ap.add_argument("--models", nargs="*", default=list(MODELS), help="a subset of the model names")
    args = ap.parse_args(argv)

    from rlbolt.distributed.mesh import as_mesh
    from rlbolt.distributed.sharding import ShardingPlan

    sharding = ShardingPlan(as_mesh({"data": 1, "fsdp": 1, "tp": 1}))  # one device
    max_len = args.prompt_tokens + args.new_tokens - 1  # the sampler's cache slots
    rows, out = [], {"rollout_rows": args.rollout_rows, "prompt_tokens": args.prompt_tokens,
                     "new_tokens": args.new_tokens, "plans": {}}
    for name in args.models:
        for setup in SETUPS:
            items = plan_items(MODELS[name], setup, args.rollout_rows, max_len, sharding)
            total = sum(items.values())
            out["plans"][f"{name} {setup}"] = {k: round(v / GIB, 3) for k, v in items.items()} | {
                "total_gib": round(total / GIB, 2)}
            rows.append((name, setup, items, total))

    print(f"Memory plan per device (GiB; bf16 params, AdamW, rollout micro batch {args.rollout_rows} rows x "
          f"{max_len} cache slots); activations come on top")
    print("| model | set-up | trainable | gradients | float32 masters | optimizer | reference / frozen base | kv cache "
          "| total | " + " | ".join(CARDS) + " |")
    print("|---|---|---|---|---|---|---|---|---|" + "---|" * len(CARDS))
    for name, setup, items, total in rows:
        held = items.get("reference", items.get("frozen base", 0))
        cells = [items["params"], items["gradients"], items.get("master weights", 0), items["optimizer state"], held,
                 items["kv cache"], total]
        words = [fit_word(total, card) for card in CARDS.values()]
        print(f"| {name} | {setup} | " + " | ".join(f"{c / GIB:.2f}" for c in cells) + " | " + " | ".join(words) + " |")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
