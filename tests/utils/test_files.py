"""`rlbolt.utils.files`: what counts as a full disk, and byte counts for people."""

from __future__ import annotations

import errno

import pytest

from rlbolt.utils.files import format_size, is_disk_full


def chained(outer: BaseException, inner: BaseException, *, cause: bool) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            if cause:
                raise outer from exc
            raise outer
    except BaseException as exc:  # noqa: BLE001
        return exc


@pytest.mark.parametrize("error, full", [
    (OSError(errno.ENOSPC, "No space left on device"), True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
    (OSError(errno.EACCES, "Permission denied"), False),
    (ValueError("TensorStore: os_error_code='28' writing chunk"), True),  # TensorStore: text only
    (ValueError("os_error_code='280'"), False),
    (RuntimeError("failed to save"), False),
    (None, False),
])
def test_full_disk_by_errno_or_text(error, full):
    assert is_disk_full(error) is full


def test_a_full_disk_anywhere_in_the_chain_counts_and_a_cycle_ends():
    inner = OSError(errno.ENOSPC, "No space left on device")
    assert is_disk_full(chained(RuntimeError("save failed"), inner, cause=True))
    assert is_disk_full(chained(RuntimeError("while handling"), inner, cause=False))
    a, b = RuntimeError("a"), RuntimeError("b")
    a.__cause__, b.__cause__ = b, a  # a cycle: the walk stops
    assert not is_disk_full(a)


@pytest.mark.parametrize("n, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KB"), (1536, "1.5 KB"),
                                     (3 * 2 ** 20, "3.0 MB"), (5 * 2 ** 30, "5.0 GB"), (3 * 2 ** 40, "3.0 TB"),
                                     (2 ** 60, "1048576.0 TB")])
def test_format_size(n, text):
    assert format_size(n) == text
