"""What crosses the wire between a `DockServer` and a `RemoteDock`: columns as Arrow record
batches, batch keys and call arguments as JSON, errors as a type name and their one line.

A column travels as one Arrow field per column: numbers (int, uint, float of native byte order)
as their own Arrow type, a row of rank > 1 as a fixed-size list of its flattened values; any
other fixed-size dtype (bool, bfloat16 and the other ml_dtypes, fixed-width str/bytes,
datetime, non-native byte order) as its raw bytes (uint8); an object column as Arrow strings
(str or None). The field's metadata holds the NumPy dtype and the row shape, so a column comes
back with exactly its dtype, shape and bits. Numbers and raw bytes are not copied on either side
(the received arrays are read-only views of the Arrow buffers: a stage adds columns, it never
rewrites one).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. as NumPy dtype names)
import numpy as np
import pyarrow as pa

from rlbolt.producer.dock.selection import DockError
from rlbolt.producer.dock.store import DockClosed

_DTYPE, _SHAPE = b"rlbolt.dtype", b"rlbolt.shape"
_NATIVE_KINDS = "iuf"
MAX_MESSAGE_BYTES = 64 << 20  # rows per Flight message: far below gRPC's 2 GiB limit, few messages


def dtype_code(dtype: np.dtype, name: str, what: str) -> str:
    """The string that names `dtype` on the wire (NumPy's `str`, or the ml_dtypes name)."""
    if dtype.fields is not None:
        raise DockError(f"{what}: column {name!r} has a structured dtype {dtype}; "
                        "write each field as its own column to cross processes")
    code = dtype.name if dtype.kind == "V" else dtype.str
    try:
        same = np.dtype(code) == dtype
    except TypeError:
        same = False
    if not same:
        raise DockError(f"{what}: column {name!r} has dtype {dtype} which has no name NumPy can rebuild; "
                        "convert it to a numeric, bool, str or ml_dtypes dtype")
    return code


def to_record_batch(arrays: Mapping[str, np.ndarray], what: str) -> pa.RecordBatch:
    """Columns (equal leading sizes, checked by the caller) as one Arrow record batch."""
    fields, values = [], []
    for name, arr in arrays.items():
        array, meta = _column_to_arrow(name, arr, what)
        nullable = arr.dtype.kind == "O" or array.type == pa.null()
        fields.append(pa.field(name, array.type, nullable=nullable, metadata=meta))
        values.append(array)
    return pa.RecordBatch.from_arrays(values, schema=pa.schema(fields))


def messages(batch: pa.RecordBatch) -> list[pa.RecordBatch]:
    """The batch cut by rows into messages of at most about `MAX_MESSAGE_BYTES` (views)."""
    if batch.num_rows == 0:
        return [batch]
    per_row = max(1, batch.nbytes // batch.num_rows)
    rows = max(1, MAX_MESSAGE_BYTES // per_row)
    return [batch.slice(start, rows) for start in range(0, batch.num_rows, rows)]


def from_table(table: pa.Table | pa.RecordBatch) -> dict[str, np.ndarray]:
    """The columns of a received table or record batch, with their dtypes and shapes."""
    out = {}
    for i, field in enumerate(table.schema):
        column = table.column(i)
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        out[field.name] = _column_from_arrow(column, field.metadata, table.num_rows)
    return out


def _column_to_arrow(name: str, arr: np.ndarray, what: str) -> tuple[pa.Array, dict[bytes, bytes]]:
    dtype = arr.dtype
    shape = arr.shape[1:]
    row = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "O":
        flat = arr.reshape(-1).tolist()
        odd = next((v for v in flat if v is not None and not isinstance(v, str)), None)
        if odd is not None:
            raise DockError(f"{what}: column {name!r} holds a {type(odd).__name__} among its objects; across "
                            "processes an object column may hold only str (or None)")
        values, code = pa.array(flat, pa.string()), "object"
    else:
        code = dtype_code(dtype, name, what)
        flat = np.ascontiguousarray(arr).reshape(-1)
        if dtype.kind in _NATIVE_KINDS and dtype.isnative:
            values = pa.array(flat)
        else:
            values, row = pa.array(flat.view(np.uint8)), row * dtype.itemsize
    if row == 0:  # rows of no elements: only their count travels
        array = pa.nulls(len(arr))
    else:
        array = values if row == 1 else pa.FixedSizeListArray.from_arrays(values, row)
    meta = {_DTYPE: code.encode(), _SHAPE: json.dumps(list(shape)).encode()}
    return array, meta


def _column_from_arrow(column: pa.Array, meta: Mapping[bytes, bytes], n: int) -> np.ndarray:
    code = meta[_DTYPE].decode()
    shape = tuple(json.loads(meta[_SHAPE]))
    if column.type == pa.null():
        return np.empty((n, *shape), object if code == "object" else np.dtype(code))
    values = column.flatten() if isinstance(column, pa.FixedSizeListArray) else column
    if code == "object":
        out = np.empty(len(values), object)
        out[:] = values.to_pylist()
        return out.reshape((n, *shape))
    dtype = np.dtype(code)
    flat = values.to_numpy(zero_copy_only=False)
    if flat.dtype != dtype:  # raw bytes
        flat = flat.view(dtype)
    return flat.reshape((n, *shape))


def key_to_json(key: Any, what: str) -> Any:
    """A batch key as JSON (tuples tagged so they come back as tuples)."""
    if key is None or isinstance(key, (bool, str)):
        return key
    if isinstance(key, (int, np.integer)):
        return int(key)
    if isinstance(key, (float, np.floating)):
        return float(key)
    if isinstance(key, tuple):
        return {"tuple": [key_to_json(k, what) for k in key]}
    raise DockError(f"{what}: key {key!r} of type {type(key).__name__} cannot cross processes; "
                    "use an int, str, float, None or a tuple of them")


def key_from_json(value: Any) -> Any:
    """The inverse of `key_to_json`."""
    if isinstance(value, dict):
        return tuple(key_from_json(v) for v in value["tuple"])
    return value


def dumps(obj: Any) -> bytes:
    """JSON bytes of a call's arguments or reply."""
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes | pa.Buffer) -> Any:
    """The inverse of `dumps`."""
    return json.loads(bytes(data) if isinstance(data, pa.Buffer) else data)


ERRORS: dict[str, type[Exception]] = {"DockError": DockError, "DockClosed": DockClosed}


def error_reply(exc: BaseException) -> dict[str, str]:
    """An exception as a reply: its type name and its one line."""
    return {"error": type(exc).__name__, "message": str(exc)}


def raise_if_error(reply: Mapping[str, Any]) -> None:
    """Raises the error a reply carries, as the server raised it (same type, same line)."""
    if "error" not in reply:
        return
    kind = ERRORS.get(reply["error"])
    if kind is None:
        raise RuntimeError(f"the dock server failed: {reply['error']}: {reply['message']}")
    raise kind(reply["message"])
