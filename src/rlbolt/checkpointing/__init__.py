"""Checkpoint I/O: a library the `ModelCheckpoint` callback and the `rlbolt` command (resume,
export) both use.

    io.py            CheckpointIO: Orbax save / restore of a TrainState, the restore fallback to
                     the previous usable step, pruning, read-only readers
    meta.py          the metadata saved beside the arrays and its validation (progress counters,
                     the frozen base's identity)
    integrity.py     per-array checksums and finiteness, verified at restore
    config_guard.py  the run's config fingerprint: math-changing differences refused at resume
"""

from rlbolt.checkpointing.integrity import CheckpointCorrupt
from rlbolt.checkpointing.io import CheckpointIO, CheckpointWriteError, NoUsableCheckpoint

__all__ = ["CheckpointCorrupt", "CheckpointIO", "CheckpointWriteError", "NoUsableCheckpoint"]
