"""Rollout rows between process groups: the Trainer's Arrow Flight path (`FlightRows`) against the
coordination service's key-value store (`GroupLink`).

    rlbolt launch --local 2 -- python benchmarks/group_link.py --mib 1 10 100 --repeats 5

Process 1 (a rollout process) puts a dict of int32 / float32 / bool columns of `--mib` MiB in all
(the shape of a rollout micro batch's rows: ids, logps, masks) under a fresh key, as
`run_rollout_group` does (`rows.put(key, (columns, logged))`); process 0 (a training process, where
the coordination service runs) takes it as `RemoteRollout` does (`rows.take(key)`). Two ways,
interleaved round by round so load changes hit them alike:
  - flight: `FlightRows` (process 0 serves a dock over Arrow Flight, process 1 adds the columns to it;
    the empty host objects go through the key-value store);
  - link: `GroupLink` (the whole dict pickled into the key-value store, the transport before).
Each repeat starts at a barrier; the time is process 0's wall time from the barrier until it holds the
rows. Process 0 prints one JSON line per size and way (median seconds and MB/s), then one line with
the machine (`lscpu` model, load average). `--ways link` or `--ways flight` runs one of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax

from rlbolt.distributed import initialize

initialize()

import numpy as np  # noqa: E402

from rlbolt.distributed.group_rows import FlightRows  # noqa: E402
from rlbolt.distributed.process_groups import GroupLink  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402


def rows(mib: float) -> dict[str, np.ndarray]:
    """Columns of ~`mib` MiB: [N, 1024] int32 ids, float32 logps, bool mask (9 bytes a token)."""
    n = max(1, int(mib * 2**20 / (9 * 1024)))
    rng = np.random.default_rng(0)
    return {"completion_ids": rng.integers(0, 50_000, (n, 1024), dtype=np.int32),
            "sampler_logps": rng.standard_normal((n, 1024)).astype(np.float32),
            "completion_mask": np.ones((n, 1024), bool),
            "sample_keys": rng.integers(0, 2**32, (n, 2), dtype=np.uint32)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, nargs="+", default=[1.0, 10.0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ways", nargs="+", default=["flight", "link"], choices=("flight", "link"))
    args = ap.parse_args()
    link = GroupLink(timeout_s=600.0)
    me = jax.process_index()
    ways = {"link": link}
    if "flight" in args.ways:
        ways["flight"] = FlightRows(link, "train" if me == 0 else "rollout", peer=1 - me, rank=0, timeout_s=600.0)
    ways = {w: ways[w] for w in args.ways}
    results = []
    for mib in args.mib:
        payload = rows(mib)
        size = sum(v.nbytes for v in payload.values())
        times = {way: [] for way in ways}
        for r in range(args.repeats + 1):  # the first round is untimed
            for way, transport in ways.items():
                key = f"rows/{mib}/{r}/{way}"
                link.barrier(f"bench/{key}", (0, 1))
                began = time.perf_counter()
                if me == 1:
                    transport.put(key, (payload, {}))
                else:
                    got, _ = transport.take(key)
                    assert all(np.array_equal(got[k], payload[k]) for k in payload)
                    if r:
                        times[way].append(time.perf_counter() - began)
        if me == 0:
            for way, ts in times.items():
                median = statistics.median(ts)
                results.append({"way": way, "mib": mib, "bytes": size, "median_s": round(median, 4),
                                "mb_per_s": round(size / median / 1e6, 1)})
                print(json.dumps(results[-1]), flush=True)
    link.barrier("bench/end", (0, 1))
    if "flight" in ways:
        ways["flight"].close()
    if me == 0:
        print(json.dumps({"system": "rlbolt-group-rows", "cpu": cpu_model(), "cpus": os.cpu_count(),
                          "load_average": [round(x, 2) for x in os.getloadavg()], "repeats": args.repeats,
                          "results": results}), flush=True)


if __name__ == "__main__":
    main()
