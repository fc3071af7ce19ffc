"""A stand-in for the Trainer's side of callback hooks, for tests that drive callbacks by hand:
the `RunInfo` the hooks receive, over a CallbackList and a WeightStore, and the Trainer's
application of what `on_restore` returns."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlbolt.callback import CallbackList
from rlbolt.producer.weights import WeightStore
from rlbolt.run_info import Restore, RunInfo


class FakeFit:
    """`run` is what the hooks get; `restore(state)` dispatches `on_restore` and applies it as fit does."""

    def __init__(self, run_dir: Path, callbacks=(), *, lag: int = 0, mode: str = "sync", module: Any = None,
                 card: Any = None, settings: dict | None = None, plan: Any = None, is_main_process: bool = True):
        self.callbacks = CallbackList(callbacks)
        self.weights = WeightStore(lag)
        self.run = RunInfo(run_dir=Path(run_dir), plan=plan, mode=mode, lag_steps=lag, module=module, card=card,
                           settings={"mode": mode, **(settings or {})}, is_main_process=is_main_process, callbacks=tuple(self.callbacks),
                           retained_weights=self.weights.retained, callback_states=self.callbacks.state_dict)

    def restore(self, state):
        return self.callbacks.on_restore(self.run, state, apply=self.apply)

    def apply(self, restore: Restore):
        return restore.apply(self.callbacks, self.weights)

    def restore_with(self, callback, state):
        """`callback.on_restore` (a callback outside `callbacks` too), applied as fit does: the state
        it restored, or None when it restored nothing."""
        if callback is self.callbacks:
            return self.restore(state)
        result = callback.on_restore(self.run, state)
        return self.apply(result) if isinstance(result, Restore) else result
