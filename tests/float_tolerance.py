"""Tolerances derived from float32 arithmetic, for comparisons between computations that are
entitled to round differently (different shapes, fusions, blockings or summation orders).

Bit equality stays the contract where the same computation is repeated (resume, prompt
sharing's copies, placement's reshards, a run against itself); where XLA or torch is free to
block a product differently (a fused kernel against a plain one of another shape, two graphs of
the same math, rlbolt against transformers), the CPU it runs on decides the last bits: an AMD
EPYC and an AVX-512 Xeon pick different kernels (XLA's emitted loops, MKL's sgemm paths) and
disagree in many values by a few ulps. These bounds say how far apart two correct float32
results may be, so a real bug (a wrong column, a missing term, one weight off by a quantisation
step) still fails by orders of magnitude (tests/test_float_tolerance.py proves that for the
model comparisons).

The rule for a test (CONTRIBUTING.md): a float comparison takes its tolerance from here, or
carries a written reason beside it that says why the number holds on every CPU ("exact:
integer-valued", "float64 against float64", "the same program twice: bit equality").

To see another CPU's choices on this one: `MKL_CBWR=COMPATIBLE` (torch's sgemm takes MKL's
generic path, as on the Xeon that found issue 33), `ATEN_CPU_CAPABILITY=avx2` (torch's
vectorised reductions) and `XLA_FLAGS=--xla_cpu_max_isa=AVX2` (XLA's emitted loops; tests/
conftest.py appends its own flags to the user's).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23: one ulp at 1.0
EPS64 = float(np.finfo(np.float64).eps)  # 2**-52
EPS_BF16 = 2.0 ** -7  # bfloat16 keeps 8 significant bits: one ulp at 1.0


def dot_error_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The classic forward-error bound of a float32 product x @ w computed in any order
    (Higham, "Accuracy and Stability of Numerical Algorithms", Eq. 3.5): |fl(x @ w) - x @ w| <=
    K u |x| @ |w| for K terms and unit round-off u = eps / 2; two such results differ by at
    most twice that, K * eps * |x| @ |w|, elementwise ([..., N] like x @ w)."""
    x64, w64 = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    return x64.shape[-1] * EPS32 * (x64 @ w64)


def sum_error_bound(terms: np.ndarray, axis: int = -1, eps: float = EPS32) -> np.ndarray:
    """Two sums of the same n terms in any two orders differ by at most n * eps * sum|terms|
    (the same bound as `dot_error_bound`, for a reduction: Higham Eq. 4.4, twice)."""
    terms = np.abs(np.asarray(terms, np.float64))
    return terms.shape[axis] * eps * terms.sum(axis=axis)


def decoder_contractions(config, seq_len: int, adapter_rank: int = 0) -> list[int]:
    """The lengths of the float32 reductions a decoder's logits pass through, layer by layer:
    per layer the input norm (H), the q/k/v product (H), the scores (head_dim), the softmax
    denominator and the weighted sum of values (seq_len each), the output product
    (heads * head_dim), the MLP norm (H), gate/up (H) and down (the MLP's width; for a mixture,
    the expert's width plus the router's H and the k experts' sum); then the final norm and the
    lm_head (H). `config` is an rlbolt ModelConfig."""
    h, d, t = config.hidden_size, config.head_dim, seq_len
    sizes = []
    for layer in range(config.num_layers):
        moe = config.num_experts and layer not in config.mlp_only_layers
        mlp = [h, config.moe_intermediate_size, config.num_experts_per_tok] if moe else [config.intermediate_size]
        sizes += [h, h, d, t, t, config.num_heads * d, h, h, *mlp] + ([h + adapter_rank] * 4 if adapter_rank else [])
    return sizes + [h, h]


def logits_tolerance(logits: np.ndarray, contractions: Sequence[int]) -> float:
    """An absolute tolerance for two float32 evaluations of the same network that may round
    differently: `dot_error_bound`'s K * eps for each reduction on the way (`contractions`,
    e.g. `decoder_contractions`), added up (to first order, relative errors entering the
    residual stream add; norms, softmax, SiLU and the residual sums pass them on with a gain of
    about one), times the largest logit. Each reduction's worst case is charged in full (real
    rounding errors are random and grow like sqrt(K)), which covers the ratio |x||w| / |x w|
    the logits' own magnitude leaves out: measured, the bound sits 20 to 100 times above the
    differences seen on AMD and Intel kernels, and 10 to 1000 times below the effect of one
    weight off by one quantisation step (tests/test_float_tolerance.py)."""
    return EPS32 * float(sum(contractions)) * float(np.max(np.abs(logits)))


def decoder_tolerance(logits: np.ndarray, config, seq_len: int, adapter_rank: int = 0) -> float:
    """`logits_tolerance` for a decoder's [..., V] logits over `seq_len` positions (`config`: its
    rlbolt ModelConfig; `adapter_rank`: unmerged LoRA adapters' rank, 0 for none)."""
    return logits_tolerance(logits, decoder_contractions(config, seq_len, adapter_rank))


def bf16_tolerance(logits: np.ndarray, config) -> float:
    """How far a bfloat16 decoder's logits may sit from the float32 model's on the same (bf16) weights:
    products accumulate in float32, but each stage's output is rounded to bfloat16 (half an ulp,
    EPS_BF16 / 2, relative), about nine stages a layer (the `decoder_contractions` of one layer)
    and two after the last; charged a full ulp each for the gains between them, times the
    largest logit."""
    return EPS_BF16 * (9 * config.num_layers + 2) * float(np.max(np.abs(logits)))


def attention_tolerance(q: np.ndarray, k: np.ndarray, v: np.ndarray, keys: int) -> float:
    """Two float32 attention outputs softmax(q k^T) v over up to `keys` keys (any scaling <= 1, any
    blocking or chunking): each score is a head_dim-term product, off by at most
    head_dim * eps * head_dim * max|q| * max|k| (`dot_error_bound` with the largest terms); the
    softmax weights move by at most twice that, relatively, plus the denominator's `keys`-term
    sum; the weighted sum of values adds its own `keys` * eps; all times max|v|."""
    d = q.shape[-1]
    q_max, k_max, v_max = (float(np.max(np.abs(np.asarray(a, np.float64)))) for a in (q, k, v))
    score = d * EPS32 * d * q_max * k_max
    return (2 * score + 2 * keys * EPS32) * v_max


def decoder_logits_bound(model) -> float:
    """A bound on |logits| of an rlbolt Decoder from its weights alone: the final norm's output is
    g * n with rms(n) = 1, so ||n||_2 = sqrt(H), and by Cauchy-Schwarz |logit_v| <= sqrt(H) *
    ||g * W[:, v]||_2 (the final soft-cap, if any, bounds it too)."""
    config = model.config
    g = np.asarray(model.final_norm.scale[...], np.float64)
    g = np.abs(1.0 + g if config.norm_unit_offset else g)
    head = (np.asarray(model.embed.embedding[...], np.float64).T if config.tie_word_embeddings
            else np.asarray(model.lm_head.kernel[...], np.float64))
    bound = np.sqrt(config.hidden_size) * float(np.sqrt(((g[:, None] * head) ** 2).sum(0)).max())
    cap = config.final_logit_softcapping
    return min(bound, cap) if cap else bound


def decoder_logps_tolerance(model, seq_len: int, adapter_rank: int = 0, temperature: float = 1.0) -> float:
    """Token log-probabilities of two float32 evaluations of a Decoder (prompt sharing, chunking,
    compaction, another placement...): `decoder_tolerance` at `decoder_logits_bound`, through
    `log_softmax_tolerance`."""
    logit_error = decoder_tolerance(decoder_logits_bound(model) / temperature, model.config, seq_len, adapter_rank)
    return log_softmax_tolerance(logit_error, model.config.vocab_size)


def log_softmax_tolerance(logit_error: float, vocab: int, eps: float = EPS32) -> float:
    """Log-probabilities from logits that may be off by `logit_error` each: log_softmax is
    2-Lipschitz in the max norm (the logit moves by e, the log-sum-exp by at most e), plus the
    log-sum-exp's own reduction of `vocab` terms (relative vocab * eps, an absolute error of that
    size after the log) and a few ulps of the exp/log."""
    return 2.0 * logit_error + (vocab + 8) * eps


def attention_grad_tolerance(q: np.ndarray, k: np.ndarray, v: np.ndarray, d_out: np.ndarray,
                             keys: int) -> tuple[float, float, float]:
    """Absolute tolerances (dq, dk, dv) for two float32 gradients of softmax(q k^T) v (q already
    scaled) against the cotangent `d_out`, over up to `keys` keys and as many queries. Stage by
    stage, as `attention_tolerance`: a softmax weight p is off by p_err relatively (the scores'
    head_dim-term products and the denominator's sum); dp = d_out . v is a head_dim-term product
    (|dp| <= g = D max|d_out| max|v|); ds = p (dp - sum p dp) adds the `keys`-term sum, and
    sum_j |ds_j| <= 2 g because the weights sum to one; dq sums ds k over the keys, dk sums
    ds q over up to `keys` queries, dv sums p d_out over up to `keys` queries."""
    d = q.shape[-1]
    q_max, k_max, v_max, g_max = (float(np.max(np.abs(np.asarray(a, np.float64)))) for a in (q, k, v, d_out))
    p_err = 2 * d * EPS32 * d * q_max * k_max + 2 * keys * EPS32
    g = d * g_max * v_max
    ds_err = 2 * d * EPS32 * g + 2 * keys * EPS32 * g + 2 * g * p_err  # summed over the keys
    return k_max * ds_err, keys * q_max * ds_err, keys * g_max * (p_err + keys * EPS32)
