"""Metric writers behind CLU's ``MetricWriter`` interface (console, jsonl, TensorBoard, W&B).

``clu.metric_writers`` needs TensorFlow, so rlbolt keeps CLU's method names and signatures
(``write_scalars``, ``write_texts``, ``write_hparams``, ``flush``, ``close``) in its own
``MetricWriter`` and implements the backends without TensorFlow. Consumers call only those
methods, so a CLU writer (when TensorFlow is installed) plugs in unchanged, e.g.
``MultiWriter([JsonlWriter(path), clu.metric_writers.SummaryWriter(logdir)])``.
"""

from rlbolt.loggers.async_writer import AsyncWriter
from rlbolt.loggers.console import DEFAULT_CONSOLE_KEYS, ConsoleWriter
from rlbolt.loggers.factory import create_default_writer
from rlbolt.loggers.interface import MetricWriter, MultiWriter, NullWriter, flatten_hparams, scalar_to_float
from rlbolt.loggers.jsonl import JsonlWriter, read_jsonl
from rlbolt.loggers.naming import namespaced, normalize_name
from rlbolt.loggers.tensorboard import TensorBoardWriter
from rlbolt.loggers.wandb_writer import WandbWriter

__all__ = [
    "AsyncWriter",
    "ConsoleWriter",
    "DEFAULT_CONSOLE_KEYS",
    "JsonlWriter",
    "MetricWriter",
    "MultiWriter",
    "NullWriter",
    "TensorBoardWriter",
    "WandbWriter",
    "create_default_writer",
    "flatten_hparams",
    "namespaced",
    "normalize_name",
    "read_jsonl",
    "scalar_to_float",
]
