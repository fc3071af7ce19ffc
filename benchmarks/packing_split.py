"""Where the packed and the padded update spend their CPU time: the layers, attention inside them, the
output projection + log-softmax, and the optimizer, each timed on its own (forward + gradient) in one
process on `packing_ab.py`'s batch, the parts taking turns (medians of this process's CPU time).

    python benchmarks/packing_split.py                # 16 samples of 128..512 tokens, 8 layers, 3 rounds
    python benchmarks/packing_split.py --layers 30

Parts: `layers` is the decoder up to the final norm (embedding, 8 layers, norm) over the rows, gradient
of a fixed projection of the hidden states; `attention` is `rlbolt.models.attention.attend` alone (its
masks included) once per layer at the same rows; `head` is `lm_head_logps` with the entropy over the
tokens each path projects (padded: the N x C completion slots; packed: every packed token, or the
predicting states of the real completion tokens only); `optimizer` is AdamW's step on the parameters.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402
from packing_ab import alternate_timed, build_batch  # noqa: E402
from shapes import smollm2_135m_config  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    from rlbolt.batch import Batch
    from rlbolt.models import Decoder
    from rlbolt.models.attention import attend, segment_visible
    from rlbolt.models.lm_head_logps import lm_head_logps
    from rlbolt.packing import PackingSpec, with_pack_columns

    config = smollm2_135m_config(num_layers=args.layers)
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)), nnx.Param)
    n, width = args.samples, args.max_len
    pi, pm, ci, cm = build_batch(n, width, config.vocab_size)
    packed = with_pack_columns(Batch(prompt_ids=pi, prompt_mask=pm, completion_ids=ci, completion_mask=cm), n,
                               PackingSpec())
    rows = packed["pack_rows"].shape[1]
    hid, heads, kv, d = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    rng = np.random.default_rng(0)

    def layers_part(b):
        ids = jnp.asarray(rng.integers(3, config.vocab_size, (b, width)), jnp.int32)
        pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (b, width))
        seg = jnp.ones((b, width), jnp.int32)
        probe = jnp.asarray(rng.standard_normal((hid,)), jnp.float32)

        def loss(prm):
            model = nnx.merge(graphdef, prm)
            hidden, _ = model(ids, pos, attention_mask=seg > 0, segment_ids=seg, return_hidden=True)
            return jnp.sum(hidden @ probe)
        f = jax.jit(jax.grad(loss))
        return lambda: f(params)

    def attention_part(b):
        q = jnp.asarray(rng.standard_normal((b, width, heads, d)), jnp.float32)
        k = jnp.asarray(rng.standard_normal((b, kv, d, width)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((b, kv, width, d)), jnp.float32)
        seg = jnp.ones((b, width), jnp.int32)

        def loss(q, k, v):
            visible = jnp.tril(jnp.ones((width, width), bool))[None] & segment_visible(seg)
            return jnp.sum(attend(q, k, v, visible))
        f = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        return lambda: [f(q, k, v) for _ in range(args.layers)][-1]

    weight = nnx.merge(graphdef, params).output_weight()

    def head_part(tokens):
        h = jnp.asarray(rng.standard_normal((1, tokens, hid)), jnp.float32)
        t = jnp.asarray(rng.integers(3, config.vocab_size, (1, tokens)), jnp.int32)

        def loss(h, w):
            lp, ent = lm_head_logps(h, w, t, with_entropy=True)
            return jnp.sum(lp) + 0.01 * jnp.sum(ent)
        f = jax.jit(jax.grad(loss, argnums=(0, 1)))
        return lambda: f(h, weight)

    optimizer = optax.adamw(1e-6)
    opt_state = optimizer.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    opt = jax.jit(lambda g, s, p: optax.apply_updates(p, optimizer.update(g, s, p)[0]))
    completion = int(cm.sum())
    parts = {"layers_padded": layers_part(n), "layers_packed": layers_part(rows),
             "attention_padded": attention_part(n), "attention_packed": attention_part(rows),
             f"head_padded_{n * (width - pm.shape[1])}": head_part(n * (width - pm.shape[1])),
             f"head_packed_all_{rows * width}": head_part(rows * width),
             f"head_packed_completion_{completion}": head_part(completion),
             "optimizer": lambda: opt(grads, opt_state, params)}
    calls = list(parts.values())
    for call in calls:
        jax.block_until_ready(call())
    timed = alternate_timed(calls, args.rounds)
    result = {"system": "rlbolt-packing-split", "cpu": cpu_model(), "layers": args.layers, "rounds": args.rounds,
              "samples": n, "max_len": width, "packed_rows": rows,
              **{f"{name}_cpu_s": cpu for name, (_, cpu) in zip(parts, timed)}}
    for name, (wall, cpu) in zip(parts, timed):
        print(f"  {name:34} wall {wall:7.3f} s   CPU {cpu:7.3f} s")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
