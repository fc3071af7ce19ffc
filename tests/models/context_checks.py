"""Context parallelism on CPU meshes against one device, in a fresh process with 8 CPU devices;
prints one JSON line. `attention`: ring attention (models/context_attention.py), per case the
largest differences of the output and of the gradients (q, k, v) and their derived tolerances
(tests/float_tolerance.py). `decoder`: a decoder's logits and loss gradients on meshes with a
context axis (models/context_parallel.py).

    python tests/models/context_checks.py '{"attention": [{"context": 2}], "decoder": {"meshes": [{"context": 4}]}}'

Reference: `rlbolt.models.attention.attend` over the whole sequence in its original order with
the decoder's mask (causal AND same nonzero segment AND window). The ring gets the same q, k, v
permuted by `balanced_order` (padded to a multiple of 2n with padding tokens), and its output is
permuted back. Rows: 0 left-padded by 5, 1 three packed samples then trailing padding, 2 all
padding (hostile: no real token). Only real query rows are compared (a padding query gets zeros
in the ring and a uniform average under XLA; both are masked downstream), and the gradients are
those of sum(w * out) over real query rows.
"""

from __future__ import annotations

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("MESH_CHECK_DEVICES", "8")))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from float_tolerance import attention_grad_tolerance, attention_tolerance  # noqa: E402

from rlbolt.models.attention import attend  # noqa: E402
from rlbolt.models.context_attention import balanced_order, padded_length, ring_attention  # noqa: E402


def segments_of(b: int, t: int) -> np.ndarray:
    seg = np.zeros((b, t), np.int32)
    seg[0, 5:] = 1
    seg[1, :11], seg[1, 11:12], seg[1, 12:t - 4] = 1, 2, 3
    return seg


def reference(q, k, v, seg, scale, cap, window):
    t = q.shape[1]
    slots = jnp.arange(t)
    visible = (slots[:, None] >= slots[None])[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    if window is not None:
        visible = visible & ((slots[:, None] - slots[None]) < window)[None]
    return attend(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), visible, scale=scale, cap=cap)


def ring(q, k, v, seg, scale, cap, window, mesh, row_axes, balanced=True):
    t = q.shape[1]
    ways = mesh.shape["context"]
    length = padded_length(t, ways)
    pad = length - t
    order = balanced_order(length, ways)
    inverse = np.argsort(order)

    def perm(x):
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return x[:, order]

    out = ring_attention(perm(q), perm(k), perm(v), perm(seg), jnp.asarray(order), mesh=mesh, scale=scale,
                         cap=cap, window=window, row_axes=row_axes, balanced=balanced)
    return out[:, inverse][:, :t]


def attention(cases: list) -> dict:
    results = {}
    for case in cases:
        results[json.dumps(case)] = attention_case(case, case.get("length", 37))
    # teeth: ignoring segments (every token one sample) changes the real outputs by far more
    q, k, v, weight, seg, real, scale, _ = inputs(37)
    ones = jnp.ones_like(seg)
    unmasked = reference(q, k, v, ones, scale, None, None)
    results["teeth"] = float(np.abs(np.asarray(unmasked)[real] - np.asarray(reference(q, k, v, seg, scale, None,
                                                                                         None))[real]).max())
    if not any(case.get("grad_teeth") for case in cases):
        return results
    # and the gradients too: each of dq, dk, dv moves by more than its tolerance (the ratio is reported)
    grad = gradient(real, weight)
    masked_g = grad(lambda q, k, v: reference(q, k, v, seg, scale, None, None))(q, k, v)[1]
    unmasked_g = grad(lambda q, k, v: reference(q, k, v, ones, scale, None, None))(q, k, v)[1]
    tol_g = attention_grad_tolerance(np.asarray(q) * scale, k, v, d_out_of(real, weight, q), q.shape[1])
    results["grad_teeth"] = [float(np.abs(np.asarray(a) - np.asarray(w)).max()) / tol
                             for a, w, tol in zip(unmasked_g, masked_g, tol_g)]
    return results


def inputs(t: int):
    b, n_heads, n_kv, d = 3, 4, 2, 8
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n_heads, d))
    k = jax.random.normal(keys[1], (b, t, n_kv, d))
    v = jax.random.normal(keys[2], (b, t, n_kv, d))
    weight = jax.random.normal(keys[3], (b, t, n_heads * d))
    seg = jnp.asarray(segments_of(b, t))
    return q, k, v, weight, seg, np.asarray(seg > 0), d ** -0.5, b


def gradient(real, weight):
    def loss(fn, q, k, v):
        out = fn(q, k, v)
        return jnp.sum(jnp.where(jnp.asarray(real)[..., None], out * weight, 0.0)), out

    return lambda fn: jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2), has_aux=True))


def d_out_of(real, weight, q):
    return np.where(real[..., None], np.asarray(weight), 0.0).reshape(q.shape)


def attention_case(case: dict, t: int) -> dict:
    q, k, v, weight, seg, real, scale, b = inputs(t)
    grad = gradient(real, weight)
    ways, rows = case["context"], case.get("rows", 1)
    cap, window = case.get("cap"), case.get("window")
    devices = np.asarray(jax.devices()[: ways * rows]).reshape(rows, ways)
    mesh = Mesh(devices, ("fsdp", "context"), axis_types=(AxisType.Auto,) * 2)
    row_axes = "fsdp" if rows > 1 and not case.get("replicated_rows") else None
    if row_axes:  # B = 3 rows do not split over 2: the case pads them to 4 (else: every row on every fsdp device)
        pad_rows = lambda x: jnp.pad(x, ((0, 1),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
    else:
        pad_rows = lambda x: x  # noqa: E731

    def ring_fn(q, k, v):
        out = ring(pad_rows(q), pad_rows(k), pad_rows(v), pad_rows(seg), scale, cap, window, mesh, row_axes,
                   case.get("balanced", True))
        return out[:b]

    ref_fn = lambda q, k, v: reference(q, k, v, seg, scale, cap, window)  # noqa: E731
    (_, want), want_g = grad(ref_fn)(q, k, v)
    (_, got), got_g = grad(ring_fn)(q, k, v)
    tol_g = attention_grad_tolerance(np.asarray(q) * scale, k, v, d_out_of(real, weight, q), t)
    return {
        "out_diff": float(np.abs(np.asarray(got)[real] - np.asarray(want)[real]).max()),
        "out_tol": attention_tolerance(np.asarray(q) * scale, k, v, t),
        "grad_diff": [float(np.abs(np.asarray(a) - np.asarray(w)).max()) for a, w in zip(got_g, want_g)],
        "grad_tol": list(tol_g),
        "grad_scale": [float(np.abs(np.asarray(w)).max()) for w in want_g],
        "pad_rows_finite": bool(np.isfinite(np.asarray(got)).all()),
    }


def _decoder_run(config, plan, ids, mask, segments=None, scan=False, remat="none"):
    from flax import nnx

    from rlbolt.models import Decoder
    from rlbolt.rollout import left_pad_positions

    model = Decoder(config, rngs=nnx.Rngs(3))
    model.scan_layers, model.remat = scan, remat
    if plan is not None:
        nnx.update(model, plan.place(nnx.state(model)))
        plan.shard_activations(model)
    graphdef, params = nnx.split(model)
    if segments is None:
        positions, seg = left_pad_positions(jnp.asarray(mask)), None
    else:  # packed rows: positions restart at 0 for each sample
        starts = np.maximum.accumulate(np.where(np.diff(segments, prepend=-1, axis=1) != 0,
                                                np.arange(segments.shape[1]), 0), axis=1)
        positions, seg = jnp.asarray(np.arange(segments.shape[1]) - starts, jnp.int32), jnp.asarray(segments)

    def loss(params, ids, mask):
        logits, _ = nnx.merge(graphdef, params)(ids, positions, attention_mask=mask, segment_ids=seg)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
        scored = mask[:, :-1] & mask[:, 1:]  # real tokens predicted from a real position (a pad query's output is unspecified)
        if seg is not None:
            scored = scored & (seg[:, :-1] == seg[:, 1:])  # within one sample
        return -jnp.sum(jnp.where(scored, picked, 0.0)) / jnp.sum(scored), logits

    batch = (jnp.asarray(ids), jnp.asarray(mask)) if plan is None else plan.put_full((ids, mask))
    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    (value, logits), grads = step(params, *batch)
    text = step.lower(params, *batch).as_text() if plan is not None else ""
    return (float(value), np.asarray(logits), {jax.tree_util.keystr(p): np.asarray(g)
                                               for p, g in jax.tree_util.tree_leaves_with_path(grads)},
            "collective_permute" in text or "ppermute" in text)


def decoder(arg: dict) -> dict:
    """A 2-layer decoder's logits and loss gradients on each mesh of `arg["meshes"]` against one device.
    `arg["model"]`: "gemma" (a sliding layer with soft-capping, GQA 4/2) or "llama"."""
    from float_tolerance import decoder_tolerance

    from rlbolt.distributed import MeshSpec, ShardingPlan
    from rlbolt.models import tiny_config

    shape = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                 intermediate_size=48)
    if arg.get("model", "gemma") == "gemma":
        shape.update(attn_logit_softcapping=5.0, sliding_window=7, layer_types=("sliding_attention", "full_attention"))
    elif arg["model"] == "moe":  # a Qwen3-MoE layer and a dense one
        shape.update(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,))
    config = tiny_config(**shape)
    rng = np.random.default_rng(0)
    rows, width = 4, arg.get("width", 37)
    ids = rng.integers(1, 64, (rows, width)).astype(np.int32)
    mask = np.ones((rows, width), bool)
    for r, lead in enumerate((0, 3, 9, 20)):  # left padding of varied lengths
        mask[r, :lead] = False
    segments = None
    if arg.get("packed"):  # rows of several samples end to end, then trailing padding (plan.packing: on)
        segments = np.zeros((rows, width), np.int32)
        for r, cuts in enumerate(((0, 10, 25, 33), (0, 30), (0, 1, 2, 20, width), (0, 5))):
            for s, (a, b) in enumerate(zip(cuts, cuts[1:])):
                segments[r, a:b] = s + 1
        mask = segments > 0
    ids = np.where(mask, ids, 0)
    variant = dict(scan=arg.get("scan", False), remat=arg.get("remat", "none"))
    one_loss, one_logits, one_grads, _ = _decoder_run(config, None, ids, mask, segments, **variant)
    results = {}
    for mesh in arg["meshes"]:
        devices = jax.devices()[: int(np.prod(list(mesh.values())))]
        loss, logits, grads, ring = _decoder_run(config, ShardingPlan(MeshSpec(**{"fsdp": 1, **mesh}).build(devices)),
                                                 ids, mask, segments, **variant)
        results[json.dumps(mesh, sort_keys=True)] = {
            "ring": ring,
            "loss_diff": abs(loss - one_loss),
            "logit_diff": float(np.abs(logits - one_logits)[mask].max()),
            "logit_tol": decoder_tolerance(one_logits[mask], config, width),
            "grad_excess": max(float(np.abs(grads[k] - g).max()) - decoder_tolerance(g, config, width)
                               for k, g in one_grads.items()),
        }
    return results


CHECKS = {"attention": attention, "decoder": decoder, "packed": lambda arg: decoder({**arg, "packed": True}),
          "moe": lambda arg: decoder({**arg, "model": "moe"}),
          "scanned": lambda arg: decoder({**arg, "model": "llama", "scan": True, "remat": "full"})}

if __name__ == "__main__":  # {"attention": [...], "decoder": {...}}: each check named, in one process
    print(json.dumps({what: CHECKS[what](arg) for what, arg in json.loads(sys.argv[1]).items()}))
