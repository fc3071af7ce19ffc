"""Three pipeline stages (rollout, reference, training) written once against the dock's calls,
run either as threads on one in-process ExperienceDock or as processes through RemoteDock; and
the writer that the SIGKILL test kills mid-put.

    python tests/dock/flight_stages.py rollout|reference|killed_writer <location> <json args>
    python tests/dock/flight_stages.py server grpc://127.0.0.1:0 '{"lease_s": 1}'   # prints its location

Every column is a pure function of the prompt rows, so the taken batches are known in advance.
"""

from __future__ import annotations

import json
import sys
import time

import ml_dtypes
import numpy as np

STAGES = {"rollout": ("prompt_ids",), "reference": ("completion_ids",),
          "train": ("completion_ids", "completion_mask", "old_logps", "ref_logps")}
VOCAB, PROMPT, COMPLETION = 1000, 5, 7


def prompts(step: int, batch: int) -> dict[str, np.ndarray]:
    """Step `step`'s prompt rows: int32 tokens, a str answer, group ids (groups of 2)."""
    rng = np.random.default_rng(step)
    ids = rng.integers(0, VOCAB, (batch, PROMPT), dtype=np.int32)
    return {"prompt_ids": ids, "answer": np.array([f"step{step}-{i}" for i in range(batch)], object),
            "group_ids": np.arange(batch) // 2}


def completions(prompt_ids: np.ndarray) -> dict[str, np.ndarray]:
    """What "rollout" writes for these prompt rows."""
    ids = ((prompt_ids.sum(axis=1, dtype=np.int64)[:, None] * 31 + np.arange(COMPLETION)) % VOCAB).astype(np.int32)
    lengths = 1 + prompt_ids[:, 0] % COMPLETION
    return {"completion_ids": ids, "completion_mask": np.arange(COMPLETION)[None, :] < lengths[:, None],
            "old_logps": -np.log1p(ids.astype(np.float32))}


def reference_logps(completion_ids: np.ndarray) -> dict[str, np.ndarray]:
    """What "reference" writes (bfloat16, to carry an ml_dtypes column across)."""
    return {"ref_logps": (-np.sqrt(completion_ids.astype(np.float32))).astype(ml_dtypes.bfloat16)}


def rollout(dock, steps: int, batch: int, micro: int) -> None:
    """Adds each step's prompts, then rolls them out `micro` at a time (one_batch)."""
    for step in range(steps):
        dock.add(prompts(step, batch), key=step)
        done = 0
        while done < batch:
            taken = dock.get("rollout", n=micro, one_batch=True)
            dock.put(completions(taken.batch["prompt_ids"]), taken.indices)
            done += len(taken.indices)


def reference(dock, steps: int, batch: int, micro: int) -> None:
    """Scores rolled-out samples `micro` at a time until every step's are scored."""
    done = 0
    while done < steps * batch:
        taken = dock.get("reference", n=micro, one_batch=True)
        dock.put(reference_logps(taken.batch["completion_ids"]), taken.indices)
        done += len(taken.indices)


def train(dock, steps: int, batch: int) -> list:
    """Takes each step's whole batch; returns the `Taken`s."""
    return [dock.get("train", n=batch, one_batch=True) for _ in range(steps)]


def killed_writer(dock, location: str, indices: list[int]) -> None:
    """Writes `completions` for the first half of `indices` with one whole put, then starts a put
    of the second half, sends half of its stream, says READY and waits to be killed."""
    from rlbolt.producer.dock.flight import wire
    import pyarrow.flight as flight

    first, second = indices[:len(indices) // 2], indices[len(indices) // 2:]
    dock.put(completions(np.ones((len(first), PROMPT), np.int32)), first)
    rows = completions(np.ones((len(second), PROMPT), np.int32))
    batch = wire.to_record_batch(rows, "put")
    args = {"call": "put", "client": f"{dock.process}/{dock.stage}", "indices": second, "rows": len(second)}
    descriptor = flight.FlightDescriptor.for_command(wire.dumps(args))
    writer, _ = flight.FlightClient(location).do_put(descriptor, batch.schema)
    writer.write_batch(batch.slice(0, 1))  # one row of the put's stream is on the wire, the rest never comes
    print("READY", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    from rlbolt.producer.dock.flight import RemoteDock

    role, location, args = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if role == "server":
        from rlbolt.producer.dock import ExperienceDock
        from rlbolt.producer.dock.flight import DockServer

        print(DockServer(ExperienceDock(STAGES), location, **args).location, flush=True)
        time.sleep(600)
        sys.exit(0)
    with RemoteDock(location, process=f"{role}-0", stage=role) as remote:
        if role == "killed_writer":
            killed_writer(remote, location, **args)
        else:
            {"rollout": rollout, "reference": reference}[role](remote, **args)
