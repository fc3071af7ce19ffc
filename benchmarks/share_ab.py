"""The prompt once per group against every sample running its own prompt, phase by phase, in one
process with the variants alternating every round (medians): robust on a busy machine, where
back-to-back `grpo_step.py` runs drift with the other load.

Phases: the rollout (NativeSampler, share_prompts on/off), the reference-logps forward
(`token_logps`, group_size G / 1) and the update's forward + backward (the gradient of
`sum(logps * advantages)`, group_size G / 1). Model: the workload's (vocab 512, hidden 256,
4 layers, GQA 4/2, float32).

    python benchmarks/share_ab.py                                   # 8 prompts x G=4, 32 + 64 tokens
    python benchmarks/share_ab.py --prompts 2 --group 16 --prompt-len 1024   # long prompts, large groups
    python benchmarks/share_ab.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceiling import alternate  # noqa: E402
from flops import duplicate_prompt_share  # noqa: E402


def main(argv=None) -> dict:
    args = _parse(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from rlbolt.models import Decoder, workload_config
    from rlbolt.rollout import NativeSampler, token_logps

    g, p, c = args.group, args.prompt_len, args.new_tokens
    config = workload_config(max_position_embeddings=max(512, p + c))  # positions only: same weights
    model = Decoder(config, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    n = args.prompts * g
    rng = np.random.default_rng(0)
    prompts = [row for row in rng.integers(2, config.vocab_size, (args.prompts, p)).tolist() for _ in range(g)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), n)), np.uint32)
    samplers = {share: NativeSampler(model, max_new_tokens=c, temperature=1.0, prompt_buckets=(p,), share_prompts=share)
                for share in (True, False)}
    out = samplers[True].generate(prompts, keys)
    inputs = tuple(jnp.asarray(x) for x in (out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask))
    advantages = jnp.asarray(rng.standard_normal((n, 1)), jnp.float32)

    def loss(prm, group):
        return jnp.sum(token_logps(graphdef, prm, *inputs, group_size=group) * advantages)

    logps = {s: jax.jit(lambda prm, s=s: token_logps(graphdef, prm, *inputs, group_size=g if s else 1))
             for s in (True, False)}
    grads = {s: jax.jit(jax.grad(lambda prm, s=s: loss(prm, g if s else 1))) for s in (True, False)}
    calls = {("rollout", s): (lambda s=s: samplers[s].generate(prompts, keys).completion_ids) for s in (True, False)}
    calls |= {("logps", s): (lambda s=s: logps[s](params)) for s in (True, False)}
    calls |= {("update", s): (lambda s=s: grads[s](params)) for s in (True, False)}
    for fn in calls.values():  # compile and warm
        jax.block_until_ready(fn())
    rounds = 2 if args.quick else args.rounds
    med = dict(zip(calls, alternate(list(calls.values()), rounds)))
    result = {"system": "rlbolt-share-ab", "prompts": args.prompts, "group": g, "prompt_len": p, "new_tokens": c,
              "rounds": rounds,
              "duplicate_prompt_token_share": duplicate_prompt_share(n, p, c, g),
              **{f"{phase}_s_{'shared' if s else 'unshared'}": v for (phase, s), v in med.items()},
              **{f"{phase}_speedup": med[phase, False] / med[phase, True] for phase in ("rollout", "logps", "update")}}
    print(f"prompt once per group vs per sample: {args.prompts} prompts x G={g}, {p} + {c} tokens, "
          f"{result['rounds']} alternating rounds (medians)")
    for phase in ("rollout", "logps", "update"):
        print(f"  {phase:<8} unshared {med[phase, False]:.3f} s   shared {med[phase, True]:.3f} s   "
              f"x{result[f'{phase}_speedup']:.2f}")
    print(json.dumps(result))
    return result


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true", help="2 rounds: a smoke run")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
