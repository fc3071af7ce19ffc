"""The experts' kernel gradients leave `expert_parallel_experts` reduce-scattered into the kernels'
stored fsdp shards, not all-reduced whole: the kernels enter the shard_map as they lie
(`MoeMLP.kernel_specs`) and are all-gathered inside, whose transpose is a reduce-scatter. Entering
replicated over fsdp (the edge gather, `specs=None`), every device all-reduced the whole [E / X, H, 2I]
gradient (the 48-layer Qwen3-30B-A3B update: "MoE on TPU" in benchmarks/RESULTS.md). 8 CPU devices,
data 1 x fsdp 4 x expert 2, ragged_dot, in a fresh process. Gradients of both: the same program up
to where the sums happen, float32 sums of 4 shards in another order: 4 eps32 of each array's magnitude
per summed term (Higham Eq. 4.4), times 8 for the products' own reorderings."""

from pathlib import Path
from cpu_devices import run_on_cpu_devices

SCRIPT = Path(__file__).with_name("expert_case.py").read_text() + r"""
def sums(jaxpr):
    # (shape, kind, psum's axes) of every psum / reduce_scatter of a rank-3 (kernel-shaped) value in the
    # jaxpr (the compiled CPU program cannot tell: XLA's CPU backend decomposes a reduce-scatter into an
    # all-reduce and a slice)
    out = []
    for line in jaxpr.splitlines():
        m = re.search(r"f32\[([\d,]+)\]\S* = (psum\w*|reduce_scatter)\[", line)
        if m and m.group(1).count(",") == 2:
            axes = re.search(r"axes=\(([^)]*)\)", line)
            out.append((tuple(int(d) for d in m.group(1).split(",")), m.group(2), axes.group(1) if axes else ""))
    return out
grads = {}
for name, given in (("edge", None), ("inside", specs)):
    loss = lambda g, d: jnp.sum(expert_parallel_experts(x, experts, weights, g, d, "silu", mesh, "ragged_dot", given) ** 2)
    step = jax.jit(jax.grad(loss, (0, 1)))
    found = sums(str(jax.make_jaxpr(step)(gate_up, down)))
    whole = [s for s, kind, axes in found if kind.startswith("psum") and "fsdp" in axes and s in {(e // 2, h, 2 * i), (e // 2, i, h)}]
    scattered = [s for s, kind, _ in found if kind == "reduce_scatter" and s in {(e // 2, h // 4, 2 * i), (e // 2, i, h // 4)}]
    assert (bool(whole), bool(scattered)) == ((True, False) if name == "edge" else (False, True)), (name, found)
    grads[name] = step(gate_up, down)
for a, b, spec in zip(grads["edge"], grads["inside"], specs):
    assert b.sharding.is_equivalent_to(NamedSharding(mesh, spec), 3), b.sharding
    bound = 8 * 4 * np.finfo(np.float32).eps * float(np.abs(np.asarray(a)).max()) * n
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=bound)
print("ok")
"""


def test_expert_kernel_gradients_are_reduce_scattered_not_all_reduced_whole():
    out = run_on_cpu_devices(SCRIPT)
    assert out.returncode == 0 and out.stdout.startswith("ok"), out.stderr[-3000:]
