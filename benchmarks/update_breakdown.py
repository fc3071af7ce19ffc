"""Where the update's time goes at SmolLM2-135M shapes: one train micro batch's gradient, piece by piece.

The update of `grpo_step.py --preset smollm2` is, per train micro batch, the gradient of the
completion tokens' logps (the policy loss around it is element-wise and costs nothing next to
it). This script times, for one micro batch (default 8 rows = 2 groups of G=4 of 48 prompt + C
completion tokens, the prompt shared), in one process, the variants taking turns:

    full        grad of sum(token_logps): the model, the 49k lm_head and the log-softmax
    no_head     grad of sum(hidden * r): the layers alone (no lm_head, no log-softmax)
    one_piece   full, with causal attention in one piece (no query chunks; only differs when C > 128)
    products    the same tokens' dense products alone (benchmarks/ceiling.py's update phase), all of them
    layer_products  the same without the lm_head's products (vocabulary 8)
    attention_products  the layers' attention products (q . k, p . v, forward and backward) at their
                causal share (ceiling.attention_products: one layer timed, times the layer count)

so that `no_head - layer_products` is what the layers cost beyond their products (attention,
norms, RoPE, layout copies) and `(full - no_head) - (products - layer_products)` what the lm_head
and log-softmax cost beyond theirs. `--profile DIR` also writes a jax.profiler trace of `full` and its
compiled HLO there, and prints its costliest ops (benchmarks/op_profile.py).

    python benchmarks/update_breakdown.py [--completion 128] [--rows 8] [--rounds 3] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceiling import alternate, attention_products, product_phases  # noqa: E402
from machine import cpu_model  # noqa: E402
from op_profile import print_op_table  # noqa: E402
from shapes import chat_prompt_ids, smollm2_135m_config  # noqa: E402

GROUP, PROMPT_LEN = 4, 48


def main(argv=None) -> dict:
    args = _parse(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rlbolt.models import Decoder
    from rlbolt.models.logps import completion_hidden, token_logps

    load_start = os.getloadavg()
    config = smollm2_135m_config(num_layers=2 if args.quick else args.layers)
    c, rows = (16 if args.quick else args.completion), args.rows
    rng = np.random.default_rng(0)
    prompts = np.repeat(np.asarray([chat_prompt_ids(rng, config.vocab_size, PROMPT_LEN)
                                    for _ in range(rows // GROUP)], np.int32), GROUP, axis=0)
    completions = rng.integers(3, config.vocab_size, (rows, c)).astype(np.int32)
    p_mask, c_mask = np.ones(prompts.shape, bool), np.ones(completions.shape, bool)
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    model = nnx.merge(graphdef, params)
    model.attention_query_chunk = None
    graphdef_one_piece = nnx.split(model)[0]
    r = jax.random.normal(jax.random.PRNGKey(1), (rows, c, config.hidden_size), jnp.float32)

    def full_loss(gd):
        return lambda ps: jnp.sum(token_logps(gd, ps, prompts, p_mask, completions, c_mask, group_size=GROUP))

    def no_head_loss(ps):
        hidden, _ = completion_hidden(graphdef, ps, prompts, p_mask, completions, c_mask, GROUP)
        return jnp.sum(hidden * r)

    calls = {"full": (jax.jit(jax.grad(full_loss(graphdef))), (params,)),
             "no_head": (jax.jit(jax.grad(no_head_loss)), (params,))}
    if c > 128:
        calls["one_piece"] = (jax.jit(jax.grad(full_loss(graphdef_one_piece))), (params,))
    for n, cfg in (("products", config), ("layer_products", dataclasses.replace(config, vocab_size=8))):
        calls[n] = product_phases(cfg, rows, PROMPT_LEN, c, group=GROUP, decode_steps=1)["update"]
    attention_fn, attention_args, share = attention_products(config, rows, PROMPT_LEN, c, GROUP)
    calls["attention_products"] = (attention_fn, attention_args)  # one layer, one piece; scaled below
    for fn, inputs in calls.values():  # compile and warm
        jax.block_until_ready(fn(*inputs))
    names = list(calls)
    seconds = {n: [] for n in names}
    for _ in range(args.rounds):  # the model variants and the products take turns, round by round
        for n, s in zip(names, alternate([lambda n=n: calls[n][0](*calls[n][1]) for n in names], 1)):
            seconds[n].append(s)
    seconds["attention_products"] = [s * config.num_layers * share for s in seconds["attention_products"]]
    med = {n: statistics.median(v) for n, v in seconds.items()}
    if args.profile:
        jax.profiler.start_trace(args.profile)
        for _ in range(2):
            jax.block_until_ready(calls["full"][0](params))
        jax.profiler.stop_trace()
        hlo = calls["full"][0].lower(params).compile().as_text()
        Path(args.profile, "full.hlo.txt").write_text(hlo)
        print_op_table(args.profile, hlo, calls=2)
    layers_extra = med["no_head"] - med["layer_products"]
    head_extra = (med["full"] - med["no_head"]) - (med["products"] - med["layer_products"])
    result = {"system": "rlbolt-update-breakdown", "completion": c, "rows": rows, "prompt": PROMPT_LEN, "group": GROUP,
              "layers": config.num_layers, "vocab": config.vocab_size, "rounds": args.rounds, "seconds": med,
              "all_s": seconds, "full_over_products": med["full"] / med["products"],
              "full_over_all_products": med["full"] / (med["products"] + med["attention_products"]),
              "layers_beyond_products_s": layers_extra, "head_beyond_products_s": head_extra,
              "cpu_model": cpu_model(), "load_avg": [*load_start, *os.getloadavg()]}
    print(f"one micro batch's gradient, {rows} rows x ({PROMPT_LEN} + {c}) tokens, G={GROUP}, "
          f"{config.num_layers} layers, vocab {config.vocab_size} ({args.rounds} rounds, medians)")
    for n, s in med.items():
        print(f"  {n:<16} {s:8.3f} s")
    print(f"  {'full / products':<16} {result['full_over_products']:8.2f}   (dense products only)")
    print(f"  {'full / all':<16} {result['full_over_all_products']:8.2f}   (dense + attention products)")
    print(f"  layers beyond their products {layers_extra:.3f} s; lm_head + log-softmax beyond theirs {head_extra:.3f} s")
    print(json.dumps(result))
    return result


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--completion", type=int, default=128, help="completion tokens per row")
    ap.add_argument("--layers", type=int, default=30,
                    help="layers (fewer: per-layer costs scale by 30 / layers, the lm_head's stays; cheaper on a busy box)")
    ap.add_argument("--rows", type=int, default=8, help="rows of the micro batch (whole groups of 4)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds the variants take turns")
    ap.add_argument("--quick", action="store_true", help="2 layers, 16 tokens, for a smoke run")
    ap.add_argument("--profile", default=None, help="also write a jax.profiler trace of `full` to this folder")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
