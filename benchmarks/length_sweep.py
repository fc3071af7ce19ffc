"""How a GRPO step's cost grows with completion length, prompt length and group size.

A fixed small model (vocab 256, hidden 64, 2 layers, 4 q / 2 kv heads of 16, MLP 128, float32),
2 prompts per step, temperature 1, no early stop, beta 0.04, the prompt shared per group
(model.share_prompt). Points: completion length 64, 256, 1024 x prompt length 32, 512 x group
size 4, 16. Each point runs in its own process (so peak RSS is the point's own) for 3 steps and
reports the median of steps 2-3:

    step_s, split (rollout / logps / reward / update / other), gen_tokens_per_s (generated
    tokens / step), forward_tokens_per_s (prompt + completion tokens of the batch / step),
    peak_rss_mb, decode_attention_share (of one decode step at the rollout's mean cache fill:
    1 - time with a one-slot cache / time with the real one), and the same share had every
    step read the whole static cache (`whole_cache_attention_share`, what the decode did before
    it read only its filled segment); for completions >= 256, `rollout_s_whole_cache` vs
    `rollout_s_segmented`: sampler calls with decode_segment None and 128, taking turns.

One more line (`"eos": true`) measures completions that end early: 64 rows, 256 new tokens,
a stop set of 8 of the 256 ids (a ~1 in 32 chance per token), against the same call without
stop tokens: the decode loop leaves when every row has stopped, and the segments after the
first run only the rows still going (`rlbolt.rollout.compaction`), shown with compaction off
and with segments of 64 steps too.

    python benchmarks/length_sweep.py                 # every point, then length_sweep.png
    python benchmarks/length_sweep.py --quick         # 1 tiny point + eos: fields only (CI)
    python benchmarks/length_sweep.py --plot out.png  # where the picture goes

One JSON line per point on stdout (the plot: step time and peak RSS against completion length).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceiling import alternate  # noqa: E402

MODEL = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             intermediate_size=128, max_position_embeddings=2048)
FULL = [dict(completion=c, prompt=p, group=g) for p in (32, 512) for g in (4, 16) for c in (64, 256, 1024)]
QUICK = [dict(completion=16, prompt=8, group=2)]
PROMPTS_PER_STEP, STEPS = 2, 3


def run_point(point: dict, quick: bool) -> dict:
    """One sweep point in this process (a fresh one: peak RSS is this point's)."""
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    import jax
    import numpy as np
    import resource
    from flax import nnx

    from rlbolt.callback import Callback
    from rlbolt.data.tokenizers import IntTokenizer
    from rlbolt.models import Decoder, tiny_config
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    p, c, g = point["prompt"], point["completion"], point["group"]
    config = tiny_config(**MODEL)
    rng = np.random.default_rng(0)
    steps = 2 if quick else STEPS
    rows = [{"prompt": " ".join(map(str, rng.integers(2, MODEL["vocab_size"], p)))}
            for _ in range(PROMPTS_PER_STEP * steps)]
    module = GRPO(
        {"algorithm": {"beta": 0.04, "lr": 1e-6}, "rollout": {"max_new_tokens": c, "stop_at_eos": False},
         "data": {"prompt_field": "prompt", "max_prompt_tokens": p, "use_chat_template": False}},
        model=Decoder(config, rngs=nnx.Rngs(0)), tokenizer=IntTokenizer(MODEL["vocab_size"]),
        reward=lambda completion, sample: len(completion) % 3 / 2)

    class Record(Callback):
        def __init__(self):
            self.metrics, self.last = [], None

        def on_rollout_end(self, run, rollout):
            self.last = rollout

        def on_step_end(self, run, info):
            self.metrics.append(info.metrics)

    rec = Record()
    trainer = Trainer(BatchPlan(prompts_per_step=PROMPTS_PER_STEP, num_generations=g), max_steps=steps, seed=0,
                      shuffle=False)
    trainer.callbacks = type(trainer.callbacks)([rec])
    trainer.fit(module, rows)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    measured = rec.metrics[1:]
    step_s = statistics.median(m["time/step"] for m in measured)
    split = {k: statistics.median(m[f"time/{k}"] for m in measured) for k in ("rollout", "logps", "reward", "update")}
    split["other"] = max(step_s - sum(split.values()), 0.0)
    sequences = PROMPTS_PER_STEP * g
    result = {
        "system": "rlbolt-length-sweep", **point, "sequences": sequences, "shared_prompt": module.train_group_size > 1,
        "step_s": step_s, "split": split, "gen_tokens_per_s": sequences * c / step_s,
        "forward_tokens_per_s": sequences * (p + c) / step_s, "peak_rss_mb": peak_rss_mb,
        **_attention_share(module.model, sequences, g, p, c, repeats=3 if quick else 30),
    }
    if c >= 256 or quick:
        result.update(_segment_ab(module, rec.last.batch, c, repeats=1 if quick else 3))
    return result


def _attention_share(model, sequences: int, group: int, prompt: int, completion: int, repeats: int) -> dict:
    """The share of one decode step spent on attention, at the rollout's mean cache fill."""
    import jax
    import jax.numpy as jnp

    from rlbolt.models.cache import init_cache
    from rlbolt.models.shared_prefix import decode_with_prefix
    from rlbolt.rollout.sampler import decode_segments

    own_slots = max(completion - 1, 1)
    ends = decode_segments(completion, 128) or (1,)
    # A step of the segment ending at e reads a cache of e - 1 own slots: the mean over the rollout.
    begins = (1, *ends[:-1])
    segmented_read = max(1, round(sum((e - b) * (e - 1) for b, e in zip(begins, ends)) / max(completion - 1, 1)))

    def step_call(prefix_len: int, slots: int):
        """One decode step against `prefix_len` prompt slots and an own cache of `slots` slots,
        the cache donated and fed back (updated in place, as in the sampler's loop)."""
        prefix = init_cache(model.config, sequences // group, prefix_len)
        prefix = prefix._replace(mask=jnp.ones_like(prefix.mask))  # every prompt slot real
        state = {"own": init_cache(model.config, sequences, slots)}
        tokens, positions = jnp.ones((sequences,), jnp.int32), jnp.full((sequences,), prefix_len, jnp.int32)
        fn = jax.jit(lambda t, pos, pre, o: decode_with_prefix(model, t, pos, pre, o._replace(index=o.index * 0), slots),
                     donate_argnums=3)

        def call():
            logits, state["own"] = fn(tokens, positions, prefix, state["own"])
            jax.block_until_ready(logits)

        call()
        return call

    # The three variants alternate call by call (medians): a busy machine slows all of them alike.
    bare, real, whole = alternate([step_call(1, 1), step_call(prompt, segmented_read), step_call(prompt, own_slots)],
                                   repeats)
    return {"decode_step_s": real, "decode_attention_share": max(0.0, 1 - bare / real),
            "whole_cache_decode_step_s": whole, "whole_cache_attention_share": max(0.0, 1 - bare / whole)}


def _segment_ab(module, batch, completion: int, repeats: int) -> dict:
    """Two rollouts of the last batch's prompts: every step reading the whole cache vs its segment."""
    import numpy as np

    from rlbolt.rollout import NativeSampler

    ids = [list(r[m]) for r, m in zip(np.asarray(batch["prompt_ids"]), np.asarray(batch["prompt_mask"]))]
    keys = np.asarray(batch["sample_keys"], np.uint32)
    calls = []
    for segment in (None, 128):
        sampler = NativeSampler(module.model, max_new_tokens=completion, temperature=1.0,
                                prompt_buckets=(len(ids[0]),), decode_segment=segment)
        sampler.generate(ids, keys)  # compile
        calls.append(lambda sampler=sampler: sampler.generate(ids, keys))
    whole, segmented = alternate(calls, repeats)
    return {"rollout_s_whole_cache": whole, "rollout_s_segmented": segmented}


def run_eos(quick: bool) -> dict:
    """Completions that may end early (a stop set of 8 ids), with and without compaction of the
    rows that stopped, and every decode segment length, against the same call without stops.

    Variants take turns (5 rounds); each reports its median rollout seconds, the decode steps
    its loop ran, and the mean and longest completion (equal for every variant with stops: the
    same samples).
    """
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    import jax
    import numpy as np
    from flax import nnx

    from rlbolt.models import Decoder, tiny_config
    from rlbolt.rollout import NativeSampler

    rows, new_tokens = (8, 16) if quick else (64, 256)
    model = Decoder(tiny_config(**MODEL), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [p for p in rng.integers(2, MODEL["vocab_size"], (rows // 4, 32)).tolist() for _ in range(4)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), rows)), np.uint32)
    out = {"system": "rlbolt-length-sweep", "eos": True, "sequences": rows, "prompt": 32, "completion": new_tokens}
    stops = tuple(range(2, 10))
    segment = 4 if quick else 64  # quick: 16 new tokens still make several segments
    variants = {  # name: (stop ids, compact the rows that stopped, decode segment)
        "no_stop": ((), True, 128),
        "with_stop_no_compaction": (stops, False, 128),
        "with_stop": (stops, True, 128),
        f"with_stop_segment_{segment}": (stops, True, segment),
    }
    samplers, results, compile_s = {}, {}, {}
    for name, (stop_ids, compact, seg) in variants.items():
        samplers[name] = NativeSampler(model, max_new_tokens=new_tokens, temperature=1.0, prompt_buckets=(32,),
                                       stop_token_ids=stop_ids, compact_finished=compact, decode_segment=seg)
        t0 = time.perf_counter()
        results[name] = samplers[name].generate(prompts, keys)
        compile_s[name] = time.perf_counter() - t0
    calls = [lambda s=s: s.generate(prompts, keys) for s in samplers.values()]
    for (name, sampler), seconds in zip(samplers.items(), alternate(calls, 1 if quick else 5)):
        lengths = results[name].completion_mask.sum(1)
        out[name] = {"rollout_s": seconds, "first_call_s": compile_s[name], "decode_steps": sampler.last_decode_steps,
                     "mean_length": float(lengths.mean()), "max_length": int(lengths.max())}
    out["time_ratio"] = out["with_stop"]["rollout_s"] / out["no_stop"]["rollout_s"]
    out["compaction_speedup"] = out["with_stop_no_compaction"]["rollout_s"] / out["with_stop"]["rollout_s"]
    return out


def plot(results: list[dict], path: Path) -> None:
    """Step time and peak RSS against completion length, one line per (prompt, group)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    series = sorted({(r["prompt"], r["group"]) for r in results if not r.get("eos")})
    for prompt, group in series:
        pts = sorted((r["completion"], r["step_s"], r["peak_rss_mb"]) for r in results
                     if not r.get("eos") and (r["prompt"], r["group"]) == (prompt, group))
        label = f"prompt {prompt}, G={group}"
        ax_t.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax_m.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=label)
    for ax, name in ((ax_t, "step time (s)"), (ax_m, "peak RSS (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("completion length (new tokens)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.legend(fontsize=8)
    fig.suptitle("GRPO step on a small model: cost against completion length (benchmarks/length_sweep.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> list[dict]:
    args = _parse(argv)
    if args.point:
        print(json.dumps(run_point(json.loads(args.point), args.quick)))
        return []
    results = []
    for point in QUICK if args.quick else FULL:
        cmd = [sys.executable, __file__, "--point", json.dumps(point), *(["--quick"] if args.quick else [])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=os.environ.copy()).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    results.append(run_eos(args.quick))  # in this process: its peak RSS is not reported
    print(json.dumps(results[-1]), flush=True)
    if args.plot or not args.quick:
        plot(results, Path(args.plot or Path(__file__).with_name("length_sweep.png")))
    return results


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 tiny point and a short eos line: fields only")
    ap.add_argument("--plot", default=None, help="PNG path (default: benchmarks/length_sweep.png; quick: none)")
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)  # one point, in a child process
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
