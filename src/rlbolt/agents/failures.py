"""Environment failures during training: every error logged, and a broken environment stops the run.

An environment is user code: its `step` may raise or hang, its factory or `reset()` may raise.
`run_episodes` keeps a failing step inside its episode (end reason `env_error`, the text in
`EpisodeBatch.errors`), which is right for a rare failure and wrong for an environment that fails
every time: such a run would train on zero rewards, exit 0 and print nothing. `EnvErrorMonitor`
is what rewards have in `RewardRunner(max_failed_batches=)`:

- each distinct error text is logged once as a warning (train.log gets it), repeats at debug level;
- after `max_failed_batches` consecutive batches in which every episode ended with `env_error`
  it raises `EnvFailureError`, one line quoting the first error (0: never).

A factory or `reset()` that raises is a set-up bug, not an unlucky episode: `run_episodes` raises
`EnvFailureError` for it at once. The command line reports `EnvFailureError` in one line (exit 1).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

__all__ = ["EnvFailureError", "EnvErrorMonitor"]

logger = logging.getLogger("rlbolt.agents")


class EnvFailureError(RuntimeError):
    """The environment cannot run episodes: its factory or `reset()` raised, or every episode ended
    with an environment error in `rollout.env_max_failed_batches` consecutive batches."""


class EnvErrorMonitor:
    """Logs the environment errors of each batch of episodes and stops a run whose environment always fails.

    Args:
        max_failed_batches: raise `EnvFailureError` after this many consecutive batches in which
            every episode ended with an environment error; 0 never raises.
        field: the setting named in the error (`rollout.env_max_failed_batches`).
    """

    def __init__(self, max_failed_batches: int = 3, field: str = "rollout.env_max_failed_batches"):
        if not (isinstance(max_failed_batches, int) and not isinstance(max_failed_batches, bool)
                and max_failed_batches >= 0):
            raise ValueError(f"{field}={max_failed_batches!r} must be an int >= 0 (0: never stop)")
        self.max_failed_batches, self.field = max_failed_batches, field
        self.failed_batches = 0
        self._logged: set[str] = set()

    def log(self, errors: Mapping[int, str]) -> None:
        """Logs each distinct error text once as a warning (train.log and the terminal), repeats at debug level.

        Args:
            errors: `{episode index: error text}` (`EpisodeBatch.errors`).
        """
        for index, text in sorted(errors.items()):
            key = text.strip().splitlines()[0] if text.strip() else text
            if key in self._logged:
                logger.debug("environment error in episode %d: %s", index, key)
                continue
            self._logged.add(key)
            logger.warning("environment error in episode %d (the episode ends; further identical errors are logged "
                           "at debug level): %s", index, text)

    def record(self, num_episodes: int, errors: Mapping[int, str]) -> None:
        """Logs `errors` and counts the batch.

        Args:
            num_episodes: the batch's episodes.
            errors: `{episode index: error text}` (`EpisodeBatch.errors`).

        Raises:
            EnvFailureError: every episode failed, `max_failed_batches` batches in a row.
        """
        self.log(errors)
        all_failed = num_episodes > 0 and len(errors) == num_episodes
        self.failed_batches = self.failed_batches + 1 if all_failed else 0
        if not self.max_failed_batches or self.failed_batches < self.max_failed_batches:
            return
        first = errors[min(errors)].strip().splitlines()[0]
        self.failed_batches = 0
        message = (f"every episode ended with an environment error in {self.max_failed_batches} consecutive batches "
                   f"({self.field}={self.max_failed_batches}), so training would only see zero rewards: {first}. Fix "
                   f"the environment (every error is in train.log), or set {self.field}=0 to train on regardless")
        logger.error("%s", message, extra={"console": False})  # train.log says why the run stopped
        raise EnvFailureError(message)
