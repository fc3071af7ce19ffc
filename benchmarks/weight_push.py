"""Weight push throughput between process groups: JAX's cross-host `device_put` against
`jax.experimental.transfer`'s pull, on loopback.

    rlbolt launch --local 4 -- python benchmarks/weight_push.py --mib 64 --repeats 5

Processes 2, 3 (training) hold `--leaves` float32 arrays of `--mib` MiB in all, sharded fsdp=2
over their one CPU device each; processes 0, 1 (rollout) receive them on the same layout. Each
repeat starts at a barrier; the time is the receivers' wall time until the arrays are ready.
`device_put`: `ProcessWeightPush` (staging reshard, a no-op here, then the cross-host
device_put). `transfer`: each training process serves its shards (`TransferServer.await_pull`)
and its rollout partner pulls them, then assembles the global arrays. Process 0 prints one JSON
line: median seconds and MB/s (bytes of the whole tree / median) per method.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

from rlbolt.distributed import initialize

initialize()

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import transfer  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from rlbolt.distributed import MeshSpec, ShardingPlan  # noqa: E402
from rlbolt.distributed.weight_push import ProcessWeightPush  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--leaves", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from jax._src import distributed

    kv = distributed.global_state.client
    devices = jax.devices()
    assert len(devices) == 4 and jax.process_count() == 4, "run with `rlbolt launch --local 4`"
    pid = jax.process_index()
    rollout = ShardingPlan(MeshSpec(fsdp=2).build(devices[0:2]))
    train = ShardingPlan(MeshSpec(fsdp=2).build(devices[2:4]))
    rows = args.mib * 2**20 // 4 // args.leaves // 256
    shape = (rows - rows % 2, 256)
    total = args.leaves * shape[0] * shape[1] * 4
    sending = pid >= 2

    def leaf(i):  # an nnx.Param with logical axes, so the push lays it out as fsdp over rows
        spec = NamedSharding(train.mesh if sending else rollout.mesh, PartitionSpec("fsdp", None))
        if sending:
            value = jax.make_array_from_callback(shape, spec, lambda idx: np.full(shape, i, np.float32)[idx])
        else:
            value = jax.ShapeDtypeStruct(shape, np.float32)
        param = nnx.Param(value)
        param.set_metadata(out_sharding=("embed", None))
        return param

    tree = nnx.State({f"w{i:04d}": leaf(i) for i in range(args.leaves)})  # sorted keys = creation order
    push = ProcessWeightPush(train, rollout)
    times: dict[str, list[float]] = {"device_put": [], "transfer": []}
    local = jax.local_devices()[0]
    server = transfer.start_transfer_server(local.client, "127.0.0.1:0", ["127.0.0.1:0"])
    kv.key_value_set(f"bench/server/{pid}", server.address())
    peer = None if sending else server.connect(kv.blocking_key_value_get(f"bench/server/{pid + 2}", 60_000))
    for repeat in range(args.repeats + 1):  # the first round compiles and connects: not timed
        kv.wait_at_barrier(f"bench/put/{repeat}", 120_000)
        start = time.perf_counter()
        got, _ = push(tree, repeat if sending else None)
        if not sending:
            jax.block_until_ready(got)
            if repeat:
                times["device_put"].append(time.perf_counter() - start)
        kv.wait_at_barrier(f"bench/pull/{repeat}", 120_000)
        start = time.perf_counter()
        if sending:
            server.await_pull(repeat, [x.addressable_shards[0].data for x in jax.tree.leaves(tree)])
        else:
            half = (shape[0] // 2, shape[1])
            specs = [jax.ShapeDtypeStruct(half, np.float32, sharding=jax.sharding.SingleDeviceSharding(local))
                     for _ in range(args.leaves)]
            pulled = peer.pull(repeat, specs)
            target = NamedSharding(rollout.mesh, PartitionSpec("fsdp", None))
            whole = [jax.make_array_from_single_device_arrays(shape, target, [p]) for p in pulled]
            jax.block_until_ready(whole)
            if repeat:
                times["transfer"].append(time.perf_counter() - start)
            got_values = [float(w.addressable_shards[0].data[0, 0]) for w in whole]
            assert got_values == list(range(args.leaves)), got_values
        kv.wait_at_barrier(f"bench/done/{repeat}", 120_000)
    if not sending:
        kv.key_value_set(f"bench/times/{pid}", json.dumps(times))
    kv.wait_at_barrier("bench/end", 120_000)
    if pid == 0:
        both = [json.loads(kv.blocking_key_value_get(f"bench/times/{p}", 60_000)) for p in (0, 1)]
        from machine import cpu_model  # benchmarks/machine.py, beside this script

        result = {"cpu": cpu_model(), "bytes": total, "leaves": args.leaves, "repeats": args.repeats}
        for method in times:
            per_repeat = [max(a, b) for a, b in zip(both[0][method], both[1][method])]  # both receivers done
            median = statistics.median(per_repeat)
            result[method] = {"median_s": round(median, 4), "MB_per_s": round(total / median / 1e6, 1)}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
