"""Compile time of the update's gradient against depth: before (layers and query chunks unrolled)
and after (query chunks looped, `model.scan_layers`), on this CPU.

The model is small in width (H 64, 4 heads, vocabulary 256) so that compile time, not the
shapes, is what grows: the gradient of the summed completion log-probabilities of 2 sequences of
T tokens, lowered and compiled (no run). "before" sets CHUNK_GROUPS past the chunk count, which
is the unrolled loop of earlier versions.

    python benchmarks/compile_depth.py            # depths 2, 8, 28 at 1,024 tokens
    python benchmarks/compile_depth.py --quick    # depths 2, 4 at 256 tokens

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

from rlbolt.models import Decoder, attention_chunks, tiny_config  # noqa: E402

VARIANTS = {"before": dict(groups=10 ** 6, scan=False), "chunk_loop": dict(groups=4, scan=False),
            "chunk_loop+scan": dict(groups=4, scan=True)}


def compile_seconds(layers: int, tokens: int, groups: int, scan: bool) -> float:
    """Seconds to lower and compile the gradient for one depth and variant."""
    attention_chunks.CHUNK_GROUPS = groups
    model = Decoder(tiny_config(num_layers=layers, max_position_embeddings=tokens), rngs=nnx.Rngs(0))
    model.scan_layers = scan
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.zeros((2, tokens), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens), ids.shape)

    def loss(p):
        logits = nnx.merge(graphdef, p)(ids, positions)[0]
        return jnp.sum(jax.nn.log_softmax(logits)[..., 1])

    start = time.perf_counter()
    jax.jit(jax.grad(loss)).lower(params).compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    depths, tokens = ((2, 4), 256) if args.quick else ((2, 8, 28), 1024)
    results = {name: {} for name in VARIANTS}
    print(f"compile of the grad, {tokens} tokens x 2 rows, H 64; cpu: {cpu_model()}")
    print(f"{'layers':>6} " + " ".join(f"{name:>16}" for name in VARIANTS))
    for depth in depths:
        for name, variant in VARIANTS.items():
            results[name][depth] = round(compile_seconds(depth, tokens, **variant), 2)
        print(f"{depth:>6} " + " ".join(f"{results[name][depth]:>15.2f}s" for name in VARIANTS))
    deepest = depths[-1]
    print(json.dumps({"cpu": cpu_model(), "tokens": tokens, "compile_s": results,
                      "after_over_before_deepest": round(results["chunk_loop+scan"][deepest]
                                                         / results["before"][deepest], 3)}))


if __name__ == "__main__":
    main()
