"""Rollout rows between process groups: the coordination service's key-value store (`GroupLink`).

    rlbolt launch --local 2 -- python benchmarks/group_link.py --mib 1 10 --repeats 5

Process 1 (a rollout process) puts a dict of int32 / float32 / bool columns of `--mib` MiB in all
(the shape of a rollout micro batch's rows: ids, logps, masks) under a fresh key; process 0 (a
training process, where the coordination service runs) takes it. Each repeat starts at a
barrier; the time is process 0's wall time from the barrier until it holds the rows. Process 0
prints one JSON line per size: median seconds and MB/s. Process 1 puts and process 0 takes, so
the bytes cross the service once (a training process other than 0 would add a second hop).
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

from rlbolt.distributed.process_groups import GroupLink  # noqa: E402


def rows(mib: float) -> dict[str, np.ndarray]:
    """Columns of ~`mib` MiB: [N, 1024] int32 ids, float32 logps, bool mask (9 bytes a token)."""
    n = max(1, int(mib * 2**20 / (9 * 1024)))
    rng = np.random.default_rng(0)
    return {"completion_ids": rng.integers(0, 50_000, (n, 1024), dtype=np.int32),
            "sampler_logps": rng.standard_normal((n, 1024)).astype(np.float32),
            "completion_mask": np.ones((n, 1024), bool)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    link = GroupLink()
    for mib in args.mib:
        payload = rows(mib)
        size = sum(v.nbytes for v in payload.values())
        times = []
        for r in range(args.repeats + 1):  # the first round is untimed
            link.barrier(f"bench/{mib}/{r}", (0, 1))
            began = time.perf_counter()
            if jax.process_index() == 1:
                link.put(f"rows/{mib}/{r}", payload)
            else:
                got = link.take(f"rows/{mib}/{r}")
                assert all(np.array_equal(got[k], payload[k]) for k in payload)
                if r:
                    times.append(time.perf_counter() - began)
        if jax.process_index() == 0:
            median = statistics.median(times)
            print(json.dumps({"mib": mib, "bytes": size, "median_s": round(median, 4),
                              "mb_per_s": round(size / median / 1e6, 1)}), flush=True)


if __name__ == "__main__":
    main()
