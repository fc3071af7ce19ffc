"""One process of the weight-push check between process groups; run 4 of them with `rlbolt launch`:

    rlbolt launch --local 4 -- python tests/distributed/push_checks.py OUT

Devices are ordered by process (one CPU device each): rollout = devices [0, 2) (processes 0, 1)
as a tp=2 mesh, train = devices [2, 4) (processes 2, 3) as fsdp=2, so every leaf changes layout
on the way. Each group runs its own jitted programs on its own sub-mesh: training makes three
policy versions (params x (1 + v / 8), a jit on the training mesh) and pushes each; rollout
receives each abstractly and sums the squares of what it got (a jit on the rollout mesh).
Files: `OUT/sent_v<v>.npz` (process 2: the whole params of version v, gathered within the
training group), `OUT/got_<process>_v<v>.npz` (each rollout process: its addressable shards,
keyed `<leaf>|<start:stop,...>`), `OUT/rollout_<process>.json` (versions, sums of squares,
the target specs). Then every process runs one program: it builds the training params and
calls the one-host `WeightSync` (`sent_sync.npz`, `got_<process>_sync.npz`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax

from rlbolt.distributed import initialize

initialize()

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from rlbolt.distributed import MeshSpec, ShardingPlan  # noqa: E402
from rlbolt.distributed.placement import WeightSync  # noqa: E402
from rlbolt.distributed.weight_push import ProcessWeightPush  # noqa: E402
from rlbolt.models import Decoder, tiny_config  # noqa: E402

VERSIONS = (1, 2, 3)


def main(out: Path) -> None:
    devices = jax.devices()
    assert [d.process_index for d in devices] == [0, 1, 2, 3], devices
    rollout = ShardingPlan(MeshSpec(fsdp=1, tp=2).build(devices[0:2]))
    train = ShardingPlan(MeshSpec(fsdp=2).build(devices[2:4]))
    push = ProcessWeightPush(train, rollout)
    config = tiny_config(hidden_size=32, intermediate_size=64, head_dim=8)
    out.mkdir(parents=True, exist_ok=True)
    if push.role == "send":
        model = train.build_module(lambda: Decoder(config, rngs=nnx.Rngs(0)))
        params = nnx.state(model, nnx.Param)
        scale = jax.jit(lambda tree, v: jax.tree.map(lambda x: x * (1 + v / 8), tree))  # on the training mesh only
        for version in VERSIONS:
            current = scale(params, np.float32(version))
            whole = _whole(current)  # a jit on the training mesh: both training processes take part
            if jax.process_index() == 2:
                np.savez(out / f"sent_v{version}.npz", **whole)
            assert push(current, version) == (None, version)
    else:
        abstract = nnx.state(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))), nnx.Param)
        sumsq = jax.jit(lambda tree: sum(jax.numpy.sum(jax.numpy.square(x)) for x in jax.tree.leaves(tree)))
        report = {"versions": [], "sumsq": [], "specs": {}}
        for version in VERSIONS:
            got, got_version = push(abstract, None)
            report["versions"].append(got_version)
            report["sumsq"].append(float(np.asarray(sumsq(got).addressable_shards[0].data)))  # on the rollout mesh
            for path, leaf in nnx.to_flat_state(got):
                assert leaf.get_value().sharding.mesh.devices.tolist() == rollout.mesh.devices.tolist()
                report["specs"][".".join(map(str, path))] = str(leaf.get_value().sharding.spec)
            np.savez(out / f"got_{jax.process_index()}_v{version}.npz", **_shards(got))
        (out / f"rollout_{jax.process_index()}.json").write_text(json.dumps(report))
    # One program on every process: each builds the training params (nothing runs off the training group, whose
    # arrays then have no local shards there) and calls the one-host WeightSync, unchanged.
    model = train.build_module(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    whole = _whole(params)  # on the training mesh: a no-op off it
    moved = WeightSync(train, rollout)(params)
    if jax.process_index() == 2:
        np.savez(out / "sent_sync.npz", **whole)
    if push.role == "receive":
        np.savez(out / f"got_{jax.process_index()}_sync.npz", **_shards(moved))


def _shards(tree) -> dict[str, np.ndarray]:
    """This process's shards of every leaf, keyed `<leaf>|<start:stop,...>`."""
    shards = {}
    for path, leaf in nnx.to_flat_state(tree):
        for shard in leaf.get_value().addressable_shards:
            key = ".".join(map(str, path)) + "|" + ",".join(f"{s.start}:{s.stop}" for s in _slices(shard))
            shards[key] = np.asarray(shard.data)
    return shards


def _slices(shard) -> list[slice]:
    return [slice(s.start or 0, (s.start or 0) + n) for s, n in zip(shard.index, shard.data.shape)]


def _whole(tree) -> dict[str, np.ndarray]:
    """The training group's params gathered whole on its own processes (a jit on the training mesh; {} elsewhere)."""
    flat = nnx.to_flat_state(tree)
    replicated = jax.jit(lambda xs: xs, out_shardings=jax.sharding.NamedSharding(
        jax.tree.leaves(tree)[0].sharding.mesh, jax.sharding.PartitionSpec()))([v.get_value() for _, v in flat])
    if not replicated[0].addressable_shards:  # a process outside the training group: the jit ran nowhere here
        return {}
    return {".".join(map(str, path)): np.asarray(x.addressable_shards[0].data) for (path, _), x in zip(flat, replicated)}


if __name__ == "__main__":
    main(Path(sys.argv[1]))
