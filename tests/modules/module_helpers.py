"""Shared tiny setup for module tests: one model/tokenizer, a SetupContext, and rollout batches.

Imported by the test files (tests/modules/conftest.py puts this folder on sys.path)."""


import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlbolt.batch import Batch
from rlbolt.data import gsm8k_style_rows
from rlbolt.models import Decoder, tiny_config
from rlbolt.modules.prompts import builtin_tokenizer
from rlbolt.plan import BatchPlan
import rollout_jit
from rlbolt.setup_context import SetupContext

G = 4
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64)


def module_config(name, **algorithm):
    return {"algorithm": {"name": name, **algorithm}, "rollout": {"max_new_tokens": 8, "val_num_samples": 2},
            "data": {"max_prompt_tokens": 32}, "reward": {"weights": {"answer": 1.0, "digits": 1.0}}}


def setup_context(num_iterations=1):
    return SetupContext(BatchPlan(2, G, num_iterations=num_iterations))


def prompt_batch(rows, seed=0):
    """What the producer hands on_rollout: rows repeated G times + framework columns."""
    batch = Batch.from_rows([{**r, "prompt_index": i} for i, r in enumerate(rows)]).repeat(G)
    keys = jax.random.key_data(jax.random.split(jax.random.key(seed), batch.num_samples))
    return batch.with_columns(group_ids=batch["prompt_index"].astype(np.int32),
                              policy_version=np.zeros(batch.num_samples, np.int32), sample_keys=np.asarray(keys))


def tiny_model(tokenizer):
    return Decoder(tiny_config(vocab_size=tokenizer.vocab_size, **TINY), rngs=nnx.Rngs(0))


def setup_module_instance(cls, model, tokenizer, context=None, **algorithm):
    module = cls(module_config(cls.algorithm_name, **algorithm), model=model, tokenizer=tokenizer)
    module.setup(context or setup_context())
    return module


def rollout(module, rows=None, seed=0):
    """on_rollout -> compute_logps for two prompts; returns the batch before on_advantage."""
    params = module.init_params(jax.random.key(0))
    batch = module.on_rollout(params, prompt_batch(rows or gsm8k_style_rows(2), seed))
    return params, module.compute_logps(params, batch)


# A test's own reference forward runs jitted: eagerly, every primitive of every new shape is its own
# XLA compile (CONTRIBUTING.md). One compiled program per model structure and shape.
def jitted_logits(model, ids, positions, attention_mask=None):
    """model(ids, positions, attention_mask=...)'s logits, through one jitted program (`rollout_jit`)."""
    mask = None if attention_mask is None else jnp.asarray(attention_mask, bool)
    return rollout_jit.forward_logits(model, jnp.asarray(ids, jnp.int32), jnp.asarray(positions, jnp.int32), mask)


def jitted_token_logps(model, batch, mask="completion_mask"):
    """token_logps of `model` (a plain forward, defaults) on a batch's token columns (the completion's
    mask from column `mask`), jitted (`rollout_jit`)."""
    return rollout_jit.token_logps(model, None, *(jnp.asarray(batch[k]) for k in
                                                  ("prompt_ids", "prompt_mask", "completion_ids", mask)))
