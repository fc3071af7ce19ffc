"""Reading a GGUF file (llama.cpp's format) with the `gguf` package: the file, its metadata.

Shared by the model reader (`rlbolt.models.gguf_io`) and the tokenizer reader
(`rlbolt.data.gguf_tokenizer`); the `gguf` package is the `rlbolt[gguf]` extra.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

__all__ = ["gguf_field", "gguf_module", "is_gguf_path", "open_gguf"]


def is_gguf_path(path: str | os.PathLike | None) -> bool:
    """Whether `path` names a GGUF file (by its `.gguf` suffix, any case)."""
    return path is not None and str(path).lower().endswith(".gguf")


def gguf_module():
    """The `gguf` package (llama.cpp's reader), or an ImportError naming the extra that installs it."""
    try:
        import gguf
    except ImportError:
        raise ImportError("reading a .gguf file needs the gguf package: pip install 'rlbolt[gguf]'") from None
    return gguf


@functools.lru_cache(maxsize=2)
def _reader(path: str, mtime_ns: int, size: int):
    # Parsing the metadata is the slow part of opening (the reader makes a NumPy view per token
    # string: ~13 s for a 49k vocabulary on a busy CPU), and a run opens its file several times
    # (config check, tokenizer, weights): the same unchanged file is parsed once per process.
    return gguf_module().GGUFReader(path)


def open_gguf(path: str | os.PathLike) -> Any:
    """Opens a GGUF file with the `gguf` package's reader (memory-mapped: tensors are read on use).

    The reader of an unchanged file (same path, size and modification time) is reused.

    Args:
        path: the `.gguf` file.

    Returns:
        A `gguf.GGUFReader`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is not a readable GGUF file.
    """
    gguf_module()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    stat = path.stat()
    try:
        return _reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    except Exception as error:  # the reader raises ValueError, struct errors, IndexError... on bad files
        raise ValueError(f"{path} is not a readable GGUF file (truncated, corrupt or not GGUF?): {error}") from error


def gguf_field(reader, key: str, default: Any = None) -> Any:
    """The value of metadata `key` (a number, bool, string or list), or `default` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()
