"""The config fingerprint: every checkpoint records the run's resolved config, and a resume
compares it with the config it is about to continue with.

A field that changes the math of the next steps (the model, the batch plan, the algorithm, the
rollout, the reward, the data, the seeds, the trainer mode) must not change silently: a resume
with a different value is refused with a one-line diff (`algorithm.lr: 1e-06 -> 3e-06`) unless
the change is allowed explicitly (`rlbolt resume --allow-config-change`,
`ModelCheckpoint(allow_config_change=True)`); then the change and the step it took effect are
appended to `<run_dir>/config_changes.jsonl`. Fields that only say how long to run, where to log
or how often to checkpoint (`FREE_FIELDS`) change freely. A field not listed counts as math:
an unknown field is refused rather than ignored.

What is recorded: a CLI run records its resolved config (`{section: {key: value}}`, the
content of config.yaml); a Python-API run records the Trainer's settings, the BatchPlan, and the
module's class and its card's `hparams` (`config_record`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlbolt.utils.files import to_plain

CHANGES_FILE = "config_changes.jsonl"

# Dotted keys (a trailing "." covers a whole section) whose changes do not change the math.
FREE_FIELDS = (
    "trainer.max_steps", "trainer.max_epochs", "trainer.val_every_n_steps", "trainer.val_batch_size",
    "trainer.run_dir", "trainer.prefetch_timeout_s", "trainer.val_at_start",
    "callbacks.",                                            # checkpoint cadence, logging, progress bar
    "data.val", "data.builtin_val_rows", "rollout.val_temperature", "rollout.val_num_samples",  # validation only
    "demo.max_steps", "demo.checkpoint_every",
    "model.logits_chunk_tokens", "model.remat", "model.scan_layers", "model.attention",  # memory/compile vs speed: same math to float32 rounding
    "plan.packing", "plan.packed_row_tokens", "plan.packed_rows",  # padded or packed rows: same math to float32 rounding
)
TRAINER_FIELDS = ("seed", "data_seed", "shuffle", "mode", "max_staleness", "max_steps", "max_epochs",
                  "val_every_n_steps", "val_batch_size")


class ConfigChanged(ValueError):
    """A resume would continue with different math-changing settings (one line with the diff)."""


def config_record(run: Any, explicit: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The config a checkpoint records: `explicit` (a CLI run's resolved config) or, for a
    Python-API run, the Trainer's settings (`RunInfo.settings`), the BatchPlan and the module's
    class and its card's hparams (None without a card)."""
    if explicit is not None:
        return to_plain(explicit)
    out: dict[str, Any] = {"trainer": {f: run.settings[f] for f in TRAINER_FIELDS if f in run.settings}}
    if dataclasses.is_dataclass(run.plan):
        out["plan"] = dataclasses.asdict(run.plan)
    module = run.module
    if module is not None:
        hparams = run.card.hparams if run.card is not None else None
        out["module"] = {"class": f"{type(module).__module__}.{type(module).__qualname__}",
                         "hparams": dict(hparams) if isinstance(hparams, Mapping) else None}
    return json.loads(json.dumps(to_plain(out), default=repr))  # JSON-safe, as it will read back


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings -> {"section.key.sub": value} (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def is_free(key: str) -> bool:
    """Whether a dotted config key may change at resume without an explicit override."""
    return any(key == f or (f.endswith(".") and key.startswith(f)) for f in FREE_FIELDS)


_ABSENT = object()


def math_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The math-changing differences `[(key, saved value, current value)]`, sorted by key
    (`_ABSENT` stands for a key only one side has)."""
    old, new = flatten(saved), flatten(current)
    keys = sorted(set(old) | set(new))
    return [(k, old.get(k, _ABSENT), new.get(k, _ABSENT)) for k in keys
            if not is_free(k) and not _same(old.get(k, _ABSENT), new.get(k, _ABSENT))]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _fmt(value: Any) -> str:
    return "(absent)" if value is _ABSENT else repr(value)


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    """`algorithm.lr: 1e-06 -> 3e-06, plan.prompts_per_step: 4 -> 8` (one line)."""
    return ", ".join(f"{k}: {_fmt(a)} -> {_fmt(b)}" for k, a, b in changes)


def check(saved: Mapping[str, Any] | None, current: Mapping[str, Any], *, step: int, allow: bool,
          directory: Path) -> list[tuple[str, Any, Any]]:
    """Compares a checkpoint's recorded config with the current one.

    Args:
      saved: the checkpoint's `config` (None: written without one, nothing to compare).
      current: the config of the run that resumes.
      step: the checkpoint's step (for the message).
      allow: accept math-changing differences (they are returned, for `record_changes`).
      directory: the checkpoint folder (for the message).

    Returns:
      The accepted math-changing changes ([] when none).

    Raises:
      ConfigChanged: a math-changing field differs and `allow` is False.
    """
    if saved is None:
        return []
    changes = math_changes(saved, current)
    if changes and not allow:
        raise ConfigChanged(
            f"the run's config differs from the one checkpoint step {step} in {directory} was trained with: "
            f"{describe(changes)}; to continue with the new values pass --allow-config-change (Python: "
            "ModelCheckpoint(allow_config_change=True)) and the change is recorded, or restore the old values")
    return changes


def record_changes(run_dir: str | Path, step: int, changes: list[tuple[str, Any, Any]]) -> Path:
    """Appends `{"step", "time", "changes": {key: [old, new]}}` to `<run_dir>/config_changes.jsonl`."""
    path = Path(run_dir) / CHANGES_FILE
    line = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "changes": {k: [None if a is _ABSENT else a, None if b is _ABSENT else b] for k, a, b in changes}}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, default=repr) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return path
