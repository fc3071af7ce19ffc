"""The built-in demo, as the `rlbolt demo` command uses it: its settings (`rlbolt.config.demo`)
and its task and module (`rlbolt.modules.digits`), re-exported here for the command and old
imports."""

from rlbolt.config.demo import TASKS, DemoConfig, DemoConfigError  # noqa: F401 - re-exported
from rlbolt.modules.digits import DIGITS, DigitsGRPO, demo_rows, position_rewards  # noqa: F401 - re-exported
