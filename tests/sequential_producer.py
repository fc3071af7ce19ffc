"""Running a fit twice, through the pipelined Producer and through the data flow's one-thread
specification (`rlbolt.producer.sequential.SequentialProducer`), and comparing them bit for bit."""

from __future__ import annotations

import numpy as np

import rlbolt.trainer
from rlbolt.callback import Callback
from rlbolt.producer.sequential import SequentialProducer

TIMING_PREFIXES = ("time/", "throughput/")


class _Capture(Callback):
    def __init__(self):
        self.steps = []

    def on_step_end(self, trainer, info):
        self.steps.append((dict(info.metrics), info.batch))


def fit_both(make_trainer, make_module, rows, monkeypatch):
    """Fits once through the pipeline and once through this reference; returns both
    (state, [(metrics, batch) per step]) pairs. `make_trainer(callbacks)` builds a Trainer."""
    out = []
    for reference in (False, True):
        if reference:
            monkeypatch.setattr(rlbolt.trainer, "Producer", SequentialProducer)
        capture = _Capture()
        state = make_trainer([capture]).fit(make_module(), rows)
        out.append((state, capture.steps))
    monkeypatch.undo()
    return out


def assert_same_fit(run, reference, param_leaves):
    """Every trained batch, every metric outside time/ and throughput/, and the final params
    (`param_leaves(state)` -> list of arrays) equal, bit for bit."""
    (state, steps), (ref_state, ref_steps) = run, reference
    assert len(steps) == len(ref_steps) > 0
    for s, ((metrics, batch), (ref_metrics, ref_batch)) in enumerate(zip(steps, ref_steps)):
        keys = {k for k in metrics if not k.startswith(TIMING_PREFIXES)}
        assert keys == {k for k in ref_metrics if not k.startswith(TIMING_PREFIXES)}, f"step {s}: metric names"
        for k in keys:
            assert metrics[k] == ref_metrics[k], f"step {s}: {k} = {metrics[k]!r}, reference {ref_metrics[k]!r}"
        assert sorted(batch) == sorted(ref_batch)
        for col in batch:
            a, b = np.asarray(batch[col]), np.asarray(ref_batch[col])
            assert a.dtype == b.dtype and a.shape == b.shape, f"step {s}: column {col}"
            assert (a == b).all(), f"step {s}: column {col} differs"
    for a, b in zip(param_leaves(state), param_leaves(ref_state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), "final params differ"
    assert (state.step, state.policy_version, state.data_position) == (
        ref_state.step, ref_state.policy_version, ref_state.data_position)
