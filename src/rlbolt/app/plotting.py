"""PNG charts of a run's `metrics.jsonl` (matplotlib, Agg backend: no display needed).

One figure per topic; a topic whose metrics the run never logged is skipped, not drawn empty:

    reward.png           reward/mean with a +-reward/std band
    kl.png               every metric whose name contains "kl"
    entropy.png          every metric whose name contains "entropy"
    response_length.png  response_length/mean and /max
    stage_times.png      time/rollout, time/logps, time/reward, time/update, time/data_wait stacked
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlbolt.loggers.jsonl import read_jsonl

STAGE_KEYS = ("time/rollout", "time/logps", "time/reward", "time/update", "time/data_wait")
TOPICS = ("reward", "kl", "entropy", "response_length", "stage_times")


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (one dict per step, resumed steps merged), sorted by step.

    Raises:
      FileNotFoundError: naming the file when it does not exist.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a run writes it when MetricsLogger has the jsonl writer")
    return read_jsonl(path)


def series(records: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps [K], values [K]) of the records that hold `key`."""
    rows = [(r["step"], float(r[key])) for r in records if key in r]
    if not rows:
        return np.zeros(0, int), np.zeros(0)
    steps, values = zip(*rows)
    return np.asarray(steps), np.asarray(values, np.float64)


def _keys_matching(records: Sequence[dict[str, Any]], predicate: Callable[[str], bool]) -> list[str]:
    return sorted({k for r in records for k in r if k != "step" and predicate(k)})


def _draw_reward(ax, records) -> bool:
    steps, mean = series(records, "reward/mean")
    if not len(steps):
        return False
    ax.plot(steps, mean, label="reward/mean")
    std_steps, std = series(records, "reward/std")
    if len(std_steps) == len(steps):
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2, label="+- reward/std")
    val_steps, val = series(records, "val/reward")
    if len(val_steps):
        ax.plot(val_steps, val, "o-", label="val/reward")
    ax.set_ylabel("reward")
    return True


def _draw_lines(keys_of: Callable[[Sequence[dict]], list[str]]) -> Callable:
    def draw(ax, records) -> bool:
        keys = keys_of(records)
        for key in keys:
            ax.plot(*series(records, key), label=key)
        return bool(keys)

    return draw


def _draw_stages(ax, records) -> bool:
    keys = [k for k in STAGE_KEYS if len(series(records, k)[0])]
    if not keys:
        return False
    steps = np.asarray([r["step"] for r in records if all(k in r for k in keys)])
    values = [np.asarray([float(r[k]) for r in records if all(k in r for k in keys)]) for k in keys]
    ax.stackplot(steps, *values, labels=keys)
    ax.set_ylabel("seconds per step")
    return True


_DRAWERS: dict[str, Callable] = {
    "reward": _draw_reward,
    "kl": _draw_lines(lambda rs: _keys_matching(rs, lambda k: "kl" in k.split("/")[-1] or k.startswith("kl"))),
    "entropy": _draw_lines(lambda rs: _keys_matching(rs, lambda k: "entropy" in k)),
    "response_length": _draw_lines(lambda rs: [k for k in ("response_length/mean", "response_length/max")
                                               if len(series(rs, k)[0])]),
    "stage_times": _draw_stages,
}


def plot_metrics(metrics_path: str | Path, out_dir: str | Path, topics: Sequence[str] = TOPICS) -> dict[str, Path]:
    """Writes one PNG per topic that has data.

    Args:
      metrics_path: a metrics.jsonl.
      out_dir: where the PNGs go (created).
      topics: any of TOPICS.

    Returns:
      {topic: png path} for the topics drawn (topics without data are left out).
    """
    unknown = [t for t in topics if t not in _DRAWERS]
    if unknown:
        raise ValueError(f"unknown plot topic(s) {unknown}; choose from {list(TOPICS)}")
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: headless servers and CI have no display
    import matplotlib.pyplot as plt

    records = load_metrics(metrics_path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for topic in topics:
        fig, ax = plt.subplots(figsize=(7, 4))
        try:
            if not _DRAWERS[topic](ax, records):
                continue
            ax.set_xlabel("step")
            ax.set_title(topic.replace("_", " "))
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize="small")
            fig.tight_layout()
            path = out_dir / f"{topic}.png"
            partial = out_dir / f".{topic}.png.tmp"  # renamed into place: a reader never sees half a PNG
            fig.savefig(partial, dpi=100, format="png")
            os.replace(partial, path)
            written[topic] = path
        finally:
            plt.close(fig)
    return written
