"""Packed rows (plan.packing=on) against padded rows: the update's time on one batch whose sequence
lengths spread 4x, the variants taking turns in one process (medians).

The batch: N samples of a chat-shaped 64-token prompt (max_len / 4 when shorter) and a completion, their lengths (prompt +
completion) evenly spread from max_len / 4 to max_len and shuffled; padded rows are max_len wide, packed
rows hold max_len tokens each (`plan.packed_row_tokens` null: the padded width), first-fit decreasing.
Both variants run the same tokens through `rlbolt.update.make_update_fn` (gradient of a token-mean
policy-gradient loss with the entropy, AdamW step); only the forward's layout differs
(`rlbolt.models.logps.sequence_logps` against `rlbolt.packing.packed_sequence_logps`, whose output
projection runs over the completion tokens' predicting states, `pack_sources`; `--with-before` also
times it over every packed token, as before that column). Model: SmolLM2-135M's widths
(benchmarks/shapes.py) with `--layers` of its 30 layers, float32.

    python benchmarks/packing_ab.py                       # 16 samples, 128..512 tokens, 8 layers, 3 rounds
    python benchmarks/packing_ab.py --layers 30 --rounds 3
    python benchmarks/packing_ab.py --with-before          # and the packed update without pack_sources
    python benchmarks/packing_ab.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402
from shapes import chat_prompt_ids, smollm2_135m_config  # noqa: E402

PROMPT = 64


def alternate_timed(calls, rounds: int) -> list[tuple[float, float]]:
    """(median wall seconds, median process CPU seconds) of each call, the calls taking turns for
    `rounds` rounds. The CPU time counts this process's threads only, so it drifts less than the wall
    time when other processes share the cores."""
    import resource
    import statistics
    import time

    import jax

    def cpu():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    wall, used = [[] for _ in calls], [[] for _ in calls]
    for _ in range(rounds):
        for i, call in enumerate(calls):
            t0, c0 = time.perf_counter(), cpu()
            jax.block_until_ready(call())
            wall[i].append(time.perf_counter() - t0)
            used[i].append(cpu() - c0)
    return [(statistics.median(w), statistics.median(u)) for w, u in zip(wall, used)]


def build_batch(n: int, max_len: int, vocab: int, seed: int = 0):
    """(prompt_ids, prompt_mask, completion_ids, completion_mask) as NumPy, lengths spread 4x (prompts of
    64 tokens, or max_len / 4 when shorter)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    totals = np.linspace(max_len // 4, max_len, n).round().astype(int)
    rng.shuffle(totals)
    prompt = min(PROMPT, max_len // 4)  # every sample keeps a completion token or more
    c = max_len - prompt
    prompt_ids = np.asarray([chat_prompt_ids(rng, vocab, prompt) for _ in range(n)], np.int32)
    prompt_mask = np.ones((n, prompt), bool)
    completion_mask = np.arange(c)[None] < (totals - prompt)[:, None]
    completion_ids = np.where(completion_mask, rng.integers(3, vocab, (n, c)), 0).astype(np.int32)
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def main(argv=None) -> dict:
    args = _parse(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from rlbolt.batch import Batch
    from rlbolt.models import Decoder
    from rlbolt.packing import PackingSpec, packed_sequence_logps, with_pack_columns
    from rlbolt.models.logps import sequence_logps
    from rlbolt.update import make_update_fn, split_micro_batches

    n, max_len = (8, 128) if args.quick else (args.samples, args.max_len)
    layers = 1 if args.quick else args.layers
    config = smollm2_135m_config(num_layers=layers)
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)), nnx.Param)
    pi, pm, ci, cm = build_batch(n, max_len, config.vocab_size)
    batch = Batch(prompt_ids=pi, prompt_mask=pm, completion_ids=ci, completion_mask=cm,
                  advantages=np.random.default_rng(1).standard_normal(n).astype(np.float32))
    packed_batch = with_pack_columns(batch, n, PackingSpec())
    rows = packed_batch["pack_rows"].shape[1]

    def step(packed, with_sources=True):
        def training_step(prm, b):
            inputs = (b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"])
            if packed:
                sources = b["pack_sources"] if with_sources else None
                logps, entropy = packed_sequence_logps(graphdef, prm, *inputs, b["pack_rows"], b["pack_starts"],
                                                       sources, row_tokens=None, with_entropy=True)
            else:
                logps, entropy = sequence_logps(graphdef, prm, *inputs, temperature=1.0, with_entropy=True)
            per_token = -(logps * b["advantages"][:, None]) - 0.01 * entropy
            loss = jnp.sum(jnp.where(b["completion_mask"], per_token, 0.0)) / b["mini_batch_num_tokens"][0]
            return loss, {}
        return training_step

    optimizer = optax.adamw(1e-6)
    opt_state = optimizer.init(params)
    variants = [(False, True), (True, True)] + ([(True, False)] if args.with_before else [])  # (packed, sources)
    updates = [make_update_fn(step(*v), optimizer, 1, donate=()) for v in variants]
    inputs = {False: split_micro_batches(batch, 1), True: split_micro_batches(packed_batch, 1)}
    calls = [lambda u=u, p=v[0]: u(params, opt_state, inputs[p])[2]["loss"] for u, v in zip(updates, variants)]
    losses = [float(jax.block_until_ready(call())) for call in calls]  # compile and warm
    rounds = 2 if args.quick else args.rounds
    timed = alternate_timed(calls, rounds)
    (padded_s, padded_cpu), (packed_s, packed_cpu) = timed[:2]
    tokens = int(pm.sum() + cm.sum())
    result = {"system": "rlbolt-packing-ab", "cpu": cpu_model(), "devices": str(jax.devices()[0].platform),
              "samples": n, "max_len": max_len, "layers": layers, "rounds": rounds, "real_tokens": tokens,
              "padded_tokens": n * max_len, "packed_rows": rows, "packed_tokens": rows * max_len,
              "update_s_padded": padded_s, "update_s_packed": packed_s, "speedup": padded_s / packed_s,
              "update_cpu_s_padded": padded_cpu, "update_cpu_s_packed": packed_cpu, "cpu_speedup": padded_cpu / packed_cpu,
              "loss_padded": losses[0], "loss_packed": losses[1],
              "packed_head_tokens": int(packed_batch["pack_sources"].size)}
    if args.with_before:
        before_s, before_cpu = timed[2]
        result.update(update_s_packed_before=before_s, update_cpu_s_packed_before=before_cpu,
                      cpu_speedup_before=padded_cpu / before_cpu, loss_packed_before=losses[2],
                      packed_head_tokens_before=min(rows * max_len, n * ci.shape[1]))
    print(f"packed vs padded update: {n} samples of {max_len // 4}..{max_len} tokens ({tokens} real), SmolLM2-135M widths, "
          f"{layers} layers, {rounds} alternating rounds (medians), {result['cpu']}")
    print(f"  {'':8}{'rows x width = tokens':>24}   {'wall s':>8}   {'CPU s':>8}")
    print(f"  padded  {n:>5} x {max_len} = {n * max_len:>6}     {padded_s:8.3f}   {padded_cpu:8.3f}")
    print(f"  packed  {rows:>5} x {max_len} = {rows * max_len:>6}     {packed_s:8.3f}   {packed_cpu:8.3f}")
    print(f"  speedup{'':27}x{result['speedup']:.2f}      x{result['cpu_speedup']:.2f}")
    if args.with_before:
        print(f"  packed, every packed token projected (before pack_sources): {before_s:8.3f} s wall, "
              f"{before_cpu:8.3f} s CPU, x{result['cpu_speedup_before']:.2f} CPU")
    print(json.dumps(result))
    return result


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512, help="the longest sample (prompt + completion), the padded width")
    p.add_argument("--layers", type=int, default=8, help="of SmolLM2-135M's 30")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--with-before", action="store_true",
                   help="also time the packed update as it was before `pack_sources` (the output projection "
                        "over every packed token, or the N x C gathered states where fewer), in the same rounds")
    p.add_argument("--quick", action="store_true", help="8 samples of 32..128 tokens (prompts cut to fit), 1 layer, 2 rounds (a smoke run)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
