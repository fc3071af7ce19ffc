"""Moved to `rlbolt.config` (below the modules, which read their sections from it); this name
keeps old imports working."""

from rlbolt.config import *  # noqa: F401,F403
from rlbolt.config import __all__  # noqa: F401
from rlbolt.config.algorithms import algorithm_names as _names


def __getattr__(name):
    if name == "ALGORITHMS":  # the registered algorithm names (a user's registered subclass included)
        return _names()
    raise AttributeError(name)
