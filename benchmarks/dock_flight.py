"""The dock across processes: put + get throughput of rollout-sized columns over loopback Arrow
Flight (RemoteDock -> DockServer) against the in-process ExperienceDock.

One round: add N rows (a small prompt-index column), put N x L int32 completion ids and N x L
float32 logps (the payload, 8 * N * L bytes), get the N rows with both columns. Three ways,
interleaved round by round so load changes hit them alike:
  - local: the ExperienceDock itself (a get returns views of the put's arrays: no copy);
  - thread: RemoteDock to a DockServer thread in the same process (client and server share the GIL);
  - process: RemoteDock to a DockServer in another process (the deployed shape).

    python benchmarks/dock_flight.py            # N = 64 and 512, L = 4096, 20 rounds
    python benchmarks/dock_flight.py --quick    # N = 64, L = 4096, 3 rounds (CI: fields only)

Prints a table (MB = 1e6 bytes of payload), then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from rlbolt.producer.dock import ExperienceDock
from rlbolt.producer.dock.flight import DockServer, RemoteDock

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402

STAGES = {"train": ("completion_ids", "logps")}
LENGTH = 4096


def one_round(dock, cols: dict[str, np.ndarray]) -> tuple[float, float]:
    """(put seconds, get seconds) of one round; checks the rows came back."""
    n = len(cols["logps"])
    idx = dock.add({"prompt_index": np.arange(n)})
    t0 = time.perf_counter()
    dock.put(cols, idx)
    t1 = time.perf_counter()
    batch, got = dock.get("train", n=n, timeout=10)
    t2 = time.perf_counter()
    assert len(got) == n and batch["logps"][-1, -1] == cols["logps"][-1, -1]
    return t1 - t0, t2 - t1


def serve_forever() -> None:
    """--serve: a DockServer in this process; prints its location, serves until stdin closes."""
    server = DockServer(ExperienceDock(STAGES))
    print(server.location, flush=True)
    sys.stdin.read()
    server.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 64, 3 rounds (CI)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve_forever()
    sizes, rounds = ((64,), 3) if args.quick else ((64, 512), 20)
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    server = DockServer(ExperienceDock(STAGES))
    docks = {"local": ExperienceDock(STAGES),
             "thread": RemoteDock(server.location, process="bench-thread", stage="train"),
             "process": RemoteDock(child.stdout.readline().strip(), process="bench-process", stage="train")}
    rng = np.random.default_rng(0)
    results = {}
    try:
        for n in sizes:
            cols = {"completion_ids": rng.integers(0, 150_000, (n, LENGTH), dtype=np.int32),
                    "logps": rng.standard_normal((n, LENGTH)).astype(np.float32)}
            payload = sum(c.nbytes for c in cols.values())
            times = {way: [] for way in docks}
            for way, dock in docks.items():  # warm-up (connections, first allocations)
                one_round(dock, cols)
            for _ in range(rounds):
                for way, dock in docks.items():
                    times[way].append(one_round(dock, cols))
            for way, ts in times.items():
                put_s = statistics.median(t[0] for t in ts)
                get_s = statistics.median(t[1] for t in ts)
                both_s = statistics.median(t[0] + t[1] for t in ts)
                results[f"{n}/{way}"] = {"rows": n, "way": way, "payload_mb": payload / 1e6, "put_ms": 1e3 * put_s,
                                         "get_ms": 1e3 * get_s, "put_mb_s": payload / 1e6 / put_s,
                                         "get_mb_s": payload / 1e6 / get_s, "rows_per_s": n / both_s}
    finally:
        for dock in docks.values():
            if isinstance(dock, RemoteDock):
                dock.disconnect()
        server.shutdown()
        child.stdin.close()
        child.wait(30)
    print(f"Dock put + get of N x {LENGTH} int32 ids + float32 logps, median of {rounds} interleaved rounds "
          f"({cpu_model()})")
    print(f"{'rows':>5} {'way':>8} {'MB':>6} {'put ms':>8} {'get ms':>8} {'put MB/s':>9} {'get MB/s':>9} {'rows/s':>9}")
    for r in results.values():
        print(f"{r['rows']:>5} {r['way']:>8} {r['payload_mb']:>6.2f} {r['put_ms']:>8.2f} {r['get_ms']:>8.2f} "
              f"{r['put_mb_s']:>9.0f} {r['get_mb_s']:>9.0f} {r['rows_per_s']:>9.0f}")
    print(json.dumps({"system": "rlbolt-dock-flight", "cpu": cpu_model(), "rounds": rounds, "length": LENGTH,
                      "results": results}))


if __name__ == "__main__":
    main()
