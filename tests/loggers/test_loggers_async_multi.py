"""AsyncWriter and MultiWriter: order, exception re-raising, duck-typed (CLU-style) writers."""

import threading

import pytest

from rlbolt.loggers import AsyncWriter, MultiWriter


class Recorder:
    """A CLU-shaped writer that is not an rlbolt MetricWriter subclass (duck typing)."""

    def __init__(self, fail_on_step=None, gate=None):
        self.calls = []
        self.threads = set()
        self.fail_on_step = fail_on_step
        self.gate = gate

    def write_scalars(self, step, scalars):
        if self.gate is not None:
            self.gate.wait(timeout=10)
        self.threads.add(threading.current_thread().name)
        if step == self.fail_on_step:
            raise OSError(f"disk full at step {step}")
        self.calls.append(("scalars", step, dict(scalars)))

    def write_texts(self, step, texts):
        self.calls.append(("texts", step, dict(texts)))

    def write_hparams(self, hparams):
        self.calls.append(("hparams", dict(hparams)))

    def flush(self):
        self.calls.append(("flush",))

    def close(self):
        self.calls.append(("close",))


def test_async_writer_runs_calls_in_order_on_a_background_thread():
    inner = Recorder()
    writer = AsyncWriter(inner)
    writer.write_hparams({"lr": 1.0})
    metrics = {"loss": 1.0}
    writer.write_scalars(1, metrics)
    metrics["loss"] = 99.0  # the writer copied the dict at submit time
    writer.write_texts(1, {"sample": "x"})
    writer.flush()
    assert inner.calls == [("hparams", {"lr": 1.0}), ("scalars", 1, {"loss": 1.0}),
                           ("texts", 1, {"sample": "x"}), ("flush",)]
    assert inner.threads == {"rlbolt-async-writer"}
    writer.close()
    assert inner.calls[-1] == ("close",)


def test_async_writer_reraises_on_the_next_call():
    gate = threading.Event()
    writer = AsyncWriter(Recorder(fail_on_step=2, gate=gate))
    writer.write_scalars(2, {"loss": 1.0})  # returns before the failure happens
    gate.set()
    writer._queue.join()  # let the background call fail
    with pytest.raises(OSError, match="disk full at step 2"):
        writer.write_scalars(3, {"loss": 1.0})
    writer.write_scalars(4, {"loss": 1.0})  # reported once; later writes proceed
    writer.flush()
    assert [c[1] for c in writer.writer.calls if c[0] == "scalars"] == [4]
    writer.close()


def test_async_writer_reraises_on_flush_and_still_closes_on_close():
    inner = Recorder(fail_on_step=0)
    writer = AsyncWriter(inner)
    writer.write_scalars(0, {"loss": 1.0})
    with pytest.raises(OSError, match="disk full"):
        writer.flush()

    writer.write_scalars(0, {"loss": 1.0})
    with pytest.raises(OSError, match="disk full"):
        writer.close()
    assert inner.calls[-1] == ("close",)
    assert not writer._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_scalars(1, {"loss": 1.0})


def test_multi_writer_forwards_everything_to_each_writer_and_closes_all():
    first, second = Recorder(), Recorder()
    writer = MultiWriter([first, second])
    writer.write_hparams({"a": 1})
    writer.write_scalars(5, {"kl": 0.5})
    writer.write_texts(5, {"t": "s"})
    writer.flush()
    writer.close()
    expected = [("hparams", {"a": 1}), ("scalars", 5, {"kl": 0.5}), ("texts", 5, {"t": "s"}),
                ("flush",), ("close",)]
    assert first.calls == expected and second.calls == expected


def test_multi_writer_close_closes_the_rest_when_one_fails():
    class Broken(Recorder):
        def close(self):
            raise OSError("cannot close")

    healthy = Recorder()
    with pytest.raises(OSError, match="cannot close"):
        MultiWriter([Broken(), healthy]).close()
    assert healthy.calls == [("close",)]


def test_async_writer_rejects_bad_queue_size():
    with pytest.raises(ValueError, match="max_pending=0"):
        AsyncWriter(Recorder(), max_pending=0)
