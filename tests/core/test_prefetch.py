import threading
import time
import traceback

import pytest

from rlbolt.producer.stage_threads import ProducerStopped, StageThreads


def _threads():
    return {t for t in threading.enumerate() if t.name.startswith("rlbolt-producer") and t.is_alive()}


class Woken(Exception):
    pass


def test_a_stage_failure_stops_every_stage_and_reaches_the_consumer_with_its_frames():
    cond, stops = threading.Condition(), []

    def on_stop():  # what the producer does: close the dock the stages wait on
        stops.append(time.monotonic())
        with cond:
            cond.notify_all()

    def waiting(stop):
        StageThreads.wait(lambda: False, stop, cond)

    def failing_stage(stop):
        time.sleep(0.05)
        raise ValueError("bad row at step 3")

    threads = StageThreads(on_stop)
    threads.start("waiting", waiting)
    threads.start("scorer", failing_stage)
    start = time.monotonic()
    while threads.alive and time.monotonic() - start < 5:
        time.sleep(0.01)
    assert not threads.alive and len(stops) == 1  # the waiting stage left too, woken once
    with pytest.raises(ValueError, match="bad row at step 3") as info:
        threads.check()
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "failing_stage" in frames  # the stage's own frame is in the traceback
    assert any("rlbolt-producer-scorer" in n for n in info.value.__notes__)
    threads.stop()
    assert not _threads()


def test_stop_wakes_blocked_stages_and_exceptions_caused_by_stopping_are_not_failures():
    event = threading.Event()

    def blocked(stop):
        event.wait(10)
        raise Woken("the dock was closed under me")

    threads = StageThreads(event.set, quiet=(Woken,))
    threads.start("a", blocked)
    threads.start("b", lambda stop: StageThreads.wait(lambda: False, stop, threading.Condition()))
    time.sleep(0.05)
    threads.stop()
    threads.check()  # nothing raised: both stages stopped because they were asked to
    assert not _threads()


def test_a_quiet_exception_before_any_stop_is_a_failure():
    threads = StageThreads(quiet=(Woken,))
    threads.start("a", lambda stop: (_ for _ in ()).throw(Woken("not asked to stop")))
    threads.stop()
    with pytest.raises(Woken):
        threads.check()


def test_a_stage_that_ignores_stop_is_reported():
    release = threading.Event()
    threads = StageThreads()
    threads.start("stuck", lambda stop: release.wait(5))
    with pytest.raises(RuntimeError, match=r"\['rlbolt-producer-stuck'\] did not stop within 0.2 s"):
        threads.stop(join_timeout_s=0.2)
    release.set()


def test_wait_raises_producer_stopped_when_asked():
    stop, cond = threading.Event(), threading.Condition()
    threading.Timer(0.05, stop.set).start()
    with pytest.raises(ProducerStopped):
        StageThreads.wait(lambda: False, stop, cond)
