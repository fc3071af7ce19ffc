"""The experts' kernels gathered a block of the intermediate dim at a time (`rlbolt.models.expert_blocks`,
`model.expert_block_size`): outputs against float64 NumPy, outputs and gradients against the whole-kernel
path, and the program gathering only blocks. 8 CPU devices (data 1 x fsdp 4 x expert 2) in a fresh process,
megablox gmm in Pallas' interpret mode (the shard_map manual over every axis, as on TPU).

Tolerances: the blocked path adds k = 2 float32 block results where the whole path accumulates one dot, so
outputs differ by float32 rounding of sums of I + H terms: (I + H + 8) eps32 of the sum of the terms'
magnitudes (Higham Eq. 3.5, with margin for the SiLU). Gradients: both paths run the same products per
block and reduce-scatter over 4 shards in another order: 8 eps32 per summed term of the largest entry."""

from pathlib import Path
from cpu_devices import run_on_cpu_devices

SCRIPT = Path(__file__).with_name("expert_case.py").read_text() + r"""
eps = np.finfo(np.float32).eps

def run(block):
    return lambda x, g, d: expert_parallel_experts(x, experts, weights, g, d, "silu", mesh, "gmm-interpret", specs, block)

# float64 NumPy: each token's k experts, weighted
X, E_, W = np.asarray(x, np.float64), np.asarray(experts), np.asarray(weights, np.float64)
GU, D = np.asarray(gate_up, np.float64), np.asarray(down, np.float64)
want, scale = np.zeros((n, h)), np.zeros((n, h))
for t in range(n):
    for j in range(k):
        g, u = X[t] @ GU[E_[t, j], :, :i], X[t] @ GU[E_[t, j], :, i:]
        a = g / (1 + np.exp(-g)) * u
        want[t] += W[t, j] * (a @ D[E_[t, j]])
        scale[t] += W[t, j] * (np.abs(a) @ np.abs(D[E_[t, j]]) + np.abs(X[t]) @ np.abs(GU[E_[t, j]]).max(axis=1) * np.abs(D[E_[t, j]]).sum(0))
whole, blocked = (np.asarray(jax.jit(run(b))(x, gate_up, down)) for b in (0, i // 2))
for got in (whole, blocked):
    assert np.all(np.abs(got - want) <= (i + h + 8) * eps * scale), np.abs(got - want).max()
assert np.all(np.abs(blocked - whole) <= 2 * (i + h + 8) * eps * scale)

def gathers(block):
    # the shapes every all_gather of the grad program yields
    loss = lambda x, g, d: jnp.sum(run(block)(x, g, d) ** 2)
    text = str(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x, gate_up, down))
    return {m.group(1) for m in re.finditer(r"f32\[([\d,]+)\]\S* = all_gather\[", text)}, text
shapes, _ = gathers(0)
assert {"2,16,16", "2,8,16"} <= shapes, shapes  # whole [E/X, H, 2I] and [E/X, I, H] kernels
shapes, text = gathers(i // 2)
assert "2,16,16" not in shapes and "2,8,16" not in shapes and {"2,16,8", "2,4,16"} <= shapes, shapes
assert re.search(r"f32\[2,4,8\]\S* = reduce_scatter\[", text), "a block's gate|up gradient reduce-scattered"

grads = [jax.jit(jax.grad(lambda x, g, d: jnp.sum(run(b)(x, g, d) ** 2), (0, 1, 2)))(x, gate_up, down) for b in (0, i // 2)]
for a, b, sharding in zip(*grads, (rows, *(NamedSharding(mesh, s) for s in specs))):
    assert b.sharding.is_equivalent_to(sharding, 2 if b.ndim == 2 else 3), b.sharding
    bound = 8 * eps * float(np.abs(np.asarray(a)).max()) * (n * k + h + i)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=bound)
print("ok")
"""


def test_blocked_experts_equal_float64_and_the_whole_kernels_and_gather_only_blocks():
    out = run_on_cpu_devices(SCRIPT)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]


def test_blocks_only_where_the_kernels_are_gathered_and_their_intermediate_dim_is_whole():
    from jax.sharding import PartitionSpec as P

    from rlbolt.models.moe import expert_blocks_for

    fsdp = [P("expert", "fsdp", None), P("expert", None, "fsdp")]
    assert expert_blocks_for(768, 256, fsdp) == 3  # Qwen3-30B-A3B's experts: 3 blocks of 256
    assert expert_blocks_for(768, 0, fsdp) == 1  # 0: whole kernels
    assert expert_blocks_for(768, 1024, fsdp) == 1  # one block covers it
    assert expert_blocks_for(768, 256, [P("expert"), P("expert")]) == 1  # nothing gathered inside
    assert expert_blocks_for(768, 256, [P("expert", "fsdp", "tp"), P("expert", "tp", "fsdp")]) == 1  # tp splits I
