"""Run in a fresh process with 8 CPU devices (test_family_mesh.py): Gemma 2, Gemma 3 and Qwen3-MoE
models on a tp x fsdp mesh give the no-mesh sampler's greedy tokens and the no-mesh logps.

    python tests/models/family_mesh_check.py '{"fsdp": 4, "tp": 2}'
"""

from __future__ import annotations

import json
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlbolt.distributed import MeshSpec, ShardingPlan  # noqa: E402
from rlbolt.models import Decoder, tiny_config  # noqa: E402
from rlbolt.rollout import NativeSampler, token_logps  # noqa: E402

FAMILIES = {
    "gemma2": dict(architecture="Gemma2ForCausalLM", hidden_act="gelu_pytorch_tanh", norm_unit_offset=True,
                   sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=16.0, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, sliding_window=4, tie_word_embeddings=True,
                   layer_types=("sliding_attention", "full_attention")),
    "gemma3": dict(architecture="Gemma3ForCausalLM", hidden_act="gelu_pytorch_tanh", norm_unit_offset=True,
                   sandwich_norms=True, scale_embeddings=True, qk_norm=True, sliding_window=4, rope_local_theta=10.0,
                   rope_theta=1e6, layer_types=("sliding_attention", "full_attention"), tie_word_embeddings=True),
    "qwen3_moe": dict(architecture="Qwen3MoeForCausalLM", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True),
}


def main(mesh: dict) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, rng.integers(5, 14)).tolist() for _ in range(8)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.PRNGKey(5), len(prompts))), np.uint32)
    plan = ShardingPlan(MeshSpec(**mesh).build())
    results = {}
    for name, fields in FAMILIES.items():
        config = tiny_config(vocab_size=128, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, **fields)
        model = Decoder(config, rngs=nnx.Rngs(3))
        state = nnx.state(model, nnx.Param)  # larger weights: varied greedy tokens
        nnx.update(model, jax.tree.map(lambda x: x * 8 if x.ndim >= 2 else x, state))
        outs = []
        for sharding in (None, plan):
            sampler = NativeSampler(model, max_new_tokens=16, temperature=0.0, prompt_buckets=(16,),
                                    decode_segment=6, sharding=sharding)
            out = sampler.generate(prompts, keys)
            graphdef, params = nnx.split(model)
            if sharding is not None:
                params = sharding.place(params, sharding.param_shardings(params))
            logps = jax.jit(lambda p, *a: token_logps(graphdef, p, *a))(
                params, out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask)
            outs.append((np.asarray(out.completion_ids), np.asarray(logps)))
        (ids0, lp0), (ids1, lp1) = outs
        results[name] = {"greedy_equal": bool((ids0 == ids1).all()), "distinct": int(len(np.unique(ids0))),
                         "logp_diff": float(np.abs(lp0 - lp1).max())}
    return results


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
