"""Small file helpers shared by everything that writes run artefacts.

A file a reader may open at any moment (config.yaml, hparams.json, best.json) is written whole
to a temporary sibling and renamed into place, so a kill never leaves half a file.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Writes `text` to `path` via `<path>.tmp` and a rename; parent folders are created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def default_file_mode() -> int:
    """The mode `open()` gives a new file: 0o666 without the process's umask bits. Writers that
    create files with a fixed private mode (safetensors uses 0600) are set to this afterwards,
    so every file of a run or an export has the same permissions."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            mask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)  # no /proc: read it by setting it (and put it back at once)
        os.umask(mask)
    return 0o666 & ~mask


def to_plain(value: Any) -> Any:
    """Mappings -> dicts with string keys, tuples/lists -> lists, recursively (YAML/JSON-safe)."""
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value


def replace_folder(staging: Path, folder: Path) -> None:
    """Puts a finished `staging` folder at `folder`, replacing any folder there. A directory rename
    cannot replace a non-empty directory, so the old one is moved aside first and removed after."""
    retired = None
    if folder.exists():
        retired = folder.parent / f".{folder.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(folder, retired)
    os.replace(staging, folder)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


_FULL = (errno.ENOSPC, errno.EDQUOT)


def exception_chain(error: BaseException | None):
    """`error`, then its cause (or the exception it was raised while handling), and so on; a
    cycle ends the walk."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether a full disk (ENOSPC, or EDQUOT: a quota) caused `exc`, anywhere in its chain of
    causes; TensorStore reports it as text only (``os_error_code='28'``)."""
    for error in exception_chain(exc):
        text = str(error)
        if (isinstance(error, OSError) and error.errno in _FULL) or "No space left on device" in text \
                or "Disk quota exceeded" in text or any(f"os_error_code='{code}'" in text for code in _FULL):
            return True
    return False


def format_size(n: float) -> str:
    """A byte count for people: ``512 B``, ``1.5 MB``, ``3.2 GB``, ``1.1 TB``."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB", "TB"):
        n /= 1024
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}"
