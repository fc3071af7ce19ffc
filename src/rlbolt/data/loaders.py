"""Reading prompt rows from local files: JSON Lines, JSON and Parquet.

Rows come back as plain dicts. `rename` maps a file's field names to the ones a run expects
(`{"problem": "question", "solution": "answer"}`), and `required` names the fields every row
must have after renaming, and `check` is called on every row (e.g. "is the prompt text the
tokenizer can encode?"); a bad row is an error that names the file and its line (JSON Lines,
JSON) or row index (Parquet) and the fix, so a 7,000-row file with one broken line is fixed in
one go.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
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
    check: Callable[[Mapping[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Reads dict rows from a .jsonl, .json (a list of objects) or .parquet file.

    Args:
      path: the file.
      required: fields every row must have (after `rename`), e.g. ("question", "answer").
      rename: file field -> row field, applied to every row before the check.
      limit: read at most this many rows (None: all).
      check: called with every row after the `required` check; the ValueError, TypeError or
        KeyError it raises becomes a DataFileError naming the file and the row.

    Returns:
      The rows, in file order.

    Raises:
      DataFileError: the file is missing or has an unsupported suffix, a line is not UTF-8 or
        not a JSON object, a row lacks a required field (naming the file, the line and the
        fields present) or fails `check`, or Parquet is asked for without pyarrow installed.
    """
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise DataFileError(f"data file {path} {what}; give the path of a .jsonl, .json or .parquet file")
    suffix = path.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise DataFileError(f"data file {path} has suffix {path.suffix!r}; supported: {list(SUPPORTED_SUFFIXES)} "
                            "(convert it, e.g. pandas `df.to_json(path, orient='records', lines=True)` for .jsonl)")
    reader = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}[suffix]
    rows = []
    for where, row in reader(path, limit):
        if not isinstance(row, Mapping):
            raise DataFileError(f"{path} {where}: expected a JSON object (field -> value), got {type(row).__name__}; "
                                "each row is one {\"field\": value, ...} object")
        row = {(rename or {}).get(k, k): v for k, v in row.items()}
        missing = [f for f in required if f not in row]
        if missing:
            raise DataFileError(
                f"{path} {where}: missing field(s) {missing}; the row has {sorted(row)} "
                "(point data.prompt_field / data.answer_field at the file's own names)"
            )
        if check is not None:
            try:
                check(row)
            except (ValueError, TypeError, KeyError) as error:
                message = error.args[0] if isinstance(error, KeyError) and error.args else error
                raise DataFileError(f"{path} {where}: {message}") from None
        rows.append(row)
    if not rows:
        raise DataFileError(f"data file {path} holds no rows")
    return rows


def _read_jsonl(path: Path, limit: int | None):
    count = 0
    with path.open("rb") as handle:  # bytes, so a bad byte names its line
        for number, raw in enumerate(handle, start=1):
            if limit is not None and count >= limit:
                return
            line = _decode(raw, path, f"line {number}")
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                torn = " (a torn last line? the file may have been cut off while written)" if not raw.endswith(b"\n") else ""
                raise DataFileError(f"{path} line {number}: not valid JSON ({error.msg} at column {error.colno}){torn}; "
                                    "fix or remove that line") from None
            count += 1
            yield f"line {number}", row


def _read_json(path: Path, limit: int | None):
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        _decode(data.splitlines()[line - 1], path, f"line {line}")
        raise  # not reached: the line itself fails to decode
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise DataFileError(f"{path}: not valid JSON ({error.msg} at line {error.lineno}, column {error.colno}); "
                            "fix the file, or write one row object per line as .jsonl") from None
    if not isinstance(data, list):
        raise DataFileError(f"{path}: a .json data file must hold a list of row objects [{{...}}, ...], got "
                            f"{type(data).__name__}; wrap the rows in a list, or write one object per line as .jsonl")
    for index, row in enumerate(data[:limit] if limit is not None else data):
        yield f"row {index}", row


def _decode(raw: bytes, path: Path, where: str) -> str:
    try:
        return raw.decode("utf-8-sig")  # -sig: a leading byte-order mark (Windows editors) is dropped
    except UnicodeDecodeError as error:
        raise DataFileError(f"{path} {where}: not UTF-8 (byte 0x{raw[error.start]:02x} at byte {error.start + 1} of "
                            "the line); re-save the file as UTF-8") from None


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
