"""A tiny RLModule for core tests: a bigram policy over a small vocabulary.

The policy is a table `logits[previous_token, next_token]` ([V, V]); a completion is C tokens
sampled one after another from the row of the previous token. The reward is the fraction of
completion tokens equal to `target`, so the optimum is obvious and reachable in a few dozen steps.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rlbolt.batch import Batch
from rlbolt.module import RLModule


def prompt_rows(n: int, vocab: int = 8, prompt_len: int = 3, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt": rng.integers(0, vocab, prompt_len).tolist()} for _ in range(n)]


def _token_logps(params, prompt_ids, completion_ids):
    prev = jnp.concatenate([prompt_ids[:, -1:], completion_ids[:, :-1]], axis=1)  # [N, C]
    logits = jax.nn.log_softmax(params["table"][prev], axis=-1)  # [N, C, V]
    return jnp.take_along_axis(logits, completion_ids[..., None], axis=-1)[..., 0]


@functools.partial(jax.jit, static_argnums=0)
def _sample_rows(completion_len: int, params, last_tokens, keys):
    """Each row's C tokens from the bigram table. One jitted function for every ToyModule (the table and
    the keys are arguments): a test's many modules compile it once per shape, not once per instance."""
    def sample_one(last_token, key):
        def step(prev, t):
            logits = jax.nn.log_softmax(params["table"][prev])
            token = jax.random.categorical(jax.random.fold_in(key, t), logits)
            return token, (token, logits[token])

        _, (tokens, logps) = jax.lax.scan(step, last_token, jnp.arange(completion_len))
        return tokens, logps

    return jax.vmap(sample_one)(last_tokens, keys)


_jit_token_logps = jax.jit(_token_logps)


class ToyModule(RLModule):
    def __init__(self, vocab: int = 8, completion_len: int = 6, target: int = 3, lr: float = 0.1,
                 clip: float = 0.2, optimizer: optax.GradientTransformation | None = None):
        self.vocab, self.completion_len, self.target, self.lr, self.clip = vocab, completion_len, target, lr, clip
        self._optimizer = optimizer
        self._sample = functools.partial(_sample_rows, completion_len)
        self._logps = _jit_token_logps

    def init_params(self, rng):
        return {"table": 0.01 * jax.random.normal(rng, (self.vocab, self.vocab))}

    def configure_optimizers(self):
        return self._optimizer or optax.adam(self.lr)

    def token_logps(self, params, prompt_ids, completion_ids):
        return _token_logps(params, prompt_ids, completion_ids)

    def on_rollout(self, params, batch: Batch) -> Batch:
        prompt_ids = np.stack([np.asarray(p, np.int32) for p in batch["prompt"]])
        keys = jnp.asarray(batch["sample_keys"])
        tokens, logps = self._sample(params, jnp.asarray(prompt_ids[:, -1]), keys)
        n = batch.num_samples
        return batch.with_columns(
            prompt_ids=prompt_ids, prompt_mask=np.ones_like(prompt_ids, bool),
            completion_ids=np.asarray(tokens, np.int32),
            completion_mask=np.ones((n, self.completion_len), bool),
            sampler_logps=np.asarray(logps, np.float32),
        )

    def compute_logps(self, params, batch: Batch) -> Batch:
        if self.context.plan.num_iterations == 1:
            return super().compute_logps(params, batch)  # the sampler's logps are the old logps
        logps = self._logps(params, jnp.asarray(batch["prompt_ids"]), jnp.asarray(batch["completion_ids"]))
        return batch.with_columns(old_logps=np.asarray(logps, np.float32))

    def on_advantage(self, batch: Batch) -> Batch:
        rewards = (np.asarray(batch["completion_ids"]) == self.target).mean(axis=1).astype(np.float32)
        groups = np.asarray(batch["group_ids"])
        adv = np.zeros_like(rewards)
        for g in np.unique(groups):
            sel = groups == g
            adv[sel] = (rewards[sel] - rewards[sel].mean()) / (rewards[sel].std() + 1e-6)
        self.log("toy/logged", float(rewards.max()))
        return batch.with_columns(rewards=rewards, advantages=adv)

    def training_step(self, params, batch: Batch):
        logps = self.token_logps(params, batch["prompt_ids"], batch["completion_ids"])
        ratio = jnp.exp(logps - batch["old_logps"])
        adv = batch["advantages"][:, None]
        per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - self.clip, 1 + self.clip) * adv)
        mask = batch["completion_mask"].astype(jnp.float32)
        total = batch["mini_batch_num_tokens"][0]
        loss = jnp.sum(per_token * mask) / total
        clipped = (jnp.abs(ratio - 1) > self.clip).astype(jnp.float32)
        return loss, {"clip_frac": jnp.sum(clipped * mask) / total}

    def validation_step(self, params, batch: Batch):
        prompt_ids = np.stack([np.asarray(p, np.int32) for p in batch["prompt"]])
        tokens, _ = self._sample(params, jnp.asarray(prompt_ids[:, -1]), jnp.asarray(batch["sample_keys"]))
        return {"accuracy": float((np.asarray(tokens) == self.target).mean())}
