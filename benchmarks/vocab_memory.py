"""Peak memory of the logps pass and of one training micro batch against the vocabulary size and
the completion length, with the output projection chunked (`model.logits_chunk_tokens`) and not.

Two passes of a GRPO module (beta 0.04, so the training step also reads reference logps; the
entropy metric reads the whole distribution): the logps pass (`compute_logps`'s jitted forward:
old, reference and teacher logps all take it) and the training micro batch's loss + gradient
(`jax.grad(training_step)`). Model: a small trunk (2 layers, width 64, 4/2 heads of 16, tied
embeddings, float32) under vocabularies of 32,000, 49,152 (SmolLM2) and 151,936 (Qwen2.5), so
the logits are what the memory is about. Micro batch: 8 rows (2 prompts x G=4), 48-token prompts.

For every point, two figures:
- `temp`: the compiled program's scratch (`jit(...).lower(...).compile().memory_analysis()`,
  temp_size_in_bytes): computed, nothing runs, so it is given for every size;
- `rss`: the peak resident memory of a fresh process that builds the model and runs the training
  step once (`ru_maxrss`, compilation and the JAX runtime included), over the vocabulary sweep,
  where the compiled figures say it fits under `--rss-limit-gb` (the machine is shared).

Variants: "off" (`logits_chunk_tokens: 0`, the plain expression), "previous" (the projection as
it was before the setting: 128 positions of every row per chunk under `jax.checkpoint`, traced in
place of the current one; compiled figures only) and the default chunk of 1,024 tokens ("on").

Then the speed cost: one training micro batch's loss + gradient at the SmolLM2-135M shape (30
layers, width 576, vocab 49,152, random float32 weights), 8 rows x (48 + 128) tokens, for off,
previous, 256, 512 and 1,024 tokens, taking turns for `--rounds` rounds (medians).

    python benchmarks/vocab_memory.py                 # the tables and one JSON line
    python benchmarks/vocab_memory.py --quick         # tiny sizes (a smoke run; numbers mean little)
    python benchmarks/vocab_memory.py --no-timing     # memory only (--no-memory: the timing only)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceiling import alternate  # noqa: E402
from machine import cpu_model  # noqa: E402

ROWS, GROUP, PROMPT = 8, 4, 48
TRUNK = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
             tie_word_embeddings=True)
VOCABS = (32000, 49152, 151936)
LENGTHS = (128, 512, 1024, 2048)  # completion tokens, at the largest vocabulary
LENGTH_AT_VOCAB_SWEEP = 512
CHUNK_ON = 1024  # the default of model.logits_chunk_tokens (lm_head_logps.DEFAULT_LOGITS_CHUNK_TOKENS)


def _previous_chunked_logps(hidden, weight, targets, temperature, chunk_size, with_entropy, softcap=None):
    """The projection as it was before `model.logits_chunk_tokens` (the "previous" variant): lax.map
    over 128 positions of every row, each chunk under jax.checkpoint (autodiff's own backward)."""
    import jax
    import jax.numpy as jnp

    b, c, h = hidden.shape
    chunk = min(128, c)
    n = -(-c // chunk)
    hidden = jnp.pad(hidden, ((0, 0), (0, n * chunk - c), (0, 0))).reshape(b, n, chunk, h).swapaxes(0, 1)
    targets = jnp.pad(targets, ((0, 0), (0, n * chunk - c))).reshape(b, n, chunk).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        logits = jnp.dot(args[0], weight).astype(jnp.float32)
        if softcap is not None:
            logits = softcap * jnp.tanh(logits / softcap)
        logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)
        logp = jnp.take_along_axis(logp_all, args[1][..., None], axis=-1)[..., 0]
        entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1) if with_entropy else jnp.zeros_like(logp)
        return logp, entropy

    logps, entropy = jax.lax.map(one, (hidden, targets))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * chunk)[:, :c]  # noqa: E731
    return unchunk(logps), unchunk(entropy)


def _traced(variant, fn, *args):
    """`fn(*args)`, traced with the previous projection in place when `variant` is "previous"."""
    from rlbolt.models import logps

    current = logps.chunked_logps
    if variant == "previous":
        logps.chunked_logps = _previous_chunked_logps
    try:
        return fn(*args)
    finally:
        logps.chunked_logps = current


def _module(config, chunk: int, seed: int = 0):
    """A set-up GRPO module around a random Decoder of `config` with the given logits chunk."""
    from flax import nnx

    from rlbolt.models import Decoder
    from rlbolt.modules import GRPO
    from rlbolt.modules.prompts import builtin_tokenizer
    from rlbolt.plan import BatchPlan
    from rlbolt.setup_context import SetupContext

    module = GRPO({"algorithm": {"beta": 0.04}, "model": {"logits_chunk_tokens": chunk}},
                  model=Decoder(config, rngs=nnx.Rngs(seed)), tokenizer=builtin_tokenizer())
    module.setup(SetupContext(BatchPlan(ROWS // GROUP, GROUP)))
    return module


def _columns(completion: int, concrete: bool, vocab: int):
    """The micro batch's columns: ShapeDtypeStructs, or random arrays in the `a a a a b b b b` layout."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    specs = {"prompt_ids": ((ROWS, PROMPT), jnp.int32), "prompt_mask": ((ROWS, PROMPT), bool),
             "completion_ids": ((ROWS, completion), jnp.int32), "completion_mask": ((ROWS, completion), bool),
             "old_logps": ((ROWS, completion), jnp.float32), "ref_logps": ((ROWS, completion), jnp.float32),
             "advantages": ((ROWS,), jnp.float32)}
    if not concrete:
        return {k: jax.ShapeDtypeStruct(s, d) for k, (s, d) in specs.items()}
    rng = np.random.default_rng(0)
    prompts = np.repeat(rng.integers(2, vocab, (ROWS // GROUP, PROMPT)), GROUP, axis=0)
    lengths = rng.integers(completion // 2, completion + 1, ROWS)
    return {"prompt_ids": jnp.asarray(prompts, jnp.int32), "prompt_mask": jnp.ones((ROWS, PROMPT), bool),
            "completion_ids": jnp.asarray(rng.integers(2, vocab, (ROWS, completion)), jnp.int32),
            "completion_mask": jnp.asarray(np.arange(completion)[None] < lengths[:, None]),
            "old_logps": jnp.full((ROWS, completion), -np.log(vocab), jnp.float32),
            "ref_logps": jnp.full((ROWS, completion), -np.log(vocab), jnp.float32),
            "advantages": jnp.asarray(rng.standard_normal(ROWS), jnp.float32)}


def _pass(module, kind: str):
    """(jitted function, how to call it with params and columns) of the logps pass or the training step."""
    import jax

    from rlbolt.batch import Batch
    from rlbolt.update import add_mini_batch_totals

    if kind == "logps":
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
        fn = jax.jit(lambda p, cols: module.policy.logps(p, *(cols[k] for k in keys), group_size=GROUP))
    else:
        fn = jax.jit(jax.grad(lambda p, cols: module.training_step(p, add_mini_batch_totals(Batch(cols)))[0]))
    return fn


def _variant(name: str) -> tuple[int, str]:
    """A variant's (model.logits_chunk_tokens, how the projection is traced): "off" (0), "previous"
    (the code before this setting), or a chunk size in tokens ("1024")."""
    if name == "off":
        return 0, "current"
    if name == "previous":
        return CHUNK_ON, "previous"
    return int(name), "current"


def compiled_point(vocab: int, completion: int, variant: str, kind: str) -> dict:
    """The compiled scratch and argument bytes of one pass (nothing runs)."""
    import jax
    from flax import nnx

    from rlbolt.models import tiny_config

    chunk, how = _variant(variant)
    module = _module(tiny_config(vocab_size=vocab, max_position_embeddings=PROMPT + completion, **TRUNK), chunk)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.state(module.model, nnx.Param))
    lowered = _traced(how, _pass(module, kind).lower, params, _columns(completion, False, vocab))
    memory = lowered.compile().memory_analysis()
    return {"temp_bytes": int(memory.temp_size_in_bytes), "argument_bytes": int(memory.argument_size_in_bytes),
            "output_bytes": int(memory.output_size_in_bytes)}


def rss_point(vocab: int, completion: int, variant: str, kind: str) -> dict:
    """Run one pass once in this (fresh) process: its peak RSS in MB."""
    import jax
    from flax import nnx

    from rlbolt.models import tiny_config

    chunk, how = _variant(variant)
    module = _module(tiny_config(vocab_size=vocab, max_position_embeddings=PROMPT + completion, **TRUNK), chunk)
    params = nnx.state(module.model, nnx.Param)
    jax.block_until_ready(_traced(how, _pass(module, kind), params, _columns(completion, True, vocab)))
    return {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _rss_in_subprocess(vocab, completion, variant, kind) -> float:
    out = subprocess.run([sys.executable, __file__, "--rss-point", str(vocab), str(completion), variant, kind],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss_mb"]


MEMORY_VARIANTS = ("off", "previous", str(CHUNK_ON))


def memory_sweep(points, rss_limit_bytes: float, rss_points: int | None = None) -> list[dict]:
    """`points` of (vocab, completion); each pass unchunked, as before, and chunked (the default).
    RSS runs for the first `rss_points` points only (None: all that fit)."""
    rows = []
    for index, (vocab, completion) in enumerate(points):
        for kind in ("logps", "train"):
            row = {"vocab": vocab, "completion": completion, "kind": kind,
                   "full_logits_mb": ROWS * completion * vocab * 4 / 1e6}  # [B, C, V] float32
            for variant in MEMORY_VARIANTS:
                label = "on" if variant == str(CHUNK_ON) else variant
                compiled = compiled_point(vocab, completion, variant, kind)
                needed = compiled["temp_bytes"] + compiled["argument_bytes"] + compiled["output_bytes"]
                row[f"temp_mb_{label}"] = compiled["temp_bytes"] / 1e6
                if variant != "previous":  # RSS of the training step, off / on (each a fresh process: slow)
                    wanted = (kind == "train" and needed < rss_limit_bytes
                              and (rss_points is None or index < rss_points))
                    row[f"rss_mb_{label}"] = _rss_in_subprocess(vocab, completion, variant, kind) if wanted else None
            rows.append(row)
            print(_memory_line(row), flush=True)
    return rows


def _memory_line(r: dict) -> str:
    rss = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
    return (f"| {r['vocab']:,} | {r['completion']:,} | {r['kind']} | {r['full_logits_mb']:,.0f} | "
            f"{r['temp_mb_off']:,.0f} | {r['temp_mb_previous']:,.0f} | {r['temp_mb_on']:,.0f} | "
            f"{rss(r['rss_mb_off'])} | {rss(r['rss_mb_on'])} |")


TIMED_VARIANTS = ("off", "previous", "256", "512", "1024")  # 1,024: the default (CHUNK_ON)


def timing(config, completion: int, variants, rounds: int) -> dict:
    """Median seconds of one training micro batch's loss + gradient for each variant, taking turns."""
    import jax
    from flax import nnx

    calls = {}
    for variant in variants:
        chunk, how = _variant(variant)
        module = _module(config, chunk)
        params = nnx.state(module.model, nnx.Param)
        fn, cols = _pass(module, "train"), _columns(completion, True, config.vocab_size)
        jax.block_until_ready(_traced(how, fn, params, cols))  # traced, compiled and warmed up
        calls[variant] = (fn, params, cols)
    medians = alternate([lambda f=fn, p=params, c=cols: f(p, c) for fn, params, cols in calls.values()], rounds)
    return dict(zip(calls, medians))


def main(argv=None) -> dict:
    args = _parse(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    if args.rss_point:
        vocab, completion, variant, kind = args.rss_point
        print(json.dumps(rss_point(int(vocab), int(completion), variant, kind)))
        return {}
    from shapes import smollm2_135m_config

    if args.quick:
        vocabs, lengths, length_at_vocab, rss_points = (512, 1024), (16, 32), 16, 1
    else:  # RSS (a fresh process per figure: slow) over the vocabulary sweep; compiled figures everywhere
        vocabs, lengths, length_at_vocab, rss_points = VOCABS, LENGTHS, LENGTH_AT_VOCAB_SWEEP, len(VOCABS)
    points = [(v, length_at_vocab) for v in vocabs] + [(vocabs[-1], c) for c in lengths if c != length_at_vocab]
    result = {"system": "rlbolt-vocab-memory", "machine": cpu_model(), "rows_per_micro_batch": ROWS,
              "prompt_tokens": PROMPT, "chunk_on": CHUNK_ON, "memory": None}
    if not args.no_memory:
        print(f"machine: {cpu_model()}; micro batch {ROWS} rows (2 prompts x G={GROUP}), {PROMPT}-token prompts; "
              f"trunk {TRUNK}; on = model.logits_chunk_tokens {CHUNK_ON}; previous = 128 positions per row under "
              "jax.checkpoint (before the setting existed)")
        print("| vocab | completion | pass | [B, C, V] f32 MB | temp MB off | temp MB previous | temp MB on | "
              "peak RSS MB off | peak RSS MB on |")
        print("|---|---|---|---|---|---|---|---|---|")
        result["memory"] = memory_sweep(points, args.rss_limit_gb * 1e9, rss_points)
    if not args.no_timing:
        config = smollm2_135m_config(num_layers=2) if args.quick else smollm2_135m_config()
        completion, rounds = (16, 1) if args.quick else (128, args.rounds)
        seconds = timing(config, completion, args.variants or TIMED_VARIANTS, rounds)
        print(f"\ntraining micro batch loss + gradient, SmolLM2-135M shape ({config.num_layers} layers, vocab "
              f"{config.vocab_size:,}), {ROWS} x ({PROMPT} + {completion}) tokens, median of {rounds} rounds")
        print("| logits | seconds | vs off |")
        print("|---|---|---|")
        for variant, s in seconds.items():
            print(f"| {variant} | {s:.2f} | {s / seconds['off']:.2f}x |")
        result["timing"] = {"model": "smollm2-135m-shape", "layers": config.num_layers, "completion": completion,
                            "rounds": rounds, "seconds": seconds}
    print(json.dumps(result))
    return result


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, numbers not meaningful")
    ap.add_argument("--no-timing", action="store_true", help="memory only")
    ap.add_argument("--no-memory", action="store_true", help="the SmolLM2-shape timing only")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of the SmolLM2-shape step")
    ap.add_argument("--variants", nargs="+", help=f"the timed variants (default {' '.join(TIMED_VARIANTS)}); "
                    "off and previous are always wanted for the ratio")
    ap.add_argument("--rss-limit-gb", type=float, default=4.0,
                    help="run a point for its RSS only when its compiled buffers fit under this")
    ap.add_argument("--rss-point", nargs=4, metavar=("VOCAB", "COMPLETION", "VARIANT", "KIND"), help=argparse.SUPPRESS)
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
