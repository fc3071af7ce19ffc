"""NativeSampler throughput on the common workload (benchmarks/WORKLOAD.md).

32 sequences (8 prompts x G=4), 32-token prompts with ids in [2, 512), 64 new tokens,
temperature 1, no stop tokens (every row generates all 64 tokens), the workload model
(vocab 512, hidden 256, 4 layers, GQA 4/2, float32, seed 0).

Prints a small table and a final JSON line. `--quick` runs 2 timed iterations.

    python benchmarks/sampler.py [--quick] [--iters N] [--no-xla-flags]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 timed iterations")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations (after 1 warm-up)")
    parser.add_argument("--no-xla-flags", action="store_true", help="do not apply rlbolt's CPU XLA flags")
    args = parser.parse_args()
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags(enable=not args.no_xla_flags)  # before jax is imported; CPU only

    import jax
    import numpy as np
    from flax import nnx

    from rlbolt.models import Decoder, workload_config
    from rlbolt.rollout import NativeSampler

    iters = 2 if args.quick else args.iters
    config = workload_config()
    model = Decoder(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, config.vocab_size, (8, 32))
    prompt_rows = [list(p) for p in np.repeat(prompts, 4, axis=0)]  # G = 4 generations per prompt
    n, max_new = len(prompt_rows), 64
    sampler = NativeSampler(model, max_new_tokens=max_new, temperature=1.0, pad_id=0, prompt_buckets=(32,))
    key = jax.random.key(0)

    def one_call(step):
        keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.fold_in(key, step), n)))
        start = time.perf_counter()
        out = sampler.generate(prompt_rows, keys)  # returns host arrays: includes the device sync
        return time.perf_counter() - start, out

    compile_s, out = one_call(0)
    compiled_after_warmup = sampler.compiled_count()
    times = []
    for step in range(1, iters + 1):
        seconds, out = one_call(step)
        times.append(seconds)
    compiles_after_warmup = sampler.compiled_count() - compiled_after_warmup
    generated = int(out.completion_mask.sum())
    median = statistics.median(times)

    print(f"{'iter':>6} {'seconds':>9} {'gen tok/s':>10}")
    for i, seconds in enumerate(times, 1):
        print(f"{i:>6} {seconds:9.3f} {generated / seconds:10.0f}")
    print(f"first call (compile + run): {compile_s:.2f} s; median {median:.3f} s; "
          f"{generated} tokens per call; decode steps {sampler.last_decode_steps}")
    print(json.dumps({
        "system": "rlbolt-sampler",
        "gen_tokens_per_s": round(generated / median, 1),
        "step_s_median": round(median, 4),
        "compiles_after_warmup": compiles_after_warmup,
        "first_call_s": round(compile_s, 3),
        "sequences": n, "prompt_tokens": 32, "new_tokens": max_new, "iters": iters,
        "backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "python": platform.python_version(), "jax": jax.__version__,
    }))


if __name__ == "__main__":
    sys.exit(main())
