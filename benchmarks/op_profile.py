"""Where a jitted call's time goes on CPU, op by op: a jax.profiler trace read against its compiled HLO.

    jax.profiler.start_trace(folder); ...calls...; jax.profiler.stop_trace()
    print_op_table(folder, compiled.as_text(), calls=n)

The trace (`plugins/profile/*/*.trace.json.gz`) holds one event per executed HLO op per thread
(`args.hlo_op`); the compiled HLO names each op's output shape, its kind (dot, a YNNPACK fusion,
a loop fusion, a copy) and the jax operation it came from (`metadata op_name`). The table sums
the events of each op over every thread and divides by `calls`, costliest first, and groups them
by kind, so that "what does the step spend beyond its products" has an answer per op.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

_OP = re.compile(r"^\s*(?:ROOT )?%(?P<name>[\w.\-]+) = (?P<shape>\S+) (?P<kind>[\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def op_seconds(trace_folder: str | Path) -> dict[str, float]:
    """Seconds per HLO op name, summed over every thread, from the newest trace under `trace_folder`."""
    traces = sorted(Path(trace_folder).glob("plugins/profile/*/*.trace.json.gz"))
    if not traces:
        raise FileNotFoundError(f"no jax.profiler trace under {trace_folder}")
    events = json.loads(gzip.open(traces[-1]).read())["traceEvents"]
    seconds: dict[str, float] = collections.Counter()
    for e in events:
        op = (e.get("args") or {}).get("hlo_op")
        if e.get("ph") == "X" and op:
            seconds[op] += e["dur"] / 1e6
    return dict(seconds)


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """{op name: {shape, kind, source}} for every op of the compiled module's computations."""
    ops = {}
    for line in hlo_text.splitlines():
        m = _OP.match(line)
        if m:
            source = _OP_NAME.search(line)
            kind = m["kind"]
            if kind == "fusion":
                kind = "ynn fusion (products)" if "__ynn_fusion" in line else m["name"].rsplit(".", 1)[0]
            ops[m["name"]] = {"shape": m["shape"], "kind": kind, "source": source[1] if source else ""}
    return ops


def print_op_table(trace_folder: str | Path, hlo_text: str, calls: int = 1, top: int = 25) -> dict:
    """Prints the costliest ops and the seconds per kind, per call; returns {kind: seconds}."""
    seconds, ops = op_seconds(trace_folder), hlo_ops(hlo_text)
    total = sum(seconds.values()) / calls
    print(f"ops of one call: {total:.3f} s in {len(seconds)} ops (summed over threads)")
    for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]:
        op = ops.get(name, {"shape": "?", "kind": "?", "source": ""})
        print(f"  {s / calls:8.3f} s {s / calls / total:6.1%}  {name:<32} {op['shape']:<28} {op['source'][-70:]}")
    kinds: dict[str, float] = collections.Counter()
    for name, s in seconds.items():
        kinds[ops.get(name, {"kind": "?"})["kind"]] += s / calls
    print("by kind:", ", ".join(f"{k} {v:.3f} s" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])[:10]))
    return dict(kinds)
