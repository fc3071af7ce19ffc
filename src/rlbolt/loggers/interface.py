"""The metric-writer interface: CLU's ``MetricWriter`` method names, without TensorFlow.

``clu.metric_writers`` imports TensorFlow at package import time, so rlbolt re-declares the
narrow part of its interface that training code uses: ``write_scalars``, ``write_texts``,
``write_hparams``, ``flush`` and ``close``, with CLU's names and signatures. Everything in
rlbolt that consumes a writer (``MultiWriter``, ``AsyncWriter``, ``MetricsLogger``) calls only
these five methods, so a writer from ``clu.metric_writers`` (when TensorFlow is installed) is
accepted unchanged: it is duck-typed, not checked with ``isinstance``.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["MetricWriter", "MultiWriter", "NullWriter", "flatten_hparams", "scalar_to_float"]


def scalar_to_float(name: str, value: Any) -> float:
    """Converts one metric value (Python, numpy or jax scalar) to a host ``float``.

    Args:
        name: the metric's name, used in the error message.
        value: a number, a 0-d or one-element array (numpy or jax; a jax array is copied to host).

    Returns:
        The value as a Python float (may be nan or inf).

    Raises:
        TypeError: if the value is not numeric.
        ValueError: if the value holds more than one element.
    """
    if isinstance(value, (float, int)) and not isinstance(value, bool):
        return float(value)
    try:
        array = np.asarray(value)
    except Exception as exc:  # pragma: no cover - exotic objects
        raise TypeError(f"metric {name!r}: cannot convert {type(value).__name__} to float") from exc
    if array.dtype.kind not in "biuf":
        raise TypeError(
                f"metric {name!r} has non-numeric value {value!r} (dtype {array.dtype}); "
                "write_scalars takes numbers; use write_texts for strings")
    if array.size != 1:
        raise ValueError(
                f"metric {name!r} has shape {array.shape}; write_scalars takes scalars; "
                "reduce it first (for example with .mean())")
    return float(array.reshape(()))


class MetricWriter(abc.ABC):
    """Where metrics go. Mirrors ``clu.metric_writers.interface.MetricWriter``.

    Subclasses must implement ``write_scalars``; the other methods default to no-ops so a writer
    only implements what its backend supports. Steps are integers (global steps completed).
    """

    @abc.abstractmethod
    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        """Writes scalar metrics for one step.

        Args:
            step: the global step the values belong to.
            scalars: metric name -> number (Python, numpy or jax scalar).
        """

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        """Writes text values (for example sample completions) for one step.

        Args:
            step: the global step the texts belong to.
            texts: name -> string.
        """
        del step, texts

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Records the run's hyperparameters once, at the start of a run.

        Args:
            hparams: name -> value; nested mappings are allowed (backends flatten them).
        """
        del hparams

    def flush(self) -> None:
        """Makes everything written so far durable or visible."""

    def close(self) -> None:
        """Flushes and releases resources; the writer must not be used afterwards."""
        self.flush()


class MultiWriter(MetricWriter):
    """Forwards every call to several writers, in order.

    Args:
        writers: the writers (rlbolt's or CLU's; any object with the five methods).
    """

    def __init__(self, writers: Sequence[Any]):
        self._writers = tuple(writers)

    @property
    def writers(self) -> tuple[Any, ...]:
        """The wrapped writers."""
        return self._writers

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        for writer in self._writers:
            writer.write_scalars(step, scalars)

    def write_texts(self, step: int, texts: Mapping[str, str]) -> None:
        for writer in self._writers:
            writer.write_texts(step, texts)

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        for writer in self._writers:
            writer.write_hparams(hparams)

    def flush(self) -> None:
        for writer in self._writers:
            writer.flush()

    def close(self) -> None:
        # Close every writer even if one fails, then report the first failure.
        first_error: BaseException | None = None
        for writer in self._writers:
            try:
                writer.close()
            except Exception as exc:  # noqa: BLE001 - re-raised below
                first_error = first_error or exc
        if first_error is not None:
            raise first_error


class NullWriter(MetricWriter):
    """Discards everything; what processes other than 0 get from ``create_default_writer``."""

    def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
        del step, scalars


def flatten_hparams(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flattens nested mappings to dotted keys (``{"optim": {"lr": 1}} -> {"optim.lr": 1}``).

    Dotted keys match the recipes' CLI override syntax (``optim.lr=1e-6``). Values that are not
    bool/int/float/str (lists, dataclasses, None) become their ``str``.

    Args:
        hparams: possibly nested name -> value mapping.
        prefix: prepended to every key (used by the recursion).

    Returns:
        A flat dict of dotted name -> bool | int | float | str.
    """
    flat: dict[str, Any] = {}
    for key, value in hparams.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_hparams(value, prefix=f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat
