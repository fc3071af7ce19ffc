"""Run in a fresh process with 8 CPU devices (test_expert_mesh.py): a Qwen3-MoE model on a mesh
with an `expert` axis gives the one-device logits, loss gradients and greedy tokens, and its
expert weights are really split over that axis. Prints one JSON line.

    python tests/models/expert_mesh_check.py '[{"expert": 2, "fsdp": 2, "tp": 2}, {"expert": 4, "data": 2}]'
    python tests/models/expert_mesh_check.py train '{"expert": 2, "fsdp": 4}'   GRPO with router replay
    python tests/models/expert_mesh_check.py gmm '[{"fsdp": 8}]'   the meshes run Pallas gmm (interpret mode)
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlbolt.distributed import MeshSpec, ShardingPlan  # noqa: E402
from rlbolt.models import Decoder, tiny_config  # noqa: E402
from rlbolt.rollout import NativeSampler, left_pad_positions  # noqa: E402


def _model() -> Decoder:
    config = tiny_config(vocab_size=128, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=3,
                         architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,))
    model = Decoder(config, rngs=nnx.Rngs(3))
    state = nnx.state(model, nnx.Param)  # larger weights: routing and greedy tokens that vary
    nnx.update(model, jax.tree.map(lambda x: x * 6 if x.ndim >= 2 else x, state))
    return model


def _loss(graphdef, params, ids, mask):
    logits, _ = nnx.merge(graphdef, params)(ids, left_pad_positions(mask), attention_mask=mask)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    picked = jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return -jnp.sum(jnp.where(mask[:, 1:], picked, 0.0)) / jnp.sum(mask[:, 1:]), logits


def _run(plan, ids, mask, prompts, keys, kernel: str = "ragged_dot") -> dict:
    from rlbolt.models.moe import moe_layers

    model = _model()
    if plan is not None:
        nnx.update(model, plan.place(nnx.state(model)))
        plan.shard_activations(model)
    for block in moe_layers(model):  # model.moe_matmul's kernel
        block.matmul = kernel
    graphdef, params = nnx.split(model)
    batch = (jnp.asarray(ids), jnp.asarray(mask)) if plan is None else plan.put_full((ids, mask))
    step = jax.jit(jax.value_and_grad(lambda p, i, m: _loss(graphdef, p, i, m), has_aux=True))
    (loss, logits), grads = step(params, *batch)
    sampler = NativeSampler(model, max_new_tokens=10, temperature=0.0, prompt_buckets=(16,), decode_segment=4,
                            sharding=plan)
    out = sampler.generate(prompts, keys)
    gate_up = params["layers"][0]["mlp"]["gate_up"].get_value()
    return {"loss": float(loss), "logits": np.asarray(logits), "ids": np.asarray(out.completion_ids),
            "grads": {jax.tree_util.keystr(p): np.asarray(g) for p, g in jax.tree_util.tree_leaves_with_path(grads)},
            # the expert-parallel path's collective is in the program (not a fallback that gathers the experts)
            "reduce_scatter": "reduce_scatter" in step.lower(params, *batch).as_text(),
            "shard_map_gmm": "shard_map" in str(step.trace(params, *batch).jaxpr) and "pallas_call" in str(
                step.trace(params, *batch).jaxpr),
            "gate_up_shape": list(gate_up.shape), "gate_up_shard": list(gate_up.addressable_shards[0].data.shape),
            "gate_up_spec": str(getattr(gate_up.sharding, "spec", None))}


def main(meshes: list[dict], kernel: str = "ragged_dot") -> dict:
    rng = np.random.default_rng(0)
    rows, width = 8, 12
    ids = rng.integers(1, 128, (rows, width)).astype(np.int32)
    mask = np.ones((rows, width), bool)
    for r in range(rows):  # left padding of varied lengths
        mask[r, : rng.integers(0, 6)] = False
    ids = np.where(mask, ids, 0)
    prompts = [row[m].tolist() for row, m in zip(ids, mask)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.PRNGKey(5), rows)), np.uint32)
    one = _run(None, ids, mask, prompts, keys)
    results = {}
    for mesh in meshes:
        sharded = _run(ShardingPlan(MeshSpec(**mesh).build()), ids, mask, prompts, keys, kernel)
        grad_diff = {k: float(np.abs(one["grads"][k] - sharded["grads"][k]).max()) for k in one["grads"]}
        results[json.dumps(mesh, sort_keys=True)] = {
            "loss_diff": abs(one["loss"] - sharded["loss"]),
            "logit_diff": float(np.abs(np.where(mask[:, :, None], one["logits"] - sharded["logits"], 0)).max()),
            "grad_diff": max(grad_diff.values()), "grad_scale": max(float(np.abs(g).max()) for g in one["grads"].values()),
            "worst_grad": max(grad_diff, key=grad_diff.get), "reduce_scatter": sharded["reduce_scatter"],
            "shard_map_gmm": sharded["shard_map_gmm"],
            "greedy_equal": bool((one["ids"] == sharded["ids"]).all()), "distinct": int(len(np.unique(one["ids"]))),
            "gate_up_shape": sharded["gate_up_shape"], "gate_up_shard": sharded["gate_up_shard"],
            "gate_up_spec": sharded["gate_up_spec"]}
    return results


def train(mesh: dict) -> dict:
    """Two GRPO steps of a tiny Qwen3-MoE (aux loss, recorded routing, replay) on `mesh` and on one
    device, with SGD (its update is linear in the gradient, so parameters compare the gradients)."""
    import optax

    from rlbolt.callback import Callback
    from rlbolt.data import gsm8k_style_rows
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    class SGDGRPO(GRPO):
        def configure_optimizers(self):
            return optax.sgd(0.5)

    def digits(completion: str, sample) -> float:
        return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)

    def fit(where):
        steps, completions = [], []

        class Record(Callback):
            def on_rollout_end(self, trainer, produced):
                completions.append(np.asarray(produced.batch["completion_ids"]).tolist())

            def on_step_end(self, trainer, info):
                steps.append({k: float(info.metrics[k]) for k in ("loss", "grad_norm", "moe/aux_loss")})

        tiny = {"hidden_size": 32, "head_dim": 8, "architecture": "Qwen3MoeForCausalLM", "qk_norm": True,
                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True}
        module = SGDGRPO({"rollout": {"max_new_tokens": 8, "record_routing": True},
                          "algorithm": {"router_replay": True}, "model": {"tiny": tiny, "router_aux_loss_coef": 0.1}},
                         reward=digits)
        trainer = Trainer(BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8), max_steps=2,
                          mesh=where, callbacks=[Record()], run_dir="unused")
        state = trainer.fit(module, gsm8k_style_rows(16))
        return state, steps, completions

    one_state, one_steps, one_completions = fit(ShardingPlan(MeshSpec(fsdp=1).build(jax.devices()[:1])))
    state, steps, completions = fit(mesh)
    diff = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max()), one_state.params, state.params)
    return {"steps": steps, "one_steps": one_steps, "same_completions": completions == one_completions,
            "param_diff": max(jax.tree.leaves(diff))}


if __name__ == "__main__":
    if sys.argv[1] == "train":
        print(json.dumps(train(json.loads(sys.argv[2]))))
    elif sys.argv[1] == "gmm":
        print(json.dumps(main(json.loads(sys.argv[2]), "gmm-interpret")))
    else:
        print(json.dumps(main(json.loads(sys.argv[1]))))
