"""The per-step metrics of the LM modules against hand counts and float64 NumPy: the share of tokens
the covariance rules select (`cov/selected_frac`), clipped (`clip_frac`), masked by the rollout
correction (`rollout_corr/token_masked_frac`), the policy entropy, and the teacher-student reverse
KL (`distill/reverse_kl`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from module_helpers import TINY, jitted_logits, module_config, prompt_batch, setup_context

from rlbolt.batch import Batch
from rlbolt.models import Decoder, tiny_config
from rlbolt.module import collect_log_values, mean_logs
from rlbolt.modules import GRPO


class _GivenLogps(GRPO):
    """GRPO whose forward returns the batch's `given_logps` (and a zero entropy): the loss's inputs
    are then exactly what the test wrote."""

    def forward(self, params, batch):
        return batch["given_logps"], jnp.zeros_like(batch["given_logps"]), {}


def _batch(logps, old_logps, advantages, mask):
    n = mask.shape[0]
    return Batch(given_logps=np.asarray(logps, np.float32), old_logps=np.asarray(old_logps, np.float32),
                 advantages=np.asarray(advantages, np.float32), completion_mask=np.asarray(mask, bool),
                 sample_keys=np.arange(2 * n, dtype=np.uint32).reshape(n, 2),
                 mini_batch_num_tokens=np.full(n, np.sum(mask), np.float32),
                 mini_batch_num_samples=np.full(n, n, np.float32))


# Four rows, 12 valid tokens (row 1 has two padding slots, row 3 one).
MASK = np.array([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]], bool)
OLD = np.array([[-0.5, -2.0, -1.0], [-3.0, 0.0, 0.0], [-0.2, -1.5, -0.7], [-2.5, -0.1, 0.0], [-1.1, -0.9, -4.0]])
ADV = np.array([1.0, -1.0, 0.5, 2.0, -0.3])


def _cov64(logps, advantages, mask):
    """(log pi - mean log pi) * (A - mean A) over the valid tokens, in float64."""
    a = np.broadcast_to(np.asarray(advantages, np.float64)[:, None], mask.shape)
    lp = np.asarray(logps, np.float64)
    return np.where(mask, (lp - lp[mask].mean()) * (a - a[mask].mean()), 0.0)


def test_kl_cov_selected_share_is_its_top_k_count_over_the_tokens():
    # k = 0.25 of 12 valid tokens: floor(3.0) = 3 tokens; the share is 3 / 12.
    module = _GivenLogps({"algorithm": {"policy_loss": "kl_cov", "cov_select_ratio": 0.25}})
    _, metrics = module.training_step(None, _batch(OLD, OLD, ADV, MASK))
    # fractions of 12 tokens: float32 k / 12 is within half an ulp (3e-8): abs=1e-7
    assert float(metrics["cov/selected_frac"]) == pytest.approx(3 / 12, abs=1e-7)
    assert float(metrics["clip_frac"]) == 0.0  # KL-Cov clips nothing
    # A ratio that selects fewer than one token still selects one (max(1, floor(k N))).
    module = _GivenLogps({"algorithm": {"policy_loss": "kl_cov", "cov_select_ratio": 0.01}})
    assert float(module.training_step(None, _batch(OLD, OLD, ADV, MASK))[1]["cov/selected_frac"]) == \
        pytest.approx(1 / 12, abs=1e-7)


@pytest.mark.parametrize("band", [(0.0, 10.0), (-10.0, 0.0), (0.05, 0.5)])
def test_clip_cov_selected_share_counts_the_tokens_in_the_covariance_band(band):
    # Ratio 1 (first update): nothing is PPO-clipped, so with select_ratio 1 every token whose
    # covariance lies in the band is detached; count them in float64 by hand.
    module = _GivenLogps({"algorithm": {"policy_loss": "clip_cov", "cov_select_ratio": 1.0,
                                        "clip_cov_low": band[0], "clip_cov_high": band[1]}})
    _, metrics = module.training_step(None, _batch(OLD, OLD, ADV, MASK))
    cov = _cov64(OLD, ADV, MASK)
    want = int(np.sum(MASK & (cov >= band[0]) & (cov <= band[1])))
    assert 0 < want < 12  # the band splits the tokens, so a wrong count could show
    assert float(metrics["cov/selected_frac"]) == pytest.approx(want / 12, abs=1e-7)
    assert float(metrics["clip_frac"]) == 0.0  # PPO's clip alone: a detached token is not a clipped one


def test_ppo_clip_share_and_no_covariance_metric_without_a_covariance_rule():
    # PPO eps 0.2: ratio e^0.5 with A > 0 and e^-0.5 with A < 0 are clipped, e^0.1 is not.
    logps = OLD + np.array([[0.5, 0.1, -0.5], [-0.5, 0, 0], [0.1, 0.1, 0.1], [0.5, 0.5, 0], [0.5, -0.5, 0.1]])
    module = _GivenLogps({"algorithm": {"policy_loss": "ppo"}})
    _, metrics = module.training_step(None, _batch(logps, OLD, ADV, MASK))
    # row 0 (A=1): 0.5 clipped; row 1 (A=-1): -0.5 clipped; row 2: none; row 3 (A=2): two;
    # row 4 (A=-0.3): -0.5 clipped.
    assert float(metrics["clip_frac"]) == pytest.approx(5 / 12, abs=1e-7)
    assert "cov/selected_frac" not in metrics


def test_entropy_metric_is_the_token_mean_of_the_policy_entropy(model, tokenizer):
    # Prompts of 7 characters fill the padded width exactly: positions are 0.. for every row.
    module = GRPO({**module_config("grpo"), "data": {"max_prompt_tokens": 7}}, model=model, tokenizer=tokenizer)
    module.setup(setup_context())
    params = module.init_params(jax.random.key(0))
    rows = [{"question": "12+34=?", "answer": "46"}, {"question": "56+78=?", "answer": "134"}]
    batch = module.on_rollout(params, prompt_batch(rows))
    mask = np.asarray(batch["completion_mask"], bool)
    assert mask.sum() > 0
    ids = np.concatenate([batch["prompt_ids"], batch["completion_ids"]], axis=1)
    positions = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    logits = jitted_logits(model, ids, positions)
    logits = np.asarray(logits, np.float64)[:, 6:6 + mask.shape[1]]  # the logits that predict each completion id
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    entropy = -(np.exp(logp) * logp).sum(-1)
    micro = batch.numeric().with_columns(advantages=np.zeros(batch.num_samples, np.float32),
                                         old_logps=batch["sampler_logps"],
                                         mini_batch_num_tokens=np.full(batch.num_samples, mask.sum(), np.float32),
                                         mini_batch_num_samples=np.full(batch.num_samples, batch.num_samples,
                                                                        np.float32))
    # jitted, as the trainer runs it: eagerly every primitive of the model compiles alone
    _, metrics = jax.jit(module.training_step)(params, micro)
    # a float32 mean of 12 values against float64: <= 12 * eps relative (sum_error_bound): rel=1e-5
    assert float(metrics["entropy"]) == pytest.approx(entropy[mask].mean(), rel=1e-5)


def test_distillation_logs_the_token_mean_reverse_kl_of_the_round(model, tokenizer):
    teacher = Decoder(tiny_config(vocab_size=tokenizer.vocab_size, **TINY), rngs=nnx.Rngs(7))
    module = GRPO(module_config("grpo"), model=model, tokenizer=tokenizer, teacher=teacher)
    module.setup(setup_context())
    params = module.init_params(jax.random.key(0))
    from rlbolt.data import gsm8k_style_rows

    batch = module.compute_logps(params, module.on_rollout(params, prompt_batch(gsm8k_style_rows(2))))
    with collect_log_values() as logged:
        module.on_advantage(batch)
    mask = np.asarray(batch["completion_mask"], bool)
    want = (np.asarray(batch["old_logps"], np.float64) - np.asarray(batch["teacher_logps"], np.float64))[mask].mean()
    # a float32 mean of a few differences against float64: < 20 ulps, rel=1e-5 is 84
    assert mean_logs(logged)["distill/reverse_kl"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert abs(want) > 1e-3  # a different teacher: a zero metric would fail


def test_distillation_reverse_kl_metric_is_zero_when_every_token_is_masked(model, tokenizer):
    module = GRPO(module_config("grpo"), model=model, tokenizer=tokenizer, teacher=model)
    module.setup(setup_context())
    n, c = 8, module.rollout_cfg.max_new_tokens
    batch = Batch(rewards=np.ones(n, np.float32), group_ids=np.repeat(np.arange(2), 4).astype(np.int32),
                  completion_mask=np.zeros((n, c), bool), old_logps=np.zeros((n, c), np.float32),
                  teacher_logps=np.full((n, c), -3.0, np.float32), prompt_ids=np.ones((n, 3), np.int32),
                  prompt_mask=np.ones((n, 3), bool))
    with collect_log_values() as logged:
        out = module.on_advantage(batch)
    assert mean_logs(logged)["distill/reverse_kl"] == 0.0
    assert not np.any(out["advantages"])


def test_rollout_correction_logs_the_share_of_tokens_it_masked(model, tokenizer):
    module = GRPO(module_config("grpo", rollout_correction="mask", rollout_correction_cap=2.0),
                  model=model, tokenizer=tokenizer)
    module.setup(setup_context())
    params = module.init_params(jax.random.key(0))
    from rlbolt.data import gsm8k_style_rows

    batch = module.on_rollout(params, prompt_batch(gsm8k_style_rows(2)))
    old = module.compute_logps(params, batch)["old_logps"]  # the trainer's forward
    mask = np.asarray(batch["completion_mask"], bool)
    # Sampler logps off by +-1.5 nats (ratio e^1.5 = 4.5 or e^-1.5 = 0.22, outside [1/2, 2]) on every
    # third valid token, equal to the trainer's elsewhere (ratio exactly 1).
    shift = np.zeros(mask.shape)
    valid = np.argwhere(mask)
    for k, (i, t) in enumerate(valid):
        if k % 3 == 0:
            shift[i, t] = 1.5 if k % 2 else -1.5
    want = int(np.sum(shift != 0)) / len(valid)
    assert 0 < want < 1
    with collect_log_values() as logged:
        out = module.compute_logps(params, batch.with_columns(sampler_logps=np.asarray(old - shift, np.float32)))
    assert mean_logs(logged)["rollout_corr/token_masked_frac"] == pytest.approx(want, abs=1e-7)
    weights = out["importance_weights"]
    assert np.all(weights[shift != 0] == 0.0) and np.all(weights[mask & (shift == 0)] == 1.0)
    np.testing.assert_array_equal(out["keep_mask"], mask & (shift == 0))  # what the objectives pool
