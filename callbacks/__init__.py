"""Built-in callbacks, installed as ``rlbolt.callbacks``."""

from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.callbacks.nan_guard import NaNGuard, NonFiniteError
from rlbolt.callbacks.metrics import MetricsLogger
from rlbolt.callbacks.progress import ProgressBar
