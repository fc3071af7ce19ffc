"""The ExperienceDock: a column store between pipeline stages (MindSpeed-RL's TransferDock idea).

    from rlbolt.dock import ExperienceDock
    dock = ExperienceDock({"logps": ("completion_ids",), "train": ("completion_ids", "old_logps")})

`store.py` holds the dock (locking, waiting, counters); `selection.py` the pure rules of what a
`get` takes (whole groups, up to n) and how it orders them (balanced micro-batch lengths).
"""

from rlbolt.dock.selection import DockError, balanced_order
from rlbolt.dock.store import DockClosed, ExperienceDock, StageStats, Taken

__all__ = ["DockClosed", "DockError", "ExperienceDock", "StageStats", "Taken", "balanced_order"]
