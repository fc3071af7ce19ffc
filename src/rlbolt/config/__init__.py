"""The run configuration: typed sections (`sections.py`), reading / resolving / writing
(`load.py`), field helpers (`fields.py`), the rules across fields (`rules.py`), the algorithm
registry (`algorithms.py`), the choices other registries hold (`registries.py`) and importable references to Python objects (`references.py`).

It sits below the modules and the application layer: a ready module reads its sections from
here, and the `rlbolt` command builds a run from them.
"""

from rlbolt.config.algorithms import GENERIC_DEFAULTS, algorithm_class, algorithm_names, register_algorithm
from rlbolt.config.fields import ConfigError
from rlbolt.config.load import config_to_dict, describe_fields, load_config, resolve, save_config
from rlbolt.config.sections import (
    LOSS_AGGREGATIONS,
    METRIC_WRITERS,
    SECTIONS,
    AlgorithmSection,
    CallbacksSection,
    DataSection,
    DistributedSection,
    MeshSection,
    ModelSection,
    ObjectsSection,
    PlanSection,
    RewardSection,
    RolloutSection,
    RunConfig,
    TrainerSection,
)

__all__ = [
    "GENERIC_DEFAULTS", "LOSS_AGGREGATIONS", "METRIC_WRITERS", "SECTIONS", "AlgorithmSection",
    "CallbacksSection", "ConfigError", "DataSection", "DistributedSection", "MeshSection", "ModelSection",
    "ObjectsSection", "PlanSection", "RewardSection", "RolloutSection", "RunConfig", "TrainerSection",
    "algorithm_class", "algorithm_names", "config_to_dict", "describe_fields", "load_config", "register_algorithm",
    "resolve", "save_config",
]
