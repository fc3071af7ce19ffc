"""Reading prompt rows from local files: JSON Lines, JSON and Parquet.

Rows come back as plain dicts. `rename` maps a file's field names to the ones a run expects
(`{"problem": "question", "solution": "answer"}`), and `required` names the fields every row
must have after renaming; a bad row is an error that names the file and its line (JSON Lines)
or index (JSON, Parquet), so a 7,000-row file with one broken line is fixed in one go.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")


class DataFileError(ValueError):
    """A data file is missing, unreadable, or holds a bad row; the message names file and row."""


def load_rows(
    path: str | Path,
    *,
    required: Sequence[str] = (),
    rename: Mapping[str, str] | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Reads dict rows from a .jsonl, .json (a list of objects) or .parquet file.

    Args:
      path: the file.
      required: fields every row must have (after `rename`), e.g. ("question", "answer").
      rename: file field -> row field, applied to every row before the check.
      limit: read at most this many rows (None: all).

    Returns:
      The rows, in file order.

    Raises:
      DataFileError: the file is missing or has an unsupported suffix, a line is not a JSON
        object, a row lacks a required field (naming the file, the line and the fields present),
        or Parquet is asked for without pyarrow installed.
    """
    path = Path(path)
    if not path.is_file():
        raise DataFileError(f"data file {path} does not exist; check data.train / data.val")
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataFileError(f"data file {path} has suffix {path.suffix!r}; supported: {list(SUPPORTED_SUFFIXES)}")
    reader = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}[suffix]
    rows = []
    for where, row in reader(path, limit):
        if not isinstance(row, Mapping):
            raise DataFileError(f"{path} {where}: expected a JSON object (field -> value), got {type(row).__name__}")
        row = {(rename or {}).get(k, k): v for k, v in row.items()}
        missing = [f for f in required if f not in row]
        if missing:
            raise DataFileError(
                f"{path} {where}: missing field(s) {missing}; the row has {sorted(row)} "
                "(point data.prompt_field / data.answer_field at the file's own names)"
            )
        rows.append(row)
    if not rows:
        raise DataFileError(f"data file {path} holds no rows")
    return rows


def _read_jsonl(path: Path, limit: int | None):
    count = 0
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataFileError(f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno})") from None
            count += 1
            yield f"line {number}", row


def _read_json(path: Path, limit: int | None):
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise DataFileError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}, column {error.colno})") from None
    if not isinstance(data, list):
        raise DataFileError(f"{path}: a .json data file must hold a list of row objects, got {type(data).__name__}")
    for index, row in enumerate(data[:limit] if limit is not None else data):
        yield f"row {index}", row


def _read_parquet(path: Path, limit: int | None):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataFileError(
            f"reading {path} needs pyarrow: `pip install pyarrow`, or convert the file to .jsonl"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises ArrowInvalid/OSError for corrupt files
        raise DataFileError(f"{path}: not a readable Parquet file ({error})") from None
    if limit is not None:
        table = table.slice(0, limit)
    for index, row in enumerate(table.to_pylist()):
        yield f"row {index}", row
