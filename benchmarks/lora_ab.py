"""LoRA A/B on the GRPO benchmark workload, in one process: rollout and update, LoRA vs full.

Rollout: both LoRA variants and a full fine-tuning policy (no adapters: the floor) sample the
workload's rollout (8 prompts x 4 generations, 32 prompt tokens, 64 new tokens, no early stop;
the model of grpo_step.py with LoRA rank 8 on all seven projections). Update: one optimizer
update over the same 32 samples (4 micro batches of 8) for full fine-tuning and for LoRA. Each
round runs every variant in turn, so machine load hits them alike; medians are reported. "merged" folds
`W + (alpha / r) A B` into new kernels before each rollout (a jitted merge, then the plain
sampler); "adapters" runs the adapted graph (two extra small matmuls per projection per token).
`held_mb` is what each variant keeps on the device between rollouts beyond the shared base (0:
the merged kernels are dropped after each rollout); `merged_transient_mb` is what merging adds
while a rollout runs (the targeted kernels' bytes).

    python benchmarks/lora_ab.py            # 9 rounds
    python benchmarks/lora_ab.py --quick    # 2 rounds (smoke)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    import jax
    import numpy as np
    from flax import nnx

    from rlbolt.data.tokenizers import IntTokenizer
    from rlbolt.models import Decoder, workload_config
    from rlbolt.models.lora import adapted_denses
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.setup_context import SetupContext

    config = workload_config()
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(2, config.vocab_size, 32)) for _ in range(8) for _ in range(4)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), len(prompts))), np.uint32)

    def build(lora, merged=False):
        module = GRPO({"model": {"lora": lora}, "algorithm": {"beta": 0.04},
                       "rollout": {"max_new_tokens": 64, "temperature": 1.0, "stop_at_eos": False},
                       "data": {"prompt_field": "prompt", "max_prompt_tokens": 32, "use_chat_template": False}},
                      model=Decoder(config, rngs=nnx.Rngs(0)), tokenizer=IntTokenizer(config.vocab_size),
                      reward=lambda c, s: 0.0)
        module.setup(SetupContext(BatchPlan(8, 4)))
        params = module.init_params(jax.random.key(0))
        if lora is not None:
            module.lora.config = dataclasses.replace(module.lora.config, rollout="merged" if merged else "adapters")
            leaves = jax.tree.leaves(params)
            keys_ = iter(jax.random.split(jax.random.key(1), len(leaves)))
            params = jax.tree.map(lambda x: 0.01 * jax.random.normal(next(keys_), x.shape), params)
        return module, params

    lora = {"rank": args.rank, "alpha": 2.0 * args.rank}
    variants = {"full": build(None), "adapters": build(lora), "merged": build(lora, merged=True)}
    times = {name: [] for name in variants}
    held = {}
    rounds = 2 if args.quick else args.rounds
    for name, (module, params) in variants.items():  # compile, and measure what stays on the device
        gc.collect()
        before = {x.unsafe_buffer_pointer() for x in jax.live_arrays()}
        module.rollout.generate(params, prompts, keys, 1.0)
        gc.collect()
        held[name] = sum(x.nbytes for x in jax.live_arrays() if x.unsafe_buffer_pointer() not in before) / 2 ** 20
    updates = {name: _update_call(variants[source][0], variants[source][1], prompts)
               for name, source in (("update_full", "full"), ("update_lora", "merged"))}
    times.update({name: [] for name in updates})
    for call in updates.values():
        call()  # compile
    for _ in range(rounds):
        for name, (module, params) in variants.items():
            t0 = time.perf_counter()
            module.rollout.generate(params, prompts, keys, 1.0)  # returns host arrays: waits for the device
            times[name].append(time.perf_counter() - t0)
        for name, call in updates.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    module = variants["merged"][0]
    targeted = sum(d.kernel[...].nbytes for _, d in adapted_denses(module.lora.policy_model))
    result = {"system": "rlbolt-lora-ab", "device": jax.devices()[0].device_kind, "rank": args.rank,
              "merged_transient_mb": targeted / 2 ** 20,
              "rounds": rounds, **{f"{k}_s": statistics.median(v) for k, v in times.items()},
              **{f"{k}_held_mb": v for k, v in held.items()}, "all_s": times}
    print(f"LoRA A/B (rank {args.rank}, all seven projections) on {result['device']}, medians of {rounds}:")
    for name in variants:
        print(f"  rollout {name:<9} {result[f'{name}_s']:.3f} s   held after rollout {held[name]:.1f} MB")
    for name in updates:
        print(f"  {name:<17} {result[f'{name}_s']:.3f} s")
    print(json.dumps(result))
    return result


def _update_call(module, params, prompts):
    """A zero-argument call running one jitted optimizer update (grad accumulation over 4 micro
    batches of 8) on a fixed batch of the workload's shapes, returning when the device is done."""
    import jax
    import numpy as np

    from rlbolt.batch import Batch
    from rlbolt.update import make_update_fn, split_micro_batches

    rng = np.random.default_rng(1)
    n = len(prompts)
    batch = jax.device_put(split_micro_batches(Batch({
        "prompt_ids": np.asarray(prompts, np.int32), "prompt_mask": np.ones((n, 32), bool),
        "completion_ids": rng.integers(2, 512, (n, 64)).astype(np.int32), "completion_mask": np.ones((n, 64), bool),
        "old_logps": np.full((n, 64), -6.2, np.float32), "ref_logps": np.full((n, 64), -6.2, np.float32),
        "advantages": rng.standard_normal(n).astype(np.float32)}), 4))  # the update takes [A, M/A, ...]
    tx = module.configure_optimizers()
    # donate=(): the timed call repeats on the same inputs, which a donating update would delete.
    update = make_update_fn(module.training_step, tx, 4, frozen=module.frozen_params(), with_frozen=module.with_frozen,
                            donate=())
    opt_state = tx.init(params)
    return lambda: jax.block_until_ready(update(params, opt_state, batch))


if __name__ == "__main__":
    main()
