"""Built-in callbacks, installed as ``rlbolt.callbacks``; the base class `Callback`, `CallbackList`
and `Periodic` (defined in `rlbolt.callback`) are importable from here too."""

from rlbolt.callback import Callback, CallbackList, Periodic

from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.callbacks.nan_guard import NaNGuard, NonFiniteError
from rlbolt.callbacks.metrics import MetricsLogger
from rlbolt.callbacks.progress import ProgressBar
from rlbolt.callbacks.offload import CPUOffload
from rlbolt.callbacks.evaluation import Evaluation
from rlbolt.callbacks.early_stopping import EarlyStopping
from rlbolt.callbacks.lr_monitor import LearningRateMonitor
from rlbolt.callbacks.throughput import Throughput
from rlbolt.callbacks.hf_export import HFExport
from rlbolt.callbacks.timeline import TimelineLogger

__all__ = ["CPUOffload", "Callback", "CallbackList", "EarlyStopping", "Evaluation", "HFExport", "LearningRateMonitor",
           "MetricsLogger", "ModelCheckpoint", "NaNGuard", "NonFiniteError", "Periodic", "ProgressBar", "Throughput",
           "TimelineLogger"]
