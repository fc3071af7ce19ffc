"""Placement checks on 8 CPU devices, run in a fresh process; prints one JSON line.

    python tests/distributed/placement_checks.py transfer   WeightSync onto other layouts
    python tests/distributed/placement_checks.py fit        colocated vs disaggregated (sync), async timeline
    python tests/distributed/placement_checks.py transfer,reference   several in one process: {name: result}

`transfer` moves a tiny decoder's parameters from a training mesh on devices 0-3 (fsdp=4) onto
rollout meshes of another layout (devices 4-7 as fsdp=2 x tp=2; devices 6-7 as fsdp=2) and
reports: equal values, the target shardings, every target device's live bytes against the
shard bytes worked out from the specs, and the compiled reshard's per-device memory.

`fit` trains GRPO (SGD, so parameters compare tightly) colocated on devices 0-3, then with
train on 0-3 and rollout on 4-7 (same mesh shape, so the same float sums: results must be
bitwise equal), then the same placement in async mode, and reports metrics, parameters and
the timeline's events.
"""

from __future__ import annotations

import json
import math
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from rlbolt.distributed import MeshSpec, ShardingPlan  # noqa: E402
from rlbolt.distributed.placement import Placement, WeightSync  # noqa: E402


def transfer() -> dict:
    from rlbolt.models import Decoder, tiny_config
    from flax import nnx

    devices = jax.devices()
    train = ShardingPlan(MeshSpec(fsdp=4).build(devices[:4]))
    model = train.build_module(lambda: Decoder(tiny_config(hidden_size=64, intermediate_size=128, head_dim=16),
                                               rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    out = {"total_bytes": total, "cases": []}
    for start, stop, shape in ((4, 8, {"fsdp": 2, "tp": 2}), (6, 8, {"fsdp": 2})):
        target = ShardingPlan(MeshSpec.of(shape).build(devices[start:stop]))
        sync = WeightSync(train, target)
        before = _device_bytes(devices[start:stop])
        moved = sync(params)
        jax.block_until_ready(moved)
        after = _device_bytes(devices[start:stop])
        want_shardings, _ = sync.shardings(params)
        expected = {}
        for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(want_shardings)):
            shards = math.prod(target.mesh.shape[a] for axes in sharding.spec if axes
                               for a in ((axes,) if isinstance(axes, str) else axes))
            for d in sharding.device_set:
                expected[d.id] = expected.get(d.id, 0) + leaf.nbytes // shards
        mem = sync.stage_fn(params).lower(params).compile().memory_analysis()
        out["cases"].append({
            "target": [start, stop, shape],
            "equal": all(np.array_equal(np.asarray(a), np.asarray(b))
                         for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(moved))),
            "on_target": all(x.sharding == s for x, s in zip(jax.tree.leaves(moved), jax.tree.leaves(want_shardings))),
            "live_bytes": {str(d): after.get(d, 0) - before.get(d, 0) for d in range(start, stop)},
            "expected_bytes": {str(d): expected.get(d, 0) for d in range(start, stop)},
            "staging_peak_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes),
            "staging_temp_bytes": int(mem.temp_size_in_bytes),
        })
        del moved
    return out


def _device_bytes(devices) -> dict[int, int]:
    ids, out = {d.id for d in devices}, {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device.id in ids:
                out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def fit() -> dict:
    from rlbolt.callback import Callback
    from rlbolt.data import gsm8k_style_rows
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    class SGDGRPO(GRPO):
        def configure_optimizers(self):
            return optax.sgd(0.5, momentum=0.9)

    def digits(completion: str, sample) -> float:
        return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)

    split = {"train": {"devices": [0, 4], "mesh": {"fsdp": 4}}, "rollout": {"devices": [4, 8], "mesh": {"fsdp": 4}}}

    def run(placement, mode="sync", steps=3):
        rows, completions = [], []

        class Record(Callback):
            def on_rollout_end(self, trainer, produced):
                completions.append(np.asarray(produced.batch["completion_ids"]).tolist())

            def on_step_end(self, trainer, info):
                rows.append({k: float(info.metrics[k]) for k in
                             ("loss", "reward/mean", "grad_norm", "kl", "staleness/max")})

        module = SGDGRPO({"rollout": {"max_new_tokens": 8}, "algorithm": {"beta": 0.04},
                          "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "head_dim": 8}}},
                         reward=digits)
        plan = BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8)
        colocated = ShardingPlan(MeshSpec(fsdp=4).build(jax.devices()[:4]))
        trainer = Trainer(plan, max_steps=steps, callbacks=[Record()], run_dir="unused", mode=mode,
                          max_staleness=1 if mode == "async" else None,
                          mesh=colocated if placement == "colocated" else None, placement=placement)
        state = trainer.fit(module, gsm8k_style_rows(16))
        rollout_devices = sorted(d.id for d in trainer.sharding_for("rollout").mesh.devices.flat)
        return {"steps": rows, "completions": completions, "rollout_devices": rollout_devices,
                "events": trainer.timeline.drain()}, state.params

    colocated, p_col = run("colocated")
    split_sync, p_split = run(split)
    split_async, _ = run(split, mode="async", steps=4)
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(p_col), jax.tree.leaves(p_split)))
    return {"colocated": colocated, "split": split_sync, "async": split_async, "max_param_diff": diff,
            "placement_error": _bad_placement()}


def _bad_placement() -> str:
    try:
        Placement.of({"train": {"devices": [0, 4]}, "rollout": {"devices": [2, 6]}}).plans()
    except ValueError as error:
        return str(error)
    return ""


# -- the reference on devices of its own ------------------------------------------------------------
# Every role on a 2-device fsdp mesh (the colocated run on devices 0-1), so the float sums match.
TWO = {"fsdp": 2}
REF_APART = {"train": {"devices": [0, 2], "mesh": TWO}, "rollout": {"devices": [2, 4], "mesh": TWO},
             "reference": {"devices": [4, 6], "mesh": TWO}}
REF_TRAIN = {"train": {"devices": [0, 2], "mesh": TWO}, "rollout": {"devices": [2, 4], "mesh": TWO}}


def _ref_trainer(placement, steps=3, record=()):
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    class SGDGRPO(GRPO):
        def configure_optimizers(self):
            return optax.sgd(0.5, momentum=0.9)

    def digits(completion: str, sample) -> float:
        return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)

    module = SGDGRPO({"rollout": {"max_new_tokens": 8}, "algorithm": {"beta": 0.04}, "reward": {"executor": "thread"},
                      "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "head_dim": 8}}}, reward=digits)
    mesh = ShardingPlan(MeshSpec(**TWO).build(jax.devices()[:2])) if placement == "colocated" else None
    trainer = Trainer(BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8), max_steps=steps,
                      callbacks=list(record), run_dir="unused", mesh=mesh, placement=placement)
    return trainer, module


def _token_batch(n=8, p=6, c=5, vocab=64):
    from rlbolt.batch import Batch

    rng = np.random.default_rng(3)
    mask = np.arange(c)[None, :] < rng.integers(1, c + 1, size=(n, 1))
    return Batch(prompt_ids=rng.integers(1, vocab, size=(n, p)).astype(np.int32), prompt_mask=np.ones((n, p), bool),
                 completion_ids=rng.integers(1, vocab, size=(n, c)).astype(np.int32), completion_mask=mask,
                 sampler_logps=np.zeros((n, c), np.float32))


def reference() -> dict:
    """Set-up only (no fit): where the reference lives, and its logps against the training mesh's."""
    import gc

    from rlbolt.data import gsm8k_style_rows

    out = {}
    for name, placement in (("train", REF_TRAIN), ("apart", REF_APART)):
        gc.collect()
        before = _device_bytes(jax.devices())
        trainer, module = _ref_trainer(placement)
        trainer._setup(module, gsm8k_style_rows(16), None)
        gc.collect()
        after = _device_bytes(jax.devices())
        leaves = jax.tree.leaves(module.ref_params)
        expected = {}
        for leaf in leaves:
            for shard in leaf.addressable_shards:  # independent of the live-array walk: the leaf's own shards
                expected[shard.device.id] = expected.get(shard.device.id, 0) + shard.data.nbytes
        logps = module.compute_logps(None, _token_batch())["ref_logps"]
        out[name] = {"live_bytes": {str(d): after.get(d, 0) - before.get(d, 0) for d in range(8)},
                     "ref_devices": sorted({d.id for x in leaves for d in x.sharding.device_set}),
                     "ref_shard_bytes": {str(d): b for d, b in expected.items()},
                     "ref_total_bytes": sum(x.nbytes for x in leaves),
                     "memory_items": sorted(trainer.memory_plan.items),
                     "ref_logps": np.asarray(logps).tolist()}
        if name == "apart":  # a reference mesh of 4 (fsdp) does not divide train's 2 devices: device_put instead
            from rlbolt.modules.reference import PlacedReference

            wide = ShardingPlan(MeshSpec(fsdp=4).build(jax.devices()[4:8]))
            placed = PlacedReference(module.model, module.sharding, wide, temperature=1.0)
            out["wide"] = {"ref_devices": sorted({d.id for x in jax.tree.leaves(placed.params) for d in x.sharding.device_set}),
                           "ref_logps": placed.logps(_token_batch()).tolist()}
            del placed
        del trainer, module, leaves, logps
    out["errors"] = _reference_errors()
    return out


def _reference_errors() -> list[str]:
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    errors = []
    odd = {**REF_APART, "reference": {"devices": [4, 8], "mesh": {"fsdp": 4}}}
    try:  # logps micro batches of 6 rows cannot split over the reference mesh's 4 batch shards
        Trainer(BatchPlan(prompts_per_step=3, num_generations=2, train_micro_batch_size=2, logps_micro_batch_size=6),
                max_steps=1, run_dir="unused", placement=odd).fit(_ref_trainer(REF_APART)[1], [{"q": "1"}] * 3)
    except ValueError as error:
        errors.append(str(error))
    return errors


def reference_fit() -> dict:
    """Colocated vs the reference on its own devices (sync): metrics, completions, parameters."""
    from rlbolt.callback import Callback
    from rlbolt.data import gsm8k_style_rows

    def run(placement):
        rows, completions = [], []

        class Record(Callback):
            def on_rollout_end(self, trainer, produced):
                completions.append(np.asarray(produced.batch["completion_ids"]).tolist())

            def on_step_end(self, trainer, info):
                rows.append({k: float(info.metrics[k]) for k in ("loss", "reward/mean", "grad_norm", "kl", "loss/kl")})

        trainer, module = _ref_trainer(placement, record=[Record()])
        state = trainer.fit(module, gsm8k_style_rows(16))
        ref_devices = sorted({d.id for x in jax.tree.leaves(module.ref_params) for d in x.sharding.device_set})
        return {"steps": rows, "completions": completions, "ref_devices": ref_devices}, state.params

    colocated, p_col = run("colocated")
    apart, p_apart = run(REF_APART)
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(p_col), jax.tree.leaves(p_apart)))
    return {"colocated": colocated, "apart": apart, "max_param_diff": diff}


if __name__ == "__main__":
    # One check, or several in one process ("transfer,reference": the default tier's two, one JAX start);
    # several print {name: result}. Each check's arrays are gone before the next one counts live bytes.
    import gc

    checks = {"transfer": transfer, "fit": fit, "reference": reference, "reference_fit": reference_fit}
    names = sys.argv[1].split(",")
    results = {}
    for name in names:
        results[name] = checks[name]()
        gc.collect()
    print(json.dumps(results[names[0]] if len(names) == 1 else results))
