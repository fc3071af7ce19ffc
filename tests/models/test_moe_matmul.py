"""model.moe_matmul: Pallas megablox gmm (in Pallas' interpret mode, on CPU) against float64 NumPy per
group and against the ragged_dot path, outputs and gradients; how each choice resolves per platform;
a bad choice refused in one line. The TPU compile of gmm (what it saves) is tests/planning/test_moe_plan_tpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from float_tolerance import EPS32, dot_error_bound
from rlbolt.config import ConfigError, load_config
from rlbolt.models.moe import grouped_experts, route
from rlbolt.models.moe_matmul import grouped_matmul, resolve_moe_matmul

# Hostile groups: an empty first group, an empty middle one, 9 rows after the last group (they must
# come out 0, and their gradient 0), 41 rows in all (not a multiple of 8 or of gmm's row tile).
SIZES = np.array([0, 11, 0, 7, 14], np.int32)
M, K, N = 41, 24, 40


def _per_group_f64(lhs, rhs, sizes):
    """float64 NumPy: each group's rows times its kernel, zeros after the last group."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size].astype(np.float64) @ rhs[g].astype(np.float64)
        start += size
    return out


def _case(seed=0):
    rng = np.random.default_rng(seed)
    lhs = rng.normal(size=(M, K)).astype(np.float32)
    rhs = rng.normal(size=(len(SIZES), K, N)).astype(np.float32)
    cotangent = rng.normal(size=(M, N)).astype(np.float32)
    return lhs, rhs, cotangent


def _row_kernels(rhs, sizes, m):
    """[M, K, N] the kernel each row is multiplied by (zeros after the last group)."""
    per_row = np.zeros((m, *rhs.shape[1:]), np.float32)
    per_row[:sizes.sum()] = np.repeat(rhs, sizes, axis=0)
    return per_row


@pytest.mark.parametrize("kernel", ["gmm-interpret", "ragged_dot"])
def test_grouped_matmul_equals_float64_per_group_and_zeros_after_the_last_group(kernel):
    lhs, rhs, _ = _case()
    run = jax.jit(lambda l, r, s: grouped_matmul(l, r, s, kernel))  # one compile, not one per primitive
    got = np.asarray(run(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(SIZES)))
    want = _per_group_f64(lhs, rhs, SIZES)
    bound = np.stack([dot_error_bound(lhs[r], w) for r, w in enumerate(_row_kernels(rhs, SIZES, M))])
    assert np.all(np.abs(got - want) <= bound)
    np.testing.assert_array_equal(got[SIZES.sum():], 0.0)  # exact: rows in no group are written as zeros


def test_gmm_gradients_equal_float64_per_group():
    """d/dlhs sum(out * c) = c @ rhs_g^T per row; d/drhs_g = lhs_g^T @ c_g; rows in no group get 0."""
    lhs, rhs, c = _case(1)
    grad = jax.jit(jax.grad(lambda l, r: jnp.sum(grouped_matmul(l, r, jnp.asarray(SIZES), "gmm-interpret") * c),
                            (0, 1)))  # one compile, not one per primitive
    d_lhs, d_rhs = (np.asarray(g) for g in grad(jnp.asarray(lhs), jnp.asarray(rhs)))
    per_row = _row_kernels(rhs, SIZES, M)
    want_lhs = np.einsum("mn,mkn->mk", c.astype(np.float64), per_row.astype(np.float64))
    bound_lhs = np.stack([dot_error_bound(c[r], per_row[r].T) for r in range(M)])
    assert np.all(np.abs(d_lhs - want_lhs) <= bound_lhs)
    np.testing.assert_array_equal(d_lhs[SIZES.sum():], 0.0)  # exact: no kernel reaches those rows
    starts = np.concatenate([[0], np.cumsum(SIZES)])
    for g in range(len(SIZES)):
        rows = slice(starts[g], starts[g + 1])
        want = lhs[rows].T.astype(np.float64) @ c[rows].astype(np.float64)  # [K, N]; 0 for an empty group
        bound = max(SIZES[g], 1) * EPS32 * (np.abs(lhs[rows].T.astype(np.float64)) @ np.abs(c[rows]))
        assert np.all(np.abs(d_rhs[g] - want) <= bound), g


@pytest.mark.slow  # about 6 s of Pallas interpret mode
def test_moe_experts_with_gmm_equal_the_ragged_dot_path_outputs_and_gradients():
    """The whole expert block (sort, two grouped matmuls, SiLU, weighted scatter) under each kernel:
    outputs and gradients (tokens, both kernels) agree within float32 rounding."""
    rng = np.random.default_rng(2)
    n, h, e, i, k = 19, 16, 6, 12, 2
    x = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
    gate_up = jnp.asarray(0.3 * rng.normal(size=(e, h, 2 * i)), jnp.float32)
    down = jnp.asarray(0.3 * rng.normal(size=(e, i, h)), jnp.float32)
    weights, experts, _ = route(jnp.asarray(rng.normal(size=(n, e)), jnp.float32), k, True)
    experts = experts.at[:, 0].set(jnp.where(experts[:, 1] == 5, experts[:, 0], 5))  # expert 5 on every token
    out_gmm, out_rd = (grouped_experts(x, experts, weights, gate_up, down, "silu", kern)
                       for kern in ("gmm-interpret", "ragged_dot"))
    # outputs: two products (H, then I terms) and the k-term sum, charged on |x| |w| magnitudes
    scale = float(jnp.max(jnp.abs(x)) * jnp.max(jnp.abs(gate_up)) * h * jnp.max(jnp.abs(down)) * i)
    np.testing.assert_allclose(np.asarray(out_gmm), np.asarray(out_rd), atol=(h + i + k) * EPS32 * scale, rtol=0)

    def loss(kernel):
        return lambda x, gu, d: jnp.sum(grouped_experts(x, experts, weights, gu, d, "silu", kernel) ** 2)

    g_gmm, g_rd = (jax.grad(loss(kern), (0, 1, 2))(x, gate_up, down) for kern in ("gmm-interpret", "ragged_dot"))
    # Each gradient element passes reductions of H, I and k terms and, for a kernel, a sum over up to
    # N * k rows: first order, K * eps relative per reduction, charged against the array's largest
    # element (measured: differences 100x below this on an AMD EPYC).
    reductions = h + i + k + n * k
    for a, b in zip(g_gmm, g_rd):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=reductions * EPS32 * float(jnp.max(jnp.abs(b))),
                                   rtol=0)
    assert float(jnp.max(jnp.abs(g_gmm[1][5]))) > 0  # the expert every token uses has a gradient


@pytest.mark.parametrize("choice, platform, kernel", [
    ("auto", "tpu", "gmm"), ("auto", "cpu", "ragged_dot"), ("auto", "gpu", "ragged_dot"),
    ("gmm", "tpu", "gmm"), ("ragged_dot", "tpu", "ragged_dot"), ("ragged_dot", "cpu", "ragged_dot")])
def test_moe_matmul_resolves_per_platform(choice, platform, kernel):
    assert resolve_moe_matmul(choice, platform) == kernel


@pytest.mark.parametrize("choice, platform, needle", [("gmm", "cpu", "TPU kernel"), ("megablox", "tpu", "one of")])
def test_a_bad_moe_matmul_is_refused_in_one_line(choice, platform, needle):
    with pytest.raises(ValueError, match=needle) as err:
        resolve_moe_matmul(choice, platform)
    assert "model.moe_matmul" in str(err.value) and "\n" not in str(err.value)


def test_the_config_refuses_an_unknown_moe_matmul():
    with pytest.raises(ConfigError, match="moe_matmul"):
        load_config({"model": {"moe_matmul": "dense"}})
