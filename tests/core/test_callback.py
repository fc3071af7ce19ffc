import pytest

from rlbolt.callback import Callback, CallbackList, Periodic


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_periodic_every_n_steps():
    p = Periodic(every_n_steps=3)
    assert [s for s in range(1, 11) if p.should_fire(s)] == [3, 6, 9]


def test_periodic_every_secs_with_injected_clock():
    clock = FakeClock()
    p = Periodic(every_secs=10, clock=clock)
    fired = []
    for step in range(1, 8):
        clock.now += 4  # 4 s per step
        if p.should_fire(step):
            fired.append(step)
    assert fired == [3, 6]  # at 12 s, then 12 s after that (24 s)


def test_periodic_either_condition_and_no_double_fire():
    clock = FakeClock()
    p = Periodic(every_n_steps=5, every_secs=100, clock=clock)
    assert p.should_fire(5)
    assert not p.should_fire(5)  # same step twice fires once
    clock.now = 150
    assert p.should_fire(6)  # time condition
    assert not p.should_fire(7)  # timer restarted at 150


def test_periodic_forced_firing_restarts_timer():
    clock = FakeClock()
    p = Periodic(every_secs=10, clock=clock)
    clock.now = 9
    p.fired(3)
    clock.now = 15
    assert not p.should_fire(4)
    clock.now = 19
    assert p.should_fire(5)


@pytest.mark.parametrize("kwargs", [{"every_n_steps": 0}, {"every_secs": -1}])
def test_periodic_bad_arguments(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        Periodic(**kwargs)


def test_callback_list_dispatches_in_order_and_skips_non_overriders():
    calls = []

    class A(Callback):
        def on_step_end(self, trainer, info):
            calls.append(("A", info))

    class B(Callback):
        def on_step_end(self, trainer, info):
            calls.append(("B", info))

        def on_fit_start(self, trainer, state):
            return state + 1

    class Silent(Callback):
        pass

    cbs = CallbackList([A(), Silent(), B()])
    cbs.on_step_end(None, 7)
    assert calls == [("A", 7), ("B", 7)]
    assert cbs.on_fit_start(None, 1) == 2  # a callback may replace the state
    assert cbs.on_step_start(None, 0) is None  # nobody overrides: no-op


def test_on_exception_runs_every_callback_even_if_one_fails():
    seen = []

    class Bad(Callback):
        def on_exception(self, trainer, exc):
            raise RuntimeError("cleanup failed")

    class Good(Callback):
        def on_exception(self, trainer, exc):
            seen.append(exc)

    err = ValueError("boom")
    CallbackList([Bad(), Good()]).on_exception(None, err)
    assert seen == [err]
    assert any("cleanup failed" in n for n in err.__notes__)


def test_state_dict_roundtrip_and_duplicate_keys():
    class Counter(Callback):
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state):
            self.n = state["n"]

    a = Counter()
    a.n = 5
    saved = CallbackList([a]).state_dict()
    b = Counter()
    CallbackList([b]).load_state_dict(saved)
    assert b.n == 5
    with pytest.raises(ValueError, match="appear twice"):
        CallbackList([Counter(), Counter()])


def test_step_metrics_are_added_in_order_then_read_only():
    from rlbolt.state import StepInfo

    class Rate(Callback):
        order = -20

        def step_metrics(self, trainer, info):
            return {"rate": info.metrics["tokens"] / info.metrics["time"]}

    class UsesRate(Callback):
        def step_metrics(self, trainer, info):
            return {"rate/x2": 2 * info.metrics["rate"]}  # sees the lower order's addition

    class Writer(Callback):
        def on_step_end(self, trainer, info):
            with pytest.raises(TypeError):
                info.metrics["late"] = 1.0  # the one path is step_metrics

    callbacks = CallbackList([UsesRate(), Writer(), Rate()])
    info = callbacks.add_step_metrics(None, StepInfo(1, None, {"tokens": 30.0, "time": 2.0}, 0.0))
    assert dict(info.metrics) == {"tokens": 30.0, "time": 2.0, "rate": 15.0, "rate/x2": 30.0}
    callbacks.on_step_end(None, info)

    class Clash(Callback):
        def step_metrics(self, trainer, info):
            return {"tokens": 0.0}

    with pytest.raises(ValueError, match=r"Clash.step_metrics returned \['tokens'\]"):
        CallbackList([Clash()]).add_step_metrics(None, StepInfo(1, None, {"tokens": 30.0}, 0.0))
