"""The golden trace: every host hook of the module and of two callbacks, in order, over a short
fit with validation. `training_step` is jitted (traced once, runs on device) so it is not traced
here; the updates run between on_update_start and on_update_end."""

from toy_module import ToyModule, prompt_rows

from rlbolt.callback import HOOKS, Callback
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer


class RecordingModule(ToyModule):
    def __init__(self, trace):
        super().__init__()
        self.trace = trace

    def setup(self, trainer):
        self.trace.append("module.setup")

    def init_params(self, rng):
        self.trace.append("module.init_params")
        return super().init_params(rng)

    def configure_optimizers(self):
        self.trace.append("module.configure_optimizers")
        return super().configure_optimizers()

    def on_rollout(self, params, batch):
        self.trace.append("module.on_rollout")
        return super().on_rollout(params, batch)

    def compute_logps(self, params, batch):
        self.trace.append("module.compute_logps")
        return super().compute_logps(params, batch)

    def on_advantage(self, batch):
        self.trace.append("module.on_advantage")
        return super().on_advantage(batch)

    def validation_step(self, params, batch):
        self.trace.append("module.validation_step")
        return super().validation_step(params, batch)


def recording_callback(name, trace):
    def make(hook):
        def method(self, trainer, *args):
            arg = args[0]
            detail = {"wrap_optimizer": lambda a: "tx", "on_restore": lambda a: a.step, "on_update_start": lambda a: a.step, "on_update_end": lambda a: a.step,
                      "on_step_start": lambda a: a, "on_rollout_end": lambda a: a.step, "on_step_end": lambda a: a.step,
                      "on_validation_end": lambda a: a, "on_fit_start": lambda a: a.step, "on_fit_end": lambda a: a.step,
                      "on_exception": lambda a: type(a).__name__}[hook](arg)
            trace.append(f"{name}.{hook}({detail})")

        return method

    cls = type(f"Recorder{name}", (Callback,), {h: make(h) for h in HOOKS})
    cls.state_key = property(lambda self: name)
    return cls()


def test_golden_hook_order():
    trace = []
    late_a = recording_callback("A", trace)
    late_a.order = 5  # declared order beats list order
    trainer = Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=2, val_every_n_steps=1,
                      callbacks=[late_a, recording_callback("B", trace)])
    trainer.fit(RecordingModule(trace), prompt_rows(8), val_data=prompt_rows(2, seed=1))
    step = lambda s: [
        "module.on_rollout", "module.compute_logps", "module.on_advantage",   # producer thread
        f"A.on_step_start({s})", f"B.on_step_start({s})",
        f"A.on_rollout_end({s})", f"B.on_rollout_end({s})",
        f"A.on_update_start({s})", f"B.on_update_start({s})",   # the jitted updates run here
        f"A.on_update_end({s + 1})", f"B.on_update_end({s + 1})",
        f"A.on_step_end({s + 1})", f"B.on_step_end({s + 1})",
        "module.validation_step",
        f"A.on_validation_end({s + 1})", f"B.on_validation_end({s + 1})",
    ]
    trace = [t.replace("A.", "X.").replace("B.", "A.").replace("X.", "B.") for t in trace]  # B ran first
    assert trace == [
        "module.setup", "module.init_params", "module.configure_optimizers",
        "A.wrap_optimizer(tx)", "B.wrap_optimizer(tx)",
        "A.on_restore(0)", "B.on_restore(0)",
        "A.on_fit_start(0)", "B.on_fit_start(0)",
        *step(0), *step(1),
        "A.on_fit_end(2)", "B.on_fit_end(2)",
    ]


def test_exception_trace_skips_fit_end():
    trace = []

    class Fail(Callback):
        def on_step_end(self, trainer, info):
            raise RuntimeError("stop")

    trainer = Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=3,
                      callbacks=[Fail(), recording_callback("A", trace)])
    try:
        trainer.fit(RecordingModule(trace), prompt_rows(8))
    except RuntimeError:
        pass
    assert trace[-2:] == ["A.on_update_end(1)", "A.on_exception(RuntimeError)"]
    assert not any("on_fit_end" in t for t in trace)
