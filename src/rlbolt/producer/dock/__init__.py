"""The ExperienceDock: a column store between pipeline stages (MindSpeed-RL's TransferDock idea).

    from rlbolt.producer.dock import ExperienceDock
    dock = ExperienceDock({"logps": ("completion_ids",), "train": ("completion_ids", "old_logps")})

`store.py` holds the dock (the registry of samples and batches, waiting, the calls);
`columns.py` the rows of each column (a lock per column); `queues.py` each stage's untaken
samples, lock and counters; `selection.py` the pure rules of what a `get` takes (whole groups,
up to n) and how a consumer orders what it took (`balanced`: micro batches of equal length).
"""

from rlbolt.producer.dock.selection import DockError, balanced, balanced_order
from rlbolt.producer.dock.queues import StageStats
from rlbolt.producer.dock.store import DockClosed, ExperienceDock, Taken

__all__ = ["DockClosed", "DockError", "ExperienceDock", "StageStats", "Taken", "balanced", "balanced_order"]
