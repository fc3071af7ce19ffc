"""GRPO step benchmark: the shared workload run through the public API, as a user would.

Workload (benchmarks/WORKLOAD.md): a Llama-style random model (vocab 512, hidden 256, 4 layers,
4 q heads / 2 kv heads, head_dim 64, MLP 704, float32), 8 prompts x 4 generations of 32-token
prompts, 64 new tokens with no early stop, beta 0.04 (a frozen reference copy), eps 0.2, mu 1,
one optimizer update per step, AdamW lr 1e-6, reward = fraction of even completion ids.

Reported (medians over steps 3..12): seconds per step, generated tokens/s, the stage split,
compilations after warm-up, achieved GFLOP/s against a large matmul timed in the same process,
and `floor_step_s`: the same jitted functions called in a bare Python loop (no Trainer, thread
or callbacks), so `overhead_ratio = step / floor` is what the framework costs. On the CPU preset
it also times the step's dense products alone at the step's shapes (benchmarks/ceiling.py):
`bound_ratio` is the best `achieved / matmul` any implementation could reach on this machine, and
`step_over_bound` how far this step is from that bound.

The prompt runs once per group (model.share_prompt, `shared_prompt: true`) unless
`--no-share-prompt`: the FLOPs and the bound then count the products the shared step computes
(fewer), and `step_over_unshared_bound` sets the step against the old unshared bound too.

    python benchmarks/grpo_step.py            # the CPU workload, 12 steps
    python benchmarks/grpo_step.py --quick    # 2 steps (CI keeps it from rotting; numbers not asserted)
    python benchmarks/grpo_step.py --no-share-prompt   # every sample runs its own prompt (the A/B)
    python benchmarks/grpo_step.py --preset gpu   # Qwen2.5-0.5B shape, bf16, 64x8, 256 + 512 tokens
    python benchmarks/grpo_step.py --preset smollm2   # real shapes on CPU: 32, 128, 512 new tokens (real_shapes.py)
    python benchmarks/grpo_step.py --preset smollm2 --completion 128   # one length, in this process
    python benchmarks/grpo_step.py --lora 8       # LoRA rank 8 (alpha 16) on all seven projections
    python benchmarks/grpo_step.py --lora 8 --lora-quantize nf4   # QLoRA: the base stored in 4 bits by qwix
    python benchmarks/grpo_step.py --lora 8 --lora-rollout adapters  # adapters on the fly in the sampler
    python benchmarks/grpo_step.py --preset gpu --mesh '{"fsdp": 8}'    # on every GPU of the host
    python benchmarks/grpo_step.py --devices 4 --mesh '{"fsdp": 2, "tp": 2}'   # 4 CPU "devices"

`--mesh` takes rlbolt's `{data, fsdp, tp}` (-1: the rest; default: every device on fsdp);
`--devices N` makes the CPU backend show N devices (they share the machine's cores).
With --lora the GFLOP figures still count the full fine-tuning update (the base's weight gradients
a LoRA step skips), so compare LoRA and full fine-tuning by seconds and bytes. Memory fields:
`live_mb`, the distinct device buffers alive after fit (weights, reference, optimizer state),
and `update_temp_mb` / `update_arg_mb`, the update executable's scratch and argument bytes
(XLA's compiled memory analysis). The printed table, the phase / bound ratios and the
utilisation against data-sheet peaks are step_report.py's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceiling import measure_bound, time_calls  # noqa: E402
from flops import duplicate_prompt_share, step_flops  # noqa: E402
from machine import cpu_model  # noqa: E402
from shapes import chat_prompt_ids, smollm2_135m_config  # noqa: E402
from step_report import phase_over_bound, print_table, update_bound, utilisation  # noqa: E402

PRESETS = {
    "cpu": dict(prompts=8, generations=4, prompt_len=32, new_tokens=64, steps=12, train_micro=8, model={}),
    "gpu": dict(prompts=64, generations=8, prompt_len=256, new_tokens=512, steps=12, train_micro=32, model=dict(
        vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
        intermediate_size=4864, rope_theta=1_000_000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True, param_dtype="bfloat16", architecture="Qwen2ForCausalLM")),
    # SmolLM2-135M's architecture (benchmarks/shapes.py), float32, 48-token ChatML-shaped prompts,
    # one process per completion length (real_shapes.py). Train micro 4 at 512 new tokens: 8 rows
    # of 560 tokens keep ~7 GB of activations through 30 layers. Steps 2..3 are measured.
    "smollm2": dict(prompts=8, generations=4, prompt_len=48, completions=(32, 128, 512), steps=3, warmup=1,
                    train_micro={32: 8, 128: 8, 512: 4}, model="smollm2"),
}


def main(argv=None) -> dict:
    args = _parse(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    p = dict(PRESETS[args.preset])
    if "completions" in p and args.completion is None:  # every length, each in its own process
        from real_shapes import run_lengths

        return run_lengths(Path(__file__).resolve(), argv if argv is not None else sys.argv[1:],
                           (32,) if args.quick else p["completions"], args.rounds)
    load_start = os.getloadavg()
    applied = configure_xla_flags(enable=not args.no_xla_flags)
    import jax

    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np
    from flax import nnx

    from rlbolt.callback import Callback
    from rlbolt.data.tokenizers import IntTokenizer
    from rlbolt.models import Decoder, workload_config
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    real = p["model"] == "smollm2"
    if args.completion is not None:
        p["new_tokens"] = args.completion
    train_micro = p["train_micro"]
    if isinstance(train_micro, dict):  # per completion length
        train_micro = train_micro.get(p["new_tokens"], min(train_micro.values()))
    steps = 2 if args.quick else args.steps or p["steps"]
    if real:  # --quick: 2 layers (the 49k vocabulary kept), so CI can afford it
        config = smollm2_135m_config(**({"num_layers": 2} if args.quick else {}))
    else:
        config = workload_config(**p["model"])
    vocab = config.vocab_size
    rng = np.random.default_rng(0)
    if real:
        rows = [{"prompt": " ".join(map(str, chat_prompt_ids(rng, vocab, p["prompt_len"])))}
                for _ in range(p["prompts"] * steps)]
    else:
        rows = [{"prompt": " ".join(map(str, rng.integers(2, vocab, p["prompt_len"])))} for _ in range(p["prompts"] * steps)]

    def even_fraction(completion: str, sample) -> float:
        ids = completion.split()
        return sum(int(t) % 2 == 0 for t in ids) / max(len(ids), 1)

    lora = None if args.lora is None else {"rank": args.lora, "alpha": 2.0 * args.lora, "quantize": args.lora_quantize,
                                           "rollout": args.lora_rollout}
    module = GRPO(
        {"model": {"lora": lora, "share_prompt": not args.no_share_prompt, "attention": args.attention,
                   "remat": args.remat},
         "algorithm": {"beta": 0.04, "lr": 1e-6, "clip_low": 0.2, "clip_high": 0.2, "max_grad_norm": 0.0},
         "rollout": {"max_new_tokens": p["new_tokens"], "temperature": 1.0, "stop_at_eos": False},
         "data": {"prompt_field": "prompt", "max_prompt_tokens": p["prompt_len"], "use_chat_template": False}},
        model=Decoder(config, rngs=nnx.Rngs(0)), tokenizer=IntTokenizer(vocab), reward=even_fraction)

    compiles: list[int] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, *a, **k: compiles.append(1) if event == "/jax/core/compile/backend_compile_duration" else None)

    class Record(Callback):
        def __init__(self):
            self.metrics, self.compiles_at, self.last = [], [], None

        def on_rollout_end(self, run, rollout):
            self.last = rollout

        def on_step_end(self, run, info):
            self.metrics.append(info.metrics)
            self.compiles_at.append(len(compiles))

    rec = Record()
    # One optimizer update per step (mini batch = global batch) with the gradient accumulated
    # over train micro batches (cpu: 8): the same update, a 5x smaller activation footprint,
    # and no slower on this CPU (RESULTS.md).
    plan = BatchPlan(prompts_per_step=p["prompts"], num_generations=p["generations"],
                     train_micro_batch_size=args.train_micro or train_micro, logps_micro_batch_size=args.logps_micro)
    trainer = Trainer(plan, max_steps=steps, seed=0, shuffle=False, mesh=json.loads(args.mesh) if args.mesh else None)
    trainer.callbacks = type(trainer.callbacks)([rec])
    state = trainer.fit(module, rows)
    fit_peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the floor loop adds its own
    memory = _memory(trainer, state, rec.last)

    warmup = p.get("warmup", 2)
    measured = slice(warmup, None) if steps > warmup else slice(0, None)  # steps 3..12 (1-based); smollm2 2..3
    step_s = [m["time/step"] for m in rec.metrics]
    split = {k: _median([m[f"time/{k}"] for m in rec.metrics[measured]]) for k in ("rollout", "logps", "reward", "update")}
    step_median = _median(step_s[measured])
    split["other"] = max(step_median - sum(split.values()), 0.0)
    if real and not args.floor:  # a bare loop of the same calls costs more steps again at these shapes
        floor, floor_split = None, {}
    else:
        floor, floor_split = _floor_step_s(module, trainer, state, rec.last, repeats=max(3, len(step_s[measured])))
    matmul = _matmul_gflops(args.preset)
    sequences, group = p["prompts"] * p["generations"], p["generations"]
    shared = module.train_group_size > 1  # the training forward shares (so do rollout and logps here)
    flops = step_flops(config, sequences, p["prompt_len"], p["new_tokens"], group if shared else 1)
    unshared_flops = step_flops(config, sequences, p["prompt_len"], p["new_tokens"])
    bound = unshared_bound = None
    if args.preset == "cpu" and not args.no_bound:  # f32 products; on a GPU, update MFU and decode bandwidth say this
        measure = lambda g: measure_bound(config, sequences, p["prompt_len"], p["new_tokens"],  # noqa: E731
                                          repeats=2 if args.quick else 7, matmul_gflops=matmul, group=g)
        bound = measure(group if shared else 1)
        unshared_bound = measure(1) if shared else bound
    elif real and not args.no_bound:  # ref and update in train-micro pieces, 32 decode steps scaled to C - 1
        bound = measure_bound(config, sequences, p["prompt_len"], p["new_tokens"], repeats=1 if args.quick else 3,
                              matmul_gflops=matmul, group=group if shared else 1,
                              pieces=sequences // plan.train_micro_batch_size, decode_steps=4 if args.quick else 32,
                              attention=True)
    gen_tokens = p["prompts"] * p["generations"] * p["new_tokens"]
    result = {
        "system": "rlbolt",
        "preset": args.preset,
        "device": jax.devices()[0].device_kind,
        "devices": jax.device_count(),
        "mesh": dict(trainer.sharding.mesh.shape),
        "memory_plan_bytes": trainer.memory_plan.items,
        "xla_flags": applied,
        "step_s_median": step_median,
        "step_s_all": step_s,
        "gen_tokens_per_s": gen_tokens / step_median,
        "peak_rss_mb": fit_peak_rss_mb,
        "split": split,
        "compiles_after_warmup": rec.compiles_at[-1] - rec.compiles_at[min(1, len(rec.compiles_at) - 1)],
        "gflops_per_step": flops["total"] / 1e9,
        "achieved_gflops": flops["total"] / 1e9 / step_median,
        "matmul_gflops": matmul,
        "floor_step_s": floor,
        "floor_split": floor_split,
        "overhead_ratio": floor and step_median / floor,
        "bound_step_s": bound and bound["bound_step_s"],
        "bound_ratio": bound and bound["bound_ratio"],
        "step_over_bound": bound and step_median / bound["bound_step_s"],
        "bound_split": bound and bound["times_s"],
        "shared_prompt": shared,
        "duplicate_prompt_token_share": duplicate_prompt_share(sequences, p["prompt_len"], p["new_tokens"], group),
        "gflops_per_step_unshared": unshared_flops["total"] / 1e9,
        "unshared_bound_step_s": unshared_bound and unshared_bound["bound_step_s"],
        "step_over_unshared_bound": unshared_bound and step_median / unshared_bound["bound_step_s"],
        "reward_first_last": [rec.metrics[0]["reward/mean"], rec.metrics[-1]["reward/mean"]],
        "lora": lora,
        "attention": args.attention,
        "attention_kernel": str(module.model.attention_kernel),
        "remat": args.remat,
        "lora_rollout": module.lora.config.rollout if lora else None,
        "trainable_params": sum(x.size for x in jax.tree.leaves(state.params)),
        "completion": p["new_tokens"],
        "prompt_len": p["prompt_len"],
        "sequences": sequences,
        "train_micro": plan.train_micro_batch_size,
        "layers": config.num_layers,
        "vocab": vocab,
        "phase_over_bound": bound and phase_over_bound(split, bound["times_s"]),
        "update_over_bound": bound and split["update"] / update_bound(bound["times_s"]),
        "update_over_dense_bound": bound and split["update"] / bound["times_s"]["update"],
        "cpu_model": cpu_model(),
        "load_avg": [*load_start, *os.getloadavg()],  # 1/5/15-min load at the start, then at the end
        **memory,
        **utilisation(config, p, flops, split),
    }
    print_table(result, flops)
    print(json.dumps(result))
    return result


def _floor_step_s(module, trainer, state, produced, repeats: int) -> tuple[float, dict]:
    """The same jitted work as a step (sampler, reference logps, update), in a bare loop.

    Returns the median round time and the median of each phase (the host waits for each phase,
    as a step does), to set against the step's own split.
    """
    import jax
    import numpy as np

    from rlbolt.distributed.layout import micro_batches

    batch = produced.batch
    ids = [list(r[m]) for r, m in zip(np.asarray(batch["prompt_ids"]), np.asarray(batch["prompt_mask"]))]
    keys = np.asarray(batch["sample_keys"], np.uint32)
    device_batch = micro_batches(trainer.sharding, batch.numeric().to_host(), trainer.plan.grad_accum_steps)
    rounds = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out = module.rollout.generate(state.params, ids, keys, module.rollout_cfg.temperature).output
        t1 = time.perf_counter()
        rolled = batch.with_columns(completion_ids=out.completion_ids, completion_mask=out.completion_mask)
        module.scorers["ref"].logps(rolled)  # host rows: waits for the device (LoRA: the base, adapters off)
        t2 = time.perf_counter()
        # The update donates its inputs (their arrays are deleted): the next round runs on its outputs.
        params, opt_state, _ = jax.block_until_ready(trainer._update(state.params, state.opt_state, device_batch))
        state = state.replace(params=params, opt_state=opt_state)
        t3 = time.perf_counter()
        if i:  # the first round re-warms caches after fit
            rounds.append((t3 - t0, t1 - t0, t2 - t1, t3 - t2))
    total, rollout, logps, update = (_median(column) for column in zip(*rounds))
    return total, {"rollout": rollout, "logps": logps, "update": update}


def _memory(trainer, state, produced) -> dict:
    """Device bytes: distinct live buffers after fit, and the update executable's own figures."""
    import gc

    import jax

    gc.collect()
    live = {shard.data.unsafe_buffer_pointer(): shard.data.nbytes  # per shard: a mesh's arrays are sharded
            for x in jax.live_arrays() if not x.is_deleted() for shard in x.addressable_shards}
    from rlbolt.distributed.layout import micro_batches

    batch = micro_batches(trainer.sharding, produced.batch.numeric().to_host(), trainer.plan.grad_accum_steps)
    compiled = trainer._update.func.lower(state.params, state.opt_state, batch,
                                          frozen=trainer._update.keywords["frozen"]).compile()
    stats = compiled.memory_analysis()
    return {"live_mb": sum(live.values()) / 2 ** 20, "update_temp_mb": stats.temp_size_in_bytes / 2 ** 20,
            "update_arg_mb": stats.argument_size_in_bytes / 2 ** 20}


def _matmul_gflops(preset: str, repeats: int = 20) -> float:
    """A large float32 (cpu) / bfloat16 (gpu) matmul: the practical compute ceiling, timed here."""
    import jax
    import jax.numpy as jnp

    n, dtype = (8192, jnp.bfloat16) if preset == "gpu" else (1024, jnp.float32)
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
    return 2 * n ** 3 / _median(time_calls(jax.jit(lambda x: x @ x), (a,), repeats)) / 1e9


def _median(values) -> float:
    return float(statistics.median(values)) if len(values) else float("nan")


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--steps", type=int, default=None, help="global steps (default 12; smollm2: 3)")
    ap.add_argument("--attention", choices=("auto", "xla", "flash"), default="auto",
                    help="model.attention (auto: cuDNN on a GPU, splash on a TPU, XLA on a CPU)")
    ap.add_argument("--remat", default="none", help="model.remat (none, full, dots_saveable, ...)")
    ap.add_argument("--quick", action="store_true",
                    help="2 steps: a smoke run, numbers not meaningful (smollm2: 2 layers, 32 new tokens only)")
    ap.add_argument("--completion", type=int, default=None,
                    help="smollm2: run this completion length in this process (default: 32, 128, 512, one process each)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="smollm2 without --completion: rounds over the lengths, taking turns (medians reported)")
    ap.add_argument("--floor", action="store_true", help="smollm2: also time the bare loop (more steps' worth)")
    ap.add_argument("--train-micro", type=int, default=None, help="train micro batch size (default: the preset's)")
    ap.add_argument("--logps-micro", type=int, default=None, help="reference-logps micro batch size (default: all)")
    ap.add_argument("--no-xla-flags", action="store_true", help="do not apply rlbolt's CPU XLA flags")
    ap.add_argument("--lora", type=int, default=None, metavar="RANK",
                    help="train LoRA adapters of this rank (alpha 2 * rank) on all seven projections")
    ap.add_argument("--lora-quantize", choices=("int8", "int4", "nf4"), default=None,
                    help="with --lora: store the frozen base quantised by qwix (QLoRA)")
    ap.add_argument("--lora-rollout", choices=("adapters", "merged"), default=None,
                    help="with --lora: merge the adapters into a transient copy before each rollout, or apply "
                         "them on the fly (default: the config's, merged unless quantised)")
    ap.add_argument("--mesh", default=None, help='the device mesh as JSON, e.g. \'{"fsdp": 4, "tp": 2}\' (default: all on fsdp)')
    ap.add_argument("--devices", type=int, default=None, help="CPU only: how many CPU devices the backend shows")
    ap.add_argument("--no-share-prompt", action="store_true",
                    help="run every sample's prompt (model.share_prompt=false), for the A/B")
    ap.add_argument("--no-bound", action="store_true", help="skip the matmul-only bound (benchmarks/ceiling.py)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
