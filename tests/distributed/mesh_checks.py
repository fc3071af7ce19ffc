"""Multi-device checks on a CPU mesh, run in a fresh process (8 CPU devices); prints one JSON line.

    python tests/distributed/mesh_checks.py train '{"fsdp": 8}'     GRPO steps: mesh vs one device
    python tests/distributed/mesh_checks.py sampler '[{"fsdp": 8}, {"tp": 4, "fsdp": 2}]'
    python tests/distributed/mesh_checks.py lora '[{"fsdp": 4, "tp": 2}, {"rank": 4, "quantize": "int8"}]'

A mesh dict may also carry `packing` (plan.packing of both runs) and `steps` (GRPO steps, default 2).

`train` runs the same GRPO fit twice in this process, on a one-device mesh and on the given mesh,
and reports per-step metrics, the largest parameter difference, how many forwards were traced through
the ring (`ring_traces`, mesh.context > 1: `rlbolt.models.context_parallel`), and for every parameter and
optimizer-state leaf its global bytes, the bytes of one live shard and its PartitionSpec.
The optimizer is SGD with momentum: its update is linear in the gradient, so a parameter
difference measures the gradient's float rounding directly (Adam would divide near-zero
gradients by their own square root and amplify rounding noise up to the learning rate).

`sampler` compares NativeSampler on each mesh with the no-mesh sampler (greedy and sampled
tokens, logps) and reports the compiled call's per-device argument and temporary bytes.
"""

from __future__ import annotations

import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ.get("MESH_CHECK_DEVICES", "8")))

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from rlbolt.distributed import MeshSpec, ShardingPlan, per_device_bytes  # noqa: E402


def one_device_plan() -> ShardingPlan:
    return ShardingPlan(MeshSpec(fsdp=1).build(jax.devices()[:1]))


def train(mesh: dict, lora: dict | None = None) -> dict:
    mesh = dict(mesh)
    packing = mesh.pop("packing", "off")  # plan.packing of both runs (not a mesh axis)
    max_steps = mesh.pop("steps", 2)
    import rlbolt.models.decoder as decoder_module

    ring_traces = [0]
    context_forward = decoder_module.context_forward

    def counted_context_forward(*args, **kwargs):  # traced once per compiled forward that runs the ring
        ring_traces[0] += 1
        return context_forward(*args, **kwargs)

    decoder_module.context_forward = counted_context_forward
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

    def fit(plan_or_mesh):
        steps, completions = [], []

        class Record(Callback):
            def on_rollout_end(self, trainer, produced):
                completions.append(np.asarray(produced.batch["completion_ids"]).tolist())

            def on_step_end(self, trainer, info):
                steps.append({k: float(info.metrics[k]) for k in ("loss", "reward/mean", "grad_norm", "kl")})

        model = {"tiny": {"hidden_size": 32, "intermediate_size": 64, "head_dim": 8}, "lora": lora}
        module = SGDGRPO({"rollout": {"max_new_tokens": 8}, "algorithm": {"beta": 0.04}, "model": model},
                         reward=digits)
        plan = BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8, packing=packing)
        trainer = Trainer(plan, max_steps=max_steps, mesh=plan_or_mesh, callbacks=[Record()], run_dir="unused")
        state = trainer.fit(module, gsm8k_style_rows(16))
        trainer.frozen_per_device = per_device_bytes(module.lora.base) if module.lora is not None else None
        trainer.train_group_size = module.train_group_size  # 4: each prompt once per group; 1: unshared
        return trainer, state, steps, completions

    ref_trainer, ref_state, ref_steps, ref_completions = fit(one_device_plan())
    ref_ring_traces, ring_traces[0] = ring_traces[0], 0
    trainer, state, steps, completions = fit(mesh)
    ring = {"ring_traces": [ref_ring_traces, ring_traces[0]]}

    def leaves(tree):
        out = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(leaf, jax.Array) and leaf.ndim:
                out.append({"path": jax.tree_util.keystr(path), "bytes": leaf.nbytes,
                            "shard_bytes": leaf.addressable_shards[0].data.nbytes,
                            "spec": [list(a) if isinstance(a, tuple) else a for a in leaf.sharding.spec]})
        return out

    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
               for a, b in zip(jax.tree.leaves(ref_state.params), jax.tree.leaves(state.params)))
    if lora is not None:
        return {**ring, "mesh": dict(trainer.sharding.mesh.shape), "ref_steps": ref_steps, "steps": steps,
                "max_param_diff": diff, "completions_equal": ref_completions == completions,
                "frozen_per_device": trainer.frozen_per_device, "frozen_one_device": ref_trainer.frozen_per_device,
                "adapters_per_device": per_device_bytes(state.params),
                "adapters_one_device": per_device_bytes(ref_state.params)}
    return {**hf_load(trainer.sharding), **ring,
            "mesh": dict(trainer.sharding.mesh.shape), "ref_steps": ref_steps, "steps": steps, "max_param_diff": diff,
            "completions_equal": ref_completions == completions,
            "train_group_size": [ref_trainer.train_group_size, trainer.train_group_size],
            "params": leaves(state.params), "opt_state": leaves(state.opt_state),
            "params_per_device": per_device_bytes(state.params), "opt_per_device": per_device_bytes(state.opt_state),
            "memory_plan": trainer.memory_plan.items}


def hf_load(plan: ShardingPlan) -> dict:
    """A Hugging Face folder read straight into the plan's shardings equals the plain read."""
    import tempfile

    from rlbolt.models import Decoder, tiny_config
    from rlbolt.models.hf_io import load_hf, save_hf

    model = Decoder(tiny_config(architecture="Qwen2ForCausalLM", attention_bias=True), rngs=nnx.Rngs(1))
    with tempfile.TemporaryDirectory() as folder:
        save_hf(model, model.config, folder)
        plain, _ = load_hf(folder)
        sharded, _ = load_hf(folder, sharding=plan)
    a, b = nnx.state(plain), nnx.state(sharded)
    return {"hf_equal": all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))),
            "hf_sharded_as_planned": all(x.sharding == s for x, s in zip(jax.tree.leaves(b), jax.tree.leaves(plan.param_shardings(b)))),
            "hf_per_device": per_device_bytes(b), "hf_total": sum(x.nbytes for x in jax.tree.leaves(a)),
            # replicated by the rules on this mesh (the fused qkv bias follows tp, not fsdp)
            "hf_replicated": sum(x.nbytes for x in jax.tree.leaves(b) if x.sharding.is_fully_replicated)}


def sampler(meshes: list[dict]) -> dict:
    from rlbolt.models import Decoder, tiny_config
    from rlbolt.rollout import NativeSampler
    from rlbolt.rollout.sampler import _generate_jit

    # Two key/value heads: tp=4 cannot split them, so the cache is replicated over tp there.
    config = tiny_config(vocab_size=128, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                         intermediate_size=256)
    model = Decoder(config, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, rng.integers(3, 14)).tolist() for _ in range(12)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.PRNGKey(5), len(prompts))), np.uint32)

    def run(plan):
        out = {}
        for name, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            s = NativeSampler(model, max_new_tokens=12, temperature=temperature, prompt_buckets=(16,), sharding=plan)
            r = s.generate(prompts, keys)
            out[name] = (r.completion_ids, r.completion_mask, r.logps)
        return out, s

    ref, _ = run(None)
    # A model whose weights outweigh its activations (16 rows, 16 + 4 tokens): a sampler that
    # gathered the whole model onto each device would show it in the compiled call's memory.
    heavy = Decoder(tiny_config(vocab_size=512, hidden_size=512, num_layers=2, num_heads=8, num_kv_heads=4,
                                head_dim=64, intermediate_size=1024), rngs=nnx.Rngs(0))

    def compiled_memory(plan):
        s = NativeSampler(heavy, max_new_tokens=4, temperature=1.0, prompt_buckets=(16,), sharding=plan)
        args = plan.put_local((np.ones((16, 16), np.int32), np.ones((16, 16), bool), np.zeros((16, 2), np.uint32)))
        memory = _generate_jit.lower(s._params, *args, graphdef=s._graphdef, sp=s.sampling,
                                     layout=s._layout).compile().memory_analysis()
        return {"heavy_param_bytes": sum(x.nbytes for x in jax.tree.leaves(nnx.state(heavy))),
                "heavy_params_per_device": per_device_bytes(s._params),
                "argument_bytes": memory.argument_size_in_bytes, "temp_bytes": memory.temp_size_in_bytes}

    results = []
    for mesh in meshes:
        plan = ShardingPlan(MeshSpec(**mesh).build())
        got, s = run(plan)
        results.append({
            "mesh": dict(plan.mesh.shape),
            "greedy_equal": bool(np.array_equal(got["greedy"][0], ref["greedy"][0])),
            "sampled_equal": bool(np.array_equal(got["sampled"][0], ref["sampled"][0])
                                  and np.array_equal(got["sampled"][1], ref["sampled"][1])),
            "logp_diff": max(float(np.abs(got[k][2] - ref[k][2]).max()) for k in got),
            "cache_key_spec": [list(a) if isinstance(a, tuple) else a for a in s._layout.keys.spec],
            **compiled_memory(plan),
        })
    # Qwen2 (q/k/v bias) and Qwen3 (q/k norms, tied embeddings) on fsdp=4 x tp=2, greedy.
    architectures = {}
    for name, extra in (("Qwen2ForCausalLM", {"attention_bias": True}),
                        ("Qwen3ForCausalLM", {"qk_norm": True, "tie_word_embeddings": True})):
        arch = Decoder(tiny_config(vocab_size=128, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                                   head_dim=32, intermediate_size=256, architecture=name, **extra), rngs=nnx.Rngs(4))
        plan = ShardingPlan(MeshSpec(fsdp=4, tp=2).build())
        outs = [NativeSampler(arch, max_new_tokens=12, temperature=0.0, prompt_buckets=(16,), sharding=p)
                .generate(prompts, keys).completion_ids for p in (None, plan)]
        architectures[name] = bool(np.array_equal(*outs))
    return {"results": results, "distinct_sampled_rows": len({tuple(r) for r in ref["sampled"][0]}),
            "architectures_greedy_equal": architectures}


if __name__ == "__main__":
    what, arg = sys.argv[1], json.loads(sys.argv[2])
    if what == "lora":  # LoRA / QLoRA adapters on the mesh: arg = [mesh, lora config]
        print(json.dumps(train(arg[0], lora=arg[1])))
    else:
        print(json.dumps(train(arg) if what == "train" else sampler(arg)))
