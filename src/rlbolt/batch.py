"""Batch: named columns that share a leading sample axis, and the stage schemas.

A `Batch` is the one container that moves between stages (rollout -> logps -> advantage ->
update). Every column is an array whose first axis counts samples (`N`). Columns may be NumPy
arrays (host, producer side; object arrays hold strings such as answers) or JAX arrays (device).
`Batch` is a registered pytree, so numeric batches pass straight into `jax.jit`.

The columns the framework writes (every other column of an arriving batch is a prompt-row field,
which rewards see) are registered in `COLUMNS`, each with its shape and meaning: the standard
ones below, an optional one where it is written (`register_column`: the MoE routing columns,
PPO's value columns, the episodes' sequence mask, the dock's index), a user module's new column
by that module.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from rlbolt.utils.registry import Registry

Array = Any  # np.ndarray | jax.Array


class Column(tuple):
    """A registered column: `(shape, dtype, meaning)`, e.g. `("[N, C]", "float32", "...")`."""

    __slots__ = ()

    def __new__(cls, shape: str, dtype: str, meaning: str) -> Column:
        return super().__new__(cls, (shape, dtype, meaning))


COLUMNS: Registry[Column] = Registry("batch column", "Batch column")


def register_column(name: str, shape: str, dtype: str, meaning: str, *, by: str) -> str:
    """Registers a column the framework (or a user's module) writes, so it is not taken for a
    prompt-row field (`row_fields`: what rewards see).

    Args:
      name: the column name.
      shape: its shape, e.g. "[N, C]".
      dtype: its dtype, e.g. "float32".
      meaning: one line.
      by: the module that writes it (`__name__`); another module may not take the name.

    Returns:
      The name.
    """
    COLUMNS.register(name, Column(shape, dtype, meaning), owner=by)
    return name


for _name, _shape, _dtype, _meaning in (
    ("prompt_ids", "[N, P]", "int32", "left-padded prompt tokens"),
    ("prompt_mask", "[N, P]", "bool", "True on real prompt tokens"),
    ("completion_ids", "[N, C]", "int32", "sampled tokens, padded after the stop token"),
    ("completion_mask", "[N, C]", "bool", "True on generated tokens (through the stop token)"),
    ("completion_text", "[N]", "object", "the decoded completion"),
    ("group_ids", "[N]", "int32", "samples of one prompt share an id (any ids, any group sizes)"),
    ("policy_version", "[N]", "int32", "the policy version that generated the sample"),
    ("sample_keys", "[N, 2]", "uint32", "the sample's PRNG key data (sampling, Clip-Cov's draw)"),
    ("sampler_logps", "[N, C]", "float32", "logps of the sampled tokens as the sampler computed them"),
    ("old_logps", "[N, C]", "float32", "behaviour-policy logps used by the ratio"),
    ("ref_logps", "[N, C]", "float32", "reference-policy logps (when a KL term is used)"),
    ("teacher_logps", "[N, C]", "float32", "the distillation teacher's logps"),
    ("rewards", "[N]", "float32", "the weighted reward"),
    ("advantages", "[N] or [N, C]", "float32", "the policy-gradient weights"),
    ("importance_weights", "[N, C]", "float32", "the rollout correction's weights"),
    ("keep_mask", "[N, C]", "bool", "the rollout correction's kept tokens"),
    ("mini_batch_num_tokens", "[N]", "float32", "completion tokens of the sample's mini batch (aggregation)"),
    ("mini_batch_num_samples", "[N]", "float32", "samples of the sample's mini batch (aggregation)"),
):
    register_column(_name, _shape, _dtype, _meaning, by=__name__)


def row_fields(batch: Mapping[str, Any]) -> list[str]:
    """The prompt row's own fields (question, answer, ...) plus prompt_index: every column of
    `batch` no one registered in `COLUMNS`; what rewards see."""
    return [k for k in batch if k not in COLUMNS]


def _xp(arrays: Iterable[Array]):
    """NumPy when every array is on the host, else jax.numpy (keeps host batches on the host)."""
    import jax.numpy as jnp

    return np if all(isinstance(a, np.ndarray) for a in arrays) else jnp


@jax.tree_util.register_pytree_node_class
class Batch(Mapping[str, Array]):
    """An immutable mapping of column name -> array, all with the same leading size."""

    __slots__ = ("_columns",)

    def __init__(self, columns: Mapping[str, Array] | None = None, **kwargs: Array):
        cols = dict(columns or {}, **kwargs)
        sizes = {name: _leading(name, value) for name, value in cols.items()}
        if len(set(sizes.values())) > 1:
            detail = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise ValueError(f"Batch columns must share the leading (sample) size; got {detail}")
        object.__setattr__(self, "_columns", cols)

    # Mapping protocol ---------------------------------------------------------------------
    def __getitem__(self, name: str) -> Array:
        try:
            return self._columns[name]
        except KeyError:
            raise KeyError(f"Batch has no column {name!r}; columns: {sorted(self._columns)}") from None

    def __iter__(self):
        return iter(self._columns)

    def __len__(self) -> int:
        return self.num_samples

    def __setattr__(self, *_):
        raise AttributeError("Batch is immutable; use with_columns()/drop()")

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}:{getattr(v, 'dtype', '?')}{list(np.shape(v))}" for k, v in self._columns.items())
        return f"Batch({cols})"

    @property
    def num_samples(self) -> int:
        for value in self._columns.values():
            return int(np.shape(value)[0])
        return 0

    @property
    def group_ids(self) -> Array:
        return self["group_ids"]

    @property
    def policy_version(self) -> Array:
        return self["policy_version"]

    # Pytree ---------------------------------------------------------------------------------
    def tree_flatten(self):
        names = tuple(sorted(self._columns))
        return tuple(self._columns[n] for n in names), names

    @classmethod
    def tree_unflatten(cls, names, values):
        obj = object.__new__(cls)
        object.__setattr__(obj, "_columns", dict(zip(names, values)))
        return obj

    # Column edits ---------------------------------------------------------------------------
    def with_columns(self, columns: Mapping[str, Array] | None = None, **kwargs: Array) -> Batch:
        """A new Batch with columns added or replaced."""
        return Batch({**self._columns, **dict(columns or {}), **kwargs})

    def drop(self, *names: str) -> Batch:
        return Batch({k: v for k, v in self._columns.items() if k not in names})

    def only(self, *names: str) -> Batch:
        return Batch({n: self[n] for n in names})

    def numeric(self) -> Batch:
        """The columns a jitted function can take (drops object/string columns)."""
        return Batch({k: v for k, v in self._columns.items() if np.asarray(v).dtype.kind in "biuf" or isinstance(v, jax.Array)})

    def to_host(self) -> Batch:
        return Batch({k: np.asarray(v) for k, v in self._columns.items()})

    # Sample-axis operations -----------------------------------------------------------------
    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Concatenates along the sample axis; every batch must have the same column names."""
        batches = [b for b in batches if b.num_samples or b._columns]
        if not batches:
            return Batch()
        names = set(batches[0])
        for b in batches[1:]:
            if set(b) != names:
                raise ValueError(f"Batch.concat: column names differ: {sorted(names)} vs {sorted(b)}")
        out = {}
        for n in batches[0]:
            parts = [b[n] for b in batches]
            out[n] = _xp(parts).concatenate(parts, axis=0)
        return Batch(out)

    def select(self, indices: Array) -> Batch:
        """Samples at `indices` (an int array or a boolean mask), in that order."""
        idx = np.asarray(indices)
        if idx.dtype == bool:
            idx = np.nonzero(idx)[0]
        return Batch({k: v[idx] for k, v in self._columns.items()})

    def slice(self, start: int, stop: int) -> Batch:
        return Batch({k: v[start:stop] for k, v in self._columns.items()})

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Consecutive pieces of the given sizes; the sizes must add up to `num_samples`."""
        if sum(sizes) != self.num_samples or any(s < 0 for s in sizes):
            raise ValueError(f"Batch.split: sizes {list(sizes)} do not add up to {self.num_samples} samples")
        out, start = [], 0
        for s in sizes:
            out.append(self.slice(start, start + s))
            start += s
        return out

    def chunk(self, size: int) -> list[Batch]:
        """Pieces of `size` samples; `size` must divide `num_samples` (no ragged last chunk)."""
        if size <= 0 or self.num_samples % size:
            raise ValueError(f"Batch.chunk: {self.num_samples} samples cannot be cut into chunks of {size}")
        return self.split([size] * (self.num_samples // size))

    def repeat(self, n: int) -> Batch:
        """Repeats each sample n times in place: samples a, b -> a a b b (groups stay contiguous)."""
        out = {}
        for k, v in self._columns.items():
            out[k] = _xp([v]).repeat(v, n, axis=0)
        return Batch(out)

    @staticmethod
    def from_rows(rows: Sequence[Mapping[str, Any]]) -> Batch:
        """Stacks dict rows into columns. Ragged or non-numeric values become object arrays."""
        if not rows:
            return Batch()
        names = list(rows[0])
        out = {}
        for n in names:
            values = [r[n] for r in rows]
            try:
                arr = np.asarray(values)
            except ValueError:  # ragged sequences
                arr = None
            if arr is None or arr.dtype.kind not in "biuf":
                arr = np.empty(len(values), dtype=object)
                for i, v in enumerate(values):
                    arr[i] = v
            out[n] = arr
        return Batch(out)


def _leading(name: str, value: Array) -> int:
    shape = np.shape(value)
    if not shape:
        raise ValueError(f"Batch column {name!r} is a scalar; every column needs a leading sample axis")
    return int(shape[0])


# ---------------------------------------------------------------------------------------------
# Stage schemas
# ---------------------------------------------------------------------------------------------
# A spec is (dims, dtype kind): dims name symbolic sizes (N samples, P prompt, C completion);
# several dims tuples mean "any of these". Kinds: i integer, b bool, f float.
_ROLLOUT = {
    "prompt_ids": ((("N", "P"),), "i"),
    "prompt_mask": ((("N", "P"),), "b"),
    "completion_ids": ((("N", "C"),), "i"),
    "completion_mask": ((("N", "C"),), "b"),
    "group_ids": ((("N",),), "i"),
    "policy_version": ((("N",),), "i"),
}
_LOGPS = {**_ROLLOUT, "old_logps": ((("N", "C"),), "f")}
_ADVANTAGE = {**_LOGPS, "rewards": ((("N",),), "f"), "advantages": ((("N",), ("N", "C")), "f")}
STAGE_SCHEMAS: dict[str, dict[str, tuple]] = {
    "rollout": _ROLLOUT,
    "logps": _LOGPS,
    "advantage": _ADVANTAGE,
    "train": _ADVANTAGE,
}
_KIND_NAMES = {"i": "an integer dtype", "b": "bool", "f": "a float dtype"}


class BatchSchemaError(ValueError):
    """A batch does not match the columns a stage promises to the next one."""


def check_stage(batch: Batch, stage: str, extra: Mapping[str, tuple] | None = None) -> Batch:
    """Checks `batch` against the schema of `stage`; returns it unchanged when it matches.

    Args:
      batch: the batch leaving `stage`.
      stage: one of "rollout", "logps", "advantage", "train".
      extra: more required columns, as {name: (dims options, kind)} (modules add their own).

    Raises:
      BatchSchemaError: naming the stage, the column, and expected vs actual shape/dtype.
    """
    if stage not in STAGE_SCHEMAS:
        raise ValueError(f"unknown stage {stage!r}; stages: {list(STAGE_SCHEMAS)}")
    schema = {**STAGE_SCHEMAS[stage], **dict(extra or {})}
    sizes: dict[str, int] = {"N": batch.num_samples}
    for name, (dims_options, kind) in schema.items():
        if name not in batch:
            raise BatchSchemaError(
                f"stage {stage!r}: missing column {name!r} (expected shape "
                f"{' or '.join(_fmt(d) for d in dims_options)}, {_KIND_NAMES[kind]}); present: {sorted(batch)}"
            )
        value = batch[name]
        shape, dtype = tuple(np.shape(value)), np.dtype(getattr(value, "dtype", np.asarray(value).dtype))
        if dtype.kind not in ("iu" if kind == "i" else kind):
            raise BatchSchemaError(f"stage {stage!r}: column {name!r} has dtype {dtype}, expected {_KIND_NAMES[kind]}")
        if not any(_bind(dims, shape, dict(sizes)) is not None for dims in dims_options):
            expected = " or ".join(_fmt(d, sizes) for d in dims_options)
            raise BatchSchemaError(f"stage {stage!r}: column {name!r} has shape {list(shape)}, expected {expected}")
        for dims in dims_options:
            bound = _bind(dims, shape, dict(sizes))
            if bound is not None:
                sizes = bound
                break
    return batch


def _bind(dims: tuple[str, ...], shape: tuple[int, ...], sizes: dict[str, int]) -> dict[str, int] | None:
    if len(dims) != len(shape):
        return None
    for d, s in zip(dims, shape):
        if sizes.setdefault(d, s) != s:
            return None
    return sizes


def _fmt(dims: tuple[str, ...], sizes: Mapping[str, int] | None = None) -> str:
    sizes = sizes or {}
    return "[" + ", ".join(f"{d}={sizes[d]}" if d in sizes else d for d in dims) + "]"

