"""On-policy distillation: the teacher's per-token reverse KL on the student's own samples.

The student pi_s samples a completion; a teacher pi_t scores the same tokens. Per token the k1
estimate of the reverse KL, ``KL(pi_s || pi_t)`` at token t,

    d_t = log pi_s(y_t) - log pi_t(y_t)

is a per-token *cost*: its negation is the token's advantage, ``A_t = -kl_coef * d_t`` (plus any
task advantage), trained with the importance-sampled policy gradient ``-r_t A_t``. With
``r = pi_s / sg(pi_s)`` at the sampling policy, the gradient ``E[d_t grad log pi_s(y_t)]`` is the
REINFORCE gradient of the per-token reverse KL.

Conventions (Thinking Machines, "On-Policy Distillation", 2025, the Tinker cookbook; Agarwal et
al., GKD, arXiv 2306.13649): the advantage is the token's own ``-d_t`` only (discount 0: no
credit from later tokens' KL; the full-sequence reverse KL would use the sum of the later
``d``), ``d_t`` is taken with the *sampling* (old) student log-probs and carries no gradient,
and it can be negative (k1 is unbiased, not pointwise positive). Mixing with a task reward adds
the task advantages ``task_coef * A_task``. TRL's ``GKDTrainer`` instead minimises a generalised
JSD over the full vocabulary at each position (``beta=1`` is the reverse KL, a full-distribution
loss, not a sampled-token advantage); verl's on-policy distillation recipe minimises the forward
``KL(teacher || student)`` on the teacher's top-k tokens. Those need the full logits, not the
``[N, C]`` log-probs this module works on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rlbolt.algorithms.masked import check_token_shapes
from rlbolt.algorithms.policy_loss import LOG_RATIO_BOUND, _log_ratio, _token_advantages


def reverse_kl_advantages(
    student_logps: jax.Array,
    teacher_logps: jax.Array,
    mask: jax.Array,
    *,
    kl_coef: float = 1.0,
    task_advantages: jax.Array | None = None,
    task_coef: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Per-token advantages ``task_coef * A_task - kl_coef * (log pi_s - log pi_t)``.

    Args:
        student_logps: ``[N, C]`` the student's log-probs of its sampled tokens (the sampler's or
            the old policy's; no gradient flows).
        teacher_logps: ``[N, C]`` the teacher's log-probs of the same tokens.
        mask: ``[N, C]`` bool completion mask.
        kl_coef: weight of the reverse-KL signal (>= 0).
        task_advantages: ``[N]`` or ``[N, C]`` advantages from a task reward, or None (pure
            distillation).
        task_coef: weight of the task advantages.

    Returns:
        ``(advantages [N, C], reverse_kl [N, C])`` float32, both 0 on padding, no gradient.
    """
    if kl_coef < 0:
        raise ValueError(f"reverse_kl_advantages: kl_coef={kl_coef} must be >= 0 (1.0: pure distillation)")
    mask = jnp.asarray(mask, bool)
    check_token_shapes("student_logps", student_logps, mask)
    check_token_shapes("teacher_logps", teacher_logps, mask)
    student = jnp.asarray(student_logps, jnp.float32)
    teacher = jnp.asarray(teacher_logps, jnp.float32)
    reverse_kl = jax.lax.stop_gradient(jnp.where(mask, student - teacher, 0.0))
    advantages = -kl_coef * reverse_kl
    if task_advantages is not None:
        advantages = advantages + task_coef * _token_advantages(task_advantages, mask)
    return jnp.where(mask, advantages, 0.0), reverse_kl


def distillation_loss(
    logps: jax.Array,
    old_logps: jax.Array,
    teacher_logps: jax.Array,
    mask: jax.Array,
    *,
    kl_coef: float = 1.0,
    task_advantages: jax.Array | None = None,
    task_coef: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """On-policy distillation loss ``-r_t A_t`` with ``A`` from ``reverse_kl_advantages``.

    ``r_t = exp(logp_t - sg(old_logp_t))``, log-ratio clamped to +-20 (1 in value on the first update; its gradient is
    ``grad log pi``). With ``teacher_logps == old_logps`` and no task advantage the loss and its
    gradient are exactly 0. No clipping: the signal is dense and on-policy (Tinker's
    ``importance_sampling`` loss); wrap the advantages in ``clipped_surrogate`` instead for
    several updates per batch.

    Args:
        logps: ``[N, C]`` float32 current student log-probs (differentiated).
        old_logps: ``[N, C]`` float32 student log-probs when sampled (the KL's student side).
        teacher_logps: ``[N, C]`` float32 teacher log-probs of the same tokens.
        mask: ``[N, C]`` bool completion mask.
        kl_coef: weight of the reverse-KL signal.
        task_advantages: ``[N]`` or ``[N, C]`` task advantages, or None.
        task_coef: weight of the task advantages.

    Returns:
        ``(per_token_loss [N, C], info)``; info has ``ratio``, ``clipped`` (all False),
        ``reverse_kl`` (``d_t``) and ``advantages`` (``A_t``), each ``[N, C]``.
    """
    mask = jnp.asarray(mask, bool)
    advantages, reverse_kl = reverse_kl_advantages(old_logps, teacher_logps, mask, kl_coef=kl_coef,
                                                   task_advantages=task_advantages, task_coef=task_coef)
    # Clamped (+-20): a ratio of 1e30 times an advantage of 0 must not make inf * 0 = NaN.
    ratio = jnp.exp(jnp.clip(_log_ratio(logps, old_logps, mask), -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    loss = jnp.where(mask, -ratio * advantages, 0.0)
    info = {"ratio": ratio, "clipped": jnp.zeros_like(mask), "reverse_kl": reverse_kl, "advantages": advantages}
    return loss, info
