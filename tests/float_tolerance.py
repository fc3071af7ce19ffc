"""Tolerances derived from float32 arithmetic, for comparisons between computations that are
entitled to round differently (different shapes, fusions, blockings or summation orders).

Bit equality stays the contract where the same computation is repeated (resume, prompt
sharing's copies, placement's reshards, a run against itself); where XLA is free to block a
matmul differently (a fused kernel against a plain one of another shape, two graphs of the same
math), the CPU it runs on decides the last bits: an AVX2-only AMD EPYC and an AVX-512 Xeon
disagree in up to ~2/3 of the values by a few ulps. These bounds say how far apart two correct
float32 results may be, so a real bug (a wrong column, a missing term) still fails by orders of
magnitude.
"""

from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2**-23: one ulp at 1.0


def dot_error_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The classic forward-error bound of a float32 product x @ w computed in any order
    (Higham, "Accuracy and Stability of Numerical Algorithms", Eq. 3.5): |fl(x @ w) - x @ w| <=
    K u |x| @ |w| for K terms and unit round-off u = eps / 2; two such results differ by at
    most twice that, K * eps * |x| @ |w|, elementwise ([..., N] like x @ w)."""
    x64, w64 = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    return x64.shape[-1] * EPS32 * (x64 @ w64)


def network_tolerance(values: np.ndarray, ulps: int = 64) -> float:
    """An absolute tolerance for two float32 evaluations of the same network through different
    fusions: `ulps` ulps of the largest magnitude (rounding differences of ~1 ulp per layer and
    reduction, amplified by a few through the layers of a tiny model)."""
    return ulps * EPS32 * float(np.max(np.abs(values)))
