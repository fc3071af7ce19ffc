"""Ready modules on a tiny model: rollout columns, hand-checked advantages and losses, overrides."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tolerance import decoder_logps_tolerance
from module_helpers import G, prompt_batch, rollout, setup_module_instance

from rlbolt.batch import check_stage
from rlbolt.modules import DAPO, GRPO, GSPO, PPO, RLOO, DrGRPO, ReinforcePP
from rlbolt.rewards import gsm8k_reward
from rlbolt.rewards import digit_fraction_reward
from rlbolt.update import add_mini_batch_totals


@pytest.fixture(scope="module")
def grpo(model, tokenizer):
    module = setup_module_instance(GRPO, model, tokenizer, beta=0.04)
    params, batch = rollout(module)
    return module, params, batch


def _z(rewards, groups, ddof=1):
    out = np.zeros_like(rewards, np.float64)
    for g in np.unique(groups):
        r = rewards[groups == g].astype(np.float64)
        out[groups == g] = (r - r.mean()) / (r.std(ddof=ddof) + 1e-6)
    return out


def test_rollout_columns_and_sampler_logps_match_a_forward(grpo):
    module, params, batch = grpo
    check_stage(batch, "logps")
    n, c = batch["completion_ids"].shape
    assert n == 2 * G and c == 8 and batch["prompt_ids"].shape == (n, 32)
    # Prompts are the tokenised questions, left-padded (last tokens kept).
    ids = module.tokenizer.encode(batch["question"][0])[-32:]
    assert batch["prompt_ids"][0, -len(ids):].tolist() == ids and batch["prompt_mask"][0].sum() == len(ids)
    # completion_text decodes the masked completion ids.
    mask = batch["completion_mask"][1]
    assert batch["completion_text"][1] == module.tokenizer.decode(batch["completion_ids"][1][mask].tolist())
    # At step 0 the reference is the policy: ref logps (a forward) equal the sampler's logps.
    seq = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]  # the decode graph against a forward
    np.testing.assert_allclose(batch["ref_logps"], batch["sampler_logps"], rtol=0,
                               atol=decoder_logps_tolerance(module.model, seq))
    np.testing.assert_array_equal(batch["old_logps"], batch["sampler_logps"])


def test_grpo_rewards_and_advantages_match_independent_reference(grpo):
    module, _, batch = grpo
    out = module.on_advantage(batch)
    expected_rewards = [gsm8k_reward(t, {"answer": a}) + digit_fraction_reward(t)
                        for t, a in zip(batch["completion_text"], batch["answer"])]
    np.testing.assert_allclose(out["rewards"], expected_rewards, rtol=1e-6)
    np.testing.assert_allclose(out["advantages"], _z(out["rewards"], out["group_ids"]), rtol=1e-4, atol=1e-5)


def _train(module, params, batch):
    return jax.jit(module.training_step)(params, add_mini_batch_totals(batch.numeric()))


def test_grpo_loss_is_seq_mean_token_mean_and_kl_zero_at_start(grpo):
    module, params, batch = grpo
    advantages = np.linspace(-1.0, 2.0, batch.num_samples).astype(np.float32)  # non-zero mean on purpose
    b = module.on_advantage(batch).with_columns(advantages=advantages)
    loss, metrics = _train(module, params, b)
    # ratio = 1 (same params as the sampler), so the per-token loss is -A_i and the
    # seq-mean-token-mean of it is -mean_i(A_i).
    np.testing.assert_allclose(float(metrics["loss/policy"]), -advantages.mean(), rtol=1e-4)
    assert abs(float(metrics["kl"])) < 1e-4 and abs(float(metrics["loss/kl"])) < 1e-5
    np.testing.assert_allclose(float(metrics["ratio/mean"]), 1.0, atol=1e-4)
    assert float(metrics["clip_frac"]) == 0.0 and np.isfinite(float(loss)) and float(metrics["entropy"]) > 0


def test_training_metrics_sum_over_micro_batches_to_the_mini_batch_value(grpo):
    module, params, batch = grpo
    b = add_mini_batch_totals(module.on_advantage(batch).with_columns(
        advantages=np.linspace(-1.0, 2.0, batch.num_samples).astype(np.float32)).numeric())
    step = jax.jit(module.training_step)
    full_loss, full = step(params, b)
    halves = [step(params, b.slice(i, i + G)) for i in (0, G)]
    np.testing.assert_allclose(sum(float(h[0]) for h in halves), float(full_loss), rtol=1e-5, atol=1e-7)
    for key in ("entropy", "loss/policy"):
        np.testing.assert_allclose(sum(float(h[1][key]) for h in halves), float(full[key]), rtol=1e-5)


def test_dapo_token_mean_loss_and_clip_higher(grpo, model, tokenizer):
    _, params, batch = grpo
    module = setup_module_instance(DAPO, model, tokenizer, dynamic_sampling=False)
    assert (module.algo.clip_low, module.algo.clip_high, module.algo.loss_aggregation) == (0.2, 0.28, "token-mean")
    advantages = np.linspace(-1.0, 2.0, batch.num_samples).astype(np.float32)
    b = module.on_advantage(batch).with_columns(advantages=advantages)
    _, metrics = _train(module, params, b)
    lengths = batch["completion_mask"].sum(1)
    np.testing.assert_allclose(float(metrics["loss/policy"]), -(advantages * lengths).sum() / lengths.sum(), rtol=1e-4)


def test_dapo_overlong_penalty_is_added_to_rewards(grpo, model, tokenizer):
    plain, _, batch = grpo
    module = setup_module_instance(DAPO, model, tokenizer, dynamic_sampling=False, overlong_cache_length=4)
    lengths = batch["completion_mask"].sum(1)
    # Eq. 13 with L_max = 8, L_cache = 4: 0 up to 4 tokens, then (4 - |y|) / 4.
    penalty = np.where(lengths <= 4, 0.0, (4 - lengths) / 4.0)
    np.testing.assert_allclose(module.compute_rewards(batch), plain.compute_rewards(batch) + penalty, rtol=1e-6)


def test_drgrpo_and_rloo_advantages(grpo, model, tokenizer):
    _, _, batch = grpo
    for cls, reference in (
        (DrGRPO, lambda r, g: r - np.array([r[g == x].mean() for x in g])),
        (RLOO, lambda r, g: np.array([r[i] - (r[g == g[i]].sum() - r[i]) / ((g == g[i]).sum() - 1) for i in range(len(r))])),
    ):
        module = setup_module_instance(cls, model, tokenizer)
        out = module.on_advantage(batch.drop("ref_logps"))
        np.testing.assert_allclose(out["advantages"], reference(out["rewards"].astype(np.float64), out["group_ids"]),
                                   rtol=1e-4, atol=1e-6)
    assert module.algo.loss_aggregation == "seq-mean-token-sum"


def test_rloo_folds_kl_into_the_sequence_reward(grpo, model, tokenizer):
    grpo_module, _, batch = grpo
    module = setup_module_instance(RLOO, model, tokenizer, beta=0.5, kl_kind="k1")
    batch = batch.with_columns(ref_logps=batch["old_logps"] - 0.1)  # k1 = logp - ref = 0.1 per token
    plain = grpo_module.compute_rewards(batch)
    expected = plain - 0.5 * 0.1 * batch["completion_mask"].sum(1)
    np.testing.assert_allclose(module.compute_rewards(batch), expected, rtol=1e-5)


def test_reinforcepp_whitened_returns(grpo, model, tokenizer):
    _, _, batch = grpo
    module = setup_module_instance(ReinforcePP, model, tokenizer)
    out = module.on_advantage(batch)
    mask = batch["completion_mask"]
    # gamma = 1 and no KL: every valid token's return-to-go is its sequence reward; whiten over tokens.
    returns = np.where(mask, out["rewards"][:, None].astype(np.float64), 0.0)
    mean = returns[mask].mean()
    std = returns[mask].std()
    np.testing.assert_allclose(out["advantages"], np.where(mask, (returns - mean) / (std + 1e-8), 0.0), rtol=1e-4, atol=1e-5)


def test_gspo_uses_sequence_ratio_loss(grpo, model, tokenizer):
    _, params, batch = grpo
    module = setup_module_instance(GSPO, model, tokenizer)
    assert (module.algo.clip_low, module.algo.clip_high) == (3e-4, 4e-4)
    advantages = np.linspace(-1.0, 2.0, batch.num_samples).astype(np.float32)
    b = module.on_advantage(batch).with_columns(advantages=advantages)
    # Pretend the sampler was a little worse on each token: log s_i = 0.01 and clipping (> 1 + 4e-4) bites.
    b = b.with_columns(old_logps=np.where(b["completion_mask"], b["old_logps"] - 0.01, 0.0).astype(np.float32))
    _, metrics = _train(module, params, b)
    s = np.exp(0.01)
    expected = -np.mean(np.minimum(s * advantages, np.clip(s, 1 - 3e-4, 1 + 4e-4) * advantages))
    np.testing.assert_allclose(float(metrics["loss/policy"]), expected, rtol=1e-3)


def _gae_reference(rewards, values, mask, gamma, lam):
    adv = np.zeros_like(values, np.float64)
    for i in range(len(rewards)):
        idx = np.nonzero(mask[i])[0]
        nxt_v, nxt_a = 0.0, 0.0
        for t in idx[::-1]:
            r = rewards[i] if t == idx[-1] else 0.0
            delta = r + gamma * nxt_v - values[i, t]
            nxt_a = delta + gamma * lam * nxt_a
            adv[i, t], nxt_v = nxt_a, values[i, t]
    return adv


def test_ppo_gae_value_head_and_value_loss(grpo, model, tokenizer):
    module = setup_module_instance(PPO, model, tokenizer)
    params = module.init_params(jax.random.key(0))
    batch = module.compute_logps(params, grpo[2].drop("ref_logps", "old_logps"))
    assert set(params) == {"policy", "value_head"} and batch["old_values"].shape == batch["completion_mask"].shape
    out = module.on_advantage(batch)
    mask = batch["completion_mask"]
    adv = _gae_reference(out["rewards"], batch["old_values"].astype(np.float64), mask, 1.0, 0.95)
    whitened = np.where(mask, (adv - adv[mask].mean()) / (adv[mask].std() + 1e-8), 0.0)
    np.testing.assert_allclose(out["advantages"], whitened, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(out["returns"], np.where(mask, adv + batch["old_values"], 0.0), rtol=1e-4, atol=1e-5)
    (loss, metrics), grads = jax.jit(jax.value_and_grad(module.training_step, has_aux=True))(
        params, add_mini_batch_totals(out.numeric()))
    # values == old_values at the start, so the value loss is 0.5 * (V - R)^2 token-mean.
    err = np.where(mask, 0.5 * (batch["old_values"] - out["returns"]) ** 2, 0.0)
    np.testing.assert_allclose(float(metrics["loss/value"]), 0.5 * err.sum() / mask.sum(), rtol=1e-3)
    assert float(jnp.abs(grads["value_head"]["kernel"]).max()) > 0 and np.isfinite(float(loss))
    assert float(metrics["value/clip_frac"]) == 0.0
    # Values that moved, but less than value_clip: nothing is clipped (no ulp-sized false positives).
    moved = batch["old_values"] + np.random.default_rng(0).uniform(-0.19, 0.19, mask.shape).astype(np.float32)
    _, value_metrics = jax.jit(module.extra_loss)({"values": jnp.asarray(moved)}, add_mini_batch_totals(out.numeric()))
    assert float(value_metrics["value/clip_frac"]) == 0.0


def test_user_can_override_one_hook(grpo, model, tokenizer):
    _, _, batch = grpo

    class LengthReward(GRPO):
        def compute_rewards(self, batch):
            return batch["completion_mask"].sum(1).astype(np.float32)

    module = setup_module_instance(LengthReward, model, tokenizer)
    out = module.on_advantage(batch)
    lengths = batch["completion_mask"].sum(1).astype(np.float64)
    np.testing.assert_allclose(out["rewards"], lengths)
    np.testing.assert_allclose(out["advantages"], _z(lengths, out["group_ids"]), rtol=1e-4, atol=1e-5)


def test_validation_step_accuracy_and_pass_at_k(grpo):
    module, params, _ = grpo
    from rlbolt.data import gsm8k_style_rows

    rows = gsm8k_style_rows(2)
    batch = prompt_batch(rows).slice(0, 1)  # validation batches are plain rows + prompt_index + keys
    batch = batch.drop("group_ids", "policy_version")
    metrics = module.validation_step(params, batch)
    assert set(metrics) == {"accuracy", "pass@2"} and 0 <= metrics["accuracy"] <= metrics["pass@2"] + 1 <= 2


def test_module_rejects_a_config_for_another_algorithm():
    from rlbolt.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="algorithm.name=dapo"):
        DAPO(load_config(None, ["algorithm.name=grpo"]))


def test_evaluation_num_samples_overrides_pass_at_k(grpo):
    from types import SimpleNamespace

    from rlbolt.data import gsm8k_style_rows

    module, params, _ = grpo
    batch = prompt_batch(gsm8k_style_rows(2)).slice(0, 1).drop("group_ids", "policy_version")
    assert "pass@2" in module.validation_step(params, batch)  # the config's k
    assert "pass@3" in module.validation_step(params, batch, num_samples=3)  # what Evaluation(num_samples=3) passes


def test_lr_schedule_matches_the_optimizer_warmup():
    import optax

    module = GRPO({"algorithm": {"lr": 1e-3, "warmup_steps": 4}})
    assert [module.lr_schedule(c) for c in (0, 2, 4, 9)] == pytest.approx([0.0, 5e-4, 1e-3, 1e-3])
    params = {"w": jnp.zeros(3)}
    tx = module.configure_optimizers()
    state = tx.init(params)
    grads = {"w": jnp.ones(3)}
    # AdamW's first step moves each weight by ~lr (sign of the gradient): lr of update 0 is 0, of update 2 is 5e-4.
    moves = []
    update = jax.jit(tx.update)  # one program, not one compile per eager primitive
    for _ in range(3):
        updates, state = update(grads, state, params)
        moves.append(float(-updates["w"][0]))
    assert moves[0] == pytest.approx(0.0, abs=1e-9) and moves[2] == pytest.approx(5e-4, rel=1e-3)
