import random
import threading
import time
import traceback

import pytest

from rlbolt.prefetch import DataPrefetcher


def _threads():
    return {t for t in threading.enumerate() if t.name.startswith("rlbolt-producer")}


def _failing_producer(stop):
    for i in range(100):
        if i == 3:
            raise ValueError("bad row at step 3")
        yield i


def test_items_arrive_in_order_and_end():
    with DataPrefetcher(lambda stop: iter(range(20)), depth=2) as it:
        assert list(it) == list(range(20))
    assert not _threads()


def test_producer_exception_reaches_consumer_with_its_traceback():
    got = []
    start = time.monotonic()
    with pytest.raises(ValueError, match="bad row at step 3") as info:
        with DataPrefetcher(_failing_producer) as it:
            for item in it:
                got.append(item)
    assert time.monotonic() - start < 2.0
    assert got == [0, 1, 2]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_failing_producer" in frames  # the producer's own frame is in the traceback
    assert any("producer thread" in n for n in info.value.__notes__)
    assert not _threads()


def test_consumer_exception_stops_producer():
    produced = []

    def endless(stop):
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    with pytest.raises(RuntimeError, match="consumer failed"):
        with DataPrefetcher(endless, depth=2) as it:
            for item in it:
                if item == 5:
                    raise RuntimeError("consumer failed")
    n = len(produced)
    time.sleep(0.2)
    assert len(produced) == n  # producer no longer runs
    assert not _threads()


def test_timeout_when_producer_is_stuck():
    def stuck(stop):
        while not stop.is_set():
            time.sleep(0.01)
        return
        yield

    with pytest.raises(TimeoutError, match="timeout_s"):
        with DataPrefetcher(stuck, timeout_s=0.3) as it:
            list(it)
    assert not _threads()


def test_queue_is_bounded():
    produced = []

    def counting(stop):
        for i in range(100):
            produced.append(i)
            yield i

    with DataPrefetcher(counting, depth=2) as it:
        first = next(iter(it))
        time.sleep(0.3)
        # one consumed, at most `depth` waiting, one blocked in put
        assert first == 0 and len(produced) <= 4


def test_random_speeds_keep_order():
    rng = random.Random(0)

    def slow(stop):
        for i in range(30):
            time.sleep(rng.random() * 0.005)
            yield i

    out = []
    with DataPrefetcher(slow, depth=3) as it:
        for item in it:
            time.sleep(rng.random() * 0.005)
            out.append(item)
    assert out == list(range(30))
