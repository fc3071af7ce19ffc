"""What the GRPO step's matrix products alone cost on this machine, at the step's own shapes.

`achieved / matmul` in grpo_step.py compares the whole step with one large square matmul. This
script answers the question that target raises: how fast can *these* products go here? It times
only the dense products the FLOP formula counts (benchmarks/flops.py), at the step's shapes and
with the step's dependencies, and nothing else (no norms, softmax, attention, sampling, framework):

    rollout: the prefill over S x P prompt tokens, then C - 1 *sequential* decode steps of S-row
             products through every layer and the lm_head (each step needs the previous one);
    ref:     one forward over S x (P + C) tokens;
    update:  forward + gradients (inputs and weights) over S x (P + C) tokens in one piece (the
             most favourable shape; grpo_step.py accumulates micro batches of 8).

The sum is a lower bound on the step's matmul time, so `flops / bound / matmul_gflops` is the
highest `achieved / matmul` any implementation of the workload could report on this machine.
Attention (3% of the FLOPs at the toy workload) is counted in the FLOPs but not timed, which
favours the bound; at real shapes `measure_bound(..., attention=True)` also times the update's
attention products (q . k and p . v, forward and backward, at their causal share) as
`update_attention`. grpo_step.py calls `measure_bound` in its own process, so its ratios compare
like with like.

    python benchmarks/ceiling.py [--repeats 7] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import step_flops  # noqa: E402


def product_phases(cfg, sequences: int, prompt_len: int, new_tokens: int, group: int = 1, pieces: int = 1,
                   decode_steps: int | None = None) -> dict:
    """The step's dense products per phase as `{phase: (jitted fn, args)}` (see `measure_bound`).

    `decode_steps`: how many sequential decode steps the decode phase runs (default C - 1).
    """
    import jax
    import jax.numpy as jnp

    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    o_in = cfg.num_heads * cfg.head_dim
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 4 * cfg.num_layers + 8))
    normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.float32) * 0.05  # noqa: E731
    weights = [dict(qkv=normal(h, qkv), o=normal(o_in, h), gu=normal(h, 2 * i), d=normal(i, h))
               for _ in range(cfg.num_layers)]
    head = normal(h, v)

    def forward(ws, hd, x):
        """Every counted product once; slices carry the chain (x stays [tokens, hidden])."""
        for w in ws:
            x = x + (x @ w["qkv"])[:, :o_in] @ w["o"]
            x = x + (x @ w["gu"])[:, :i] @ w["d"]
        return x, x @ hd

    steps = new_tokens - 1 if decode_steps is None else decode_steps

    def decode(ws, hd, x):
        def body(_, x):
            x, logits = forward(ws, hd, x)
            return x + logits[:, :1] * 1e-3  # [S, 1]: the next step needs this one (any V)

        return jax.lax.fori_loop(0, steps, body, x)

    def update(ws, hd, x, cotangents):
        """Forward, then the gradients of inputs and weights for dense cotangents. The logits' max
        keeps the forward lm_head product, which any log-softmax needs: nothing in a linear
        backward reads it, and XLA dropped it as dead code (the bound was one lm_head product short)."""
        (_, logits), pull = jax.vjp(forward, ws, hd, x)
        return pull(cotangents), jnp.max(logits)

    prompt_tokens = sequences // group * prompt_len
    tokens = (prompt_tokens + sequences * new_tokens) // pieces
    # Weights are arguments, not closed-over constants: XLA would constant-fold the products.
    phases = {
        "prefill": (jax.jit(forward), (weights, head, normal(prompt_tokens, h))),
        "decode": (jax.jit(decode), (weights, head, normal(sequences, h))),
        "ref": (jax.jit(forward), (weights, head, normal(tokens, h))),
        "update": (jax.jit(update), (weights, head, normal(tokens, h), (normal(tokens, h), normal(tokens, v)))),
    }
    return phases


def attention_products(cfg, rows: int, prompt_len: int, new_tokens: int, group: int = 1) -> tuple:
    """One layer's attention products of the update, `(jitted fn, args, visible share)`.

    The products are q . k and p . v, forward and backward (six per layer), timed in one piece
    over `rows` rows: with a shared prompt (G > 1) the C completion queries of each row against
    its P prompt keys and its own C keys, else every P + C query against P + C keys. A causal
    implementation needs only the visible pairs of that block (the returned share), so the caller
    scales the time by share x layers. The prompt's own attention (once per group, P x P) is left
    out, which favours the bound.
    """
    import jax
    import jax.numpy as jnp

    d, kv, g = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    if group > 1:
        t, s = new_tokens, prompt_len + new_tokens
        share = (new_tokens * prompt_len + new_tokens * (new_tokens + 1) / 2) / (t * s)
    else:
        t = s = prompt_len + new_tokens
        share = (t + 1) / (2 * t)
    keys = jax.random.split(jax.random.PRNGKey(2), 5)
    q = jax.random.normal(keys[0], (rows, t, kv, g, d))
    k_t = jax.random.normal(keys[1], (rows, kv, d, s))
    v = jax.random.normal(keys[2], (rows, kv, s, d))
    g_scores = jax.random.normal(keys[3], (rows, kv, t, g, s))  # stands in for the probabilities and their cotangent
    g_out = jax.random.normal(keys[4], (rows, t, kv, g, d))

    def products(q, k_t, v, g_scores, g_out):
        scores, pull_scores = jax.vjp(lambda q, k_t: jnp.einsum("btkgd,bkds->bktgs", q, k_t), q, k_t)
        out, pull_out = jax.vjp(lambda p, v: jnp.einsum("bktgs,bksd->btkgd", p, v), g_scores, v)
        return pull_scores(g_scores), pull_out(g_out), jnp.max(scores), jnp.max(out)

    return jax.jit(products), (q, k_t, v, g_scores, g_out), share


def measure_bound(cfg, sequences: int, prompt_len: int, new_tokens: int, repeats: int = 7,
                  matmul_gflops: float | None = None, group: int = 1, pieces: int = 1,
                  decode_steps: int | None = None, attention: bool = False) -> dict:
    """Times the step's dense products per phase; returns times, the bound and the ratios.

    `matmul_gflops`: the ceiling the caller already measured (grpo_step.py), so both of its
    ratios share one denominator; None times the 1024^3 matmul here, before and after the phases.
    `group` G > 1: the products of the prompt-shared step (each group's prompt once: the prefill
    over S / G x P tokens, ref and update over S / G x P + S x C tokens).
    `pieces` > 1: ref and update are timed on 1 / pieces of the tokens (a train micro batch's
    share, whole groups) and the time multiplied by `pieces`: at real shapes the products in one
    piece would hold every token's [tokens, V] logits and activations at once (C=512: > 15 GB).
    `decode_steps`: time this many decode steps and scale to C - 1 (every step runs the same
    products; the bound leaves attention out, so a step's cost does not grow with the cache).
    `attention`: also time the update's attention products (`attention_products`) as the phase
    `update_attention`, part of the bound. Worth it at long completions: at 512 new tokens
    attention is ~10% of a layer's FLOPs and its small-K products run at half a large GEMM's rate.
    """
    if sequences % (pieces * group):
        raise ValueError(f"measure_bound pieces={pieces} must split the {sequences} sequences into whole groups of {group}")
    import jax

    steps = new_tokens - 1 if decode_steps is None else max(1, min(decode_steps, new_tokens - 1))
    calls = product_phases(cfg, sequences, prompt_len, new_tokens, group, pieces, steps)
    if attention:
        fn, args, share = attention_products(cfg, sequences // pieces, prompt_len, new_tokens, group)
        calls["update_attention"] = (fn, args)
    if matmul_gflops is None:
        calls["matmul"] = (jax.jit(lambda a: a @ a), (jax.random.normal(jax.random.PRNGKey(1), (1024, 1024)),))
    times = _time_blocks(calls, repeats)
    times["decode"] *= (new_tokens - 1) / steps
    times["ref"] *= pieces
    times["update"] *= pieces
    if attention:
        times["update_attention"] *= pieces * cfg.num_layers * share
    if matmul_gflops is None:
        matmul_gflops = 2 * 1024 ** 3 / times.pop("matmul") / 1e9
    flops = step_flops(cfg, sequences, prompt_len, new_tokens, group)["total"] / 1e9
    bound = sum(times.values())
    return {
        "times_s": times,
        "bound_step_s": bound,
        "gflops_per_step": flops,
        "matmul_gflops": matmul_gflops,
        "bound_achieved_gflops": flops / bound,
        "bound_ratio": flops / bound / matmul_gflops,
        "step_s_for_0_70": flops / (0.70 * matmul_gflops),
    }


def _time_blocks(calls: dict, repeats: int) -> dict:
    """Median seconds per call, each call timed in its own block of back-to-back repeats.

    Back-to-back, like grpo_step.py's matmul: each phase at its steady-state best. (Alternating
    the calls round by round made the 1024^3 matmul itself ~30% slower here, 120-130 vs
    160-190 GFLOP/s, which would flatter the ratio.) The matmul is timed before and after the
    phases and the median of both blocks is kept, so slow drift shows in neither side alone.
    """
    samples = {name: [] for name in calls}
    phases = [n for n in calls if n != "matmul"]
    order = ["matmul", *phases, "matmul"] if "matmul" in calls else phases
    for name in order:
        samples[name] += time_calls(*calls[name], repeats)
    return {name: statistics.median(s) for name, s in samples.items()}


def time_calls(fn, inputs: tuple, repeats: int) -> list[float]:
    """Seconds of each of `repeats` back-to-back `fn(*inputs)` calls, after one warm-up call."""
    import jax

    jax.block_until_ready(fn(*inputs))
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        seconds.append(time.perf_counter() - t0)
    return seconds


def alternate(calls, rounds: int) -> list[float]:
    """Median seconds of each call, the calls taking turns for `rounds` rounds (variants compared
    under the same load drift); each call is waited for (`jax.block_until_ready`)."""
    import jax

    seconds = [[] for _ in calls]
    for _ in range(rounds):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            seconds[i].append(time.perf_counter() - t0)
    return [statistics.median(s) for s in seconds]


def main(argv=None) -> dict:
    args = _parse(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags(enable=not args.no_xla_flags)
    from rlbolt.models import workload_config

    result = {"system": "rlbolt-ceiling",
              **measure_bound(workload_config(), 32, 32, 64, repeats=2 if args.quick else args.repeats)}
    print("matmul-only lower bound of the GRPO step at its own shapes (benchmarks/ceiling.py)")
    for name, t in result["times_s"].items():
        print(f"  {name:<28} {t:.3f} s")
    print(f"  {'bound (sum)':<28} {result['bound_step_s']:.3f} s")
    print(f"  {'1024^3 matmul GFLOP/s':<28} {result['matmul_gflops']:.1f}")
    print(f"  {'best achieved / matmul':<28} {result['bound_ratio']:.2f}")
    print(f"  {'step needed for 0.70':<28} {result['step_s_for_0_70']:.3f} s")
    print(json.dumps(result))
    return result


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds (medians are reported)")
    ap.add_argument("--quick", action="store_true", help="2 rounds: a smoke run, numbers not meaningful")
    ap.add_argument("--no-xla-flags", action="store_true", help="do not apply rlbolt's CPU XLA flags")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
