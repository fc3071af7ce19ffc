"""The built-in demo, re-exported for old imports: it is `rlbolt.demo` (settings, tasks, the
digit module, the episode tasks' training)."""

from rlbolt.demo.config import DemoConfig, DemoConfigError  # noqa: F401 - re-exported
from rlbolt.demo.digits import DIGITS, DigitsGRPO, demo_rows, position_rewards  # noqa: F401 - re-exported
