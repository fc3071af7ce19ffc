"""Reads an offline W&B run's ``run-<id>.wandb`` file back (test helper).

wandb 0.31 ships no Python reader for its own transaction log, so this parses the format
directly: a 7-byte file header (``:W&B``, a 2-byte key, a version byte), then LevelDB-log
framing in 32 KiB blocks (per chunk: crc32 (4 bytes), length (2, little endian), type (1):
1 = full, 2 = first, 3 = middle, 4 = last), each record a ``wandb_internal_pb2.Record``.
"""

import json
import struct
import time
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = 7


def read_records(path):
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _HEADER:  # block trailer padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:  # zero padding to the block end
            pos += room
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def history(path):
    """Returns ``[{"_step": int, key: value, ...}]``, one dict per logged step."""
    rows = []
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                   for item in record.history.item}
            rows.append(row)
    return rows


def config(path):
    """Returns the run's config as ``{key: value}`` (last update wins)."""
    out = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") in ("run", "config"):
            items = record.run.config.update if record.HasField("run") else record.config.update
            for item in items:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def wait_for_exit(path, timeout=60.0):
    """Waits until the log ends with the run's exit record.

    ``run.finish()`` can return before wandb-core has written the tail of the log (seen on a
    loaded machine), so readers poll for the final ``exit`` record instead of sleeping.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            kinds = [r.WhichOneof("record_type") for r in read_records(path)]
        except Exception:  # noqa: BLE001 - a partly written chunk; read again
            kinds = []
        if "exit" in kinds:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} has no exit record after {timeout} s: {kinds}")
        time.sleep(0.1)
