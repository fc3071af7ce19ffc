"""A Gantt chart of a run's `timeline.jsonl`: one row per stage, one bar per stage call.

Bars are coloured by step and labelled with it where they are wide enough, so overlap (bars of
different steps at the same time in different rows), bubbles (gaps in a row) and the slowest
stage (the row label with the largest busy share, in bold) are visible at a glance. Only the
newest run in the file is drawn (a resumed run appends its own), and by default its last few
steps, where the pipeline is warm.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlbolt.timeline import read_timeline

ROWS = ("rollout", "logps", "reward", "advantage", "update", "validate")
LABELS = {"advantage": "reward/advantage"}


def select_events(events: Sequence[dict[str, Any]], last_steps: int | None) -> list[dict[str, Any]]:
    """The newest run's events (by their `run` stamp), limited to its last `last_steps` steps."""
    if not events:
        return []
    newest = max(events, key=lambda e: e.get("run", 0.0)).get("run", 0.0)
    events = [e for e in events if e.get("run", 0.0) == newest]
    if last_steps is not None:
        steps = sorted({e["step"] for e in events})
        first = steps[-last_steps] if len(steps) >= last_steps else steps[0]
        events = [e for e in events if e["step"] >= first]
    return events


def busy_seconds(events: Sequence[dict[str, Any]]) -> float:
    """Length of the union of the events' [start, end] intervals (overlapping calls count once)."""
    total, end = 0.0, float("-inf")
    for e in sorted(events, key=lambda e: e["start"]):
        start = max(e["start"], end)
        if e["end"] > start:
            total += e["end"] - start
        end = max(end, e["end"])
    return total


def plot_timeline(timeline_path: str | Path, out_path: str | Path, *, last_steps: int | None = 6) -> Path | None:
    """Draws the Gantt chart to a PNG.

    Args:
      timeline_path: a timeline.jsonl.
      out_path: the PNG to write (its folder is created).
      last_steps: draw only the newest run's last this many steps (None: all of them).

    Returns:
      The PNG's path, or None when the file holds no events.
    """
    events = select_events(read_timeline(timeline_path), last_steps)
    if not events:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - origin
    rows = [r for r in ROWS if any(e["stage"] == r for e in events)]
    rows += sorted({e["stage"] for e in events} - set(rows))
    busy = {r: busy_seconds([e for e in events if e["stage"] == r]) for r in rows}
    slowest = max(busy, key=busy.get)
    colors = plt.get_cmap("tab10").colors
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * len(rows)))
    try:
        for y, row in enumerate(reversed(rows)):
            for e in (e for e in events if e["stage"] == row):
                x, w = e["start"] - origin, max(e["end"] - e["start"], span * 1e-4)
                ax.broken_barh([(x, w)], (y - 0.38, 0.76), facecolors=colors[e["step"] % len(colors)],
                               edgecolors="white", linewidth=0.5)
                if w > span * 0.025:
                    ax.text(x + w / 2, y, str(e["step"]), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([f"{LABELS.get(r, r)}  {busy[r] / span:.0%}" if span > 0 else r for r in reversed(rows)])
        for label, row in zip(ax.get_yticklabels(), reversed(rows)):
            label.set_fontweight("bold" if row == slowest else "normal")
        steps = sorted({e["step"] for e in events})
        ax.set_xlim(0, span * 1.01 if span > 0 else 1)
        ax.set_xlabel("seconds")
        ax.set_title(f"timeline of steps {steps[0]}-{steps[-1]} (bars: stage calls, labelled by step; % busy); "
                     f"busiest: {LABELS.get(slowest, slowest)}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        fig.tight_layout()
        out_path = Path(out_path)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out_path, dpi=100)
    finally:
        plt.close(fig)
    return out_path
