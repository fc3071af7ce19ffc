"""The golden trace over every built-in callback at once: which hooks each one runs, in what
order, over a two-step fit with validation every step. The callbacks are listed in reverse of
their declared order on purpose: `Callback.order`, not the list, decides."""

import io

import jax
from flax import nnx

from rlbolt import callbacks as cb
from rlbolt.callback import HOOKS, Callback
from rlbolt.data import gsm8k_style_rows
from rlbolt.models import Decoder, tiny_config
from rlbolt.modules import GRPO
from rlbolt.modules.prompts import builtin_tokenizer
from rlbolt.plan import BatchPlan
from rlbolt.app.rundir import LogFile
from rlbolt.trainer import Trainer


def _record(callback: Callback, trace: list) -> Callback:
    name, active = type(callback).__name__, []
    for hook in (*HOOKS, "step_metrics"):
        if getattr(type(callback), hook) is getattr(Callback, hook):
            continue  # not overridden: CallbackList never calls it
        original = getattr(callback, hook)

        def wrapper(*args, _original=original, _hook=hook):
            if not active:  # a hook calling another of its own hooks is not a dispatch
                trace.append(f"{name}.{_hook}")
            active.append(_hook)
            try:
                return _original(*args)
            finally:
                active.pop()

        setattr(callback, hook, wrapper)
    return callback


def test_every_builtin_callback_in_declared_order(tmp_path):
    tokenizer = builtin_tokenizer()
    model = Decoder(tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2,
                                num_kv_heads=1, head_dim=16, intermediate_size=64), rngs=nnx.Rngs(0))
    module = GRPO({"rollout": {"max_new_tokens": 4, "val_num_samples": 1}, "data": {"max_prompt_tokens": 32},
                   "algorithm": {"beta": 0.04}}, model=model, tokenizer=tokenizer)
    rows, val = gsm8k_style_rows(8), gsm8k_style_rows(2, seed=1)
    trace: list[str] = []
    listed = [
        cb.Evaluation(val, every_n_steps=1), cb.ModelCheckpoint(every_n_steps=1), cb.HFExport(tmp_path / "hf"),
        cb.EarlyStopping("val/accuracy", patience=10), LogFile(every_n_steps=1),
        cb.ProgressBar(file=io.StringIO()), cb.MetricsLogger(writer=["jsonl"]), cb.CPUOffload(),
        cb.Throughput(), cb.LearningRateMonitor(), cb.NaNGuard(),
    ]
    trainer = Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=2, run_dir=tmp_path,
                      callbacks=[_record(c, trace) for c in listed])
    trainer.fit(module, rows)

    # Declared orders: NaNGuard -30; Throughput, LearningRateMonitor -20 (list order between them);
    # order 0 in list order; ModelCheckpoint 10; Evaluation 20. The metric producers add theirs
    # (step_metrics) before any on_step_end sees the step.
    step_end = ["NaNGuard.step_metrics", "Throughput.step_metrics", "LearningRateMonitor.step_metrics",
                "NaNGuard.on_step_end", "HFExport.on_step_end", "EarlyStopping.on_step_end", "LogFile.on_step_end",
                "ProgressBar.on_step_end", "MetricsLogger.on_step_end", "ModelCheckpoint.on_step_end",
                "Evaluation.on_step_end",
                # Evaluation validates; every listener hears it, in order:
                "EarlyStopping.on_validation_end", "LogFile.on_validation_end",
                "MetricsLogger.on_validation_end", "ModelCheckpoint.on_validation_end"]
    # NaNGuard("stop") copies what the update donates to host memory before the update; ModelCheckpoint
    # notes the updated state (what it saves on an exception: it no longer reads the Trainer's).
    step = ["NaNGuard.on_update_start", "CPUOffload.on_update_start", "CPUOffload.on_update_end",
            "ModelCheckpoint.on_update_end", *step_end]
    assert trace == [
        "NaNGuard.wrap_optimizer",
        "ModelCheckpoint.on_restore",
        "Throughput.on_fit_start", "LearningRateMonitor.on_fit_start", "HFExport.on_fit_start",
        "LogFile.on_fit_start", "ProgressBar.on_fit_start", "MetricsLogger.on_fit_start",
        "CPUOffload.on_fit_start", "Evaluation.on_fit_start",
        *step, *step,
        "HFExport.on_fit_end", "LogFile.on_fit_end", "ProgressBar.on_fit_end", "MetricsLogger.on_fit_end",
        "CPUOffload.on_fit_end", "ModelCheckpoint.on_fit_end", "Evaluation.on_fit_end",
    ]
    assert (tmp_path / "hf" / "final" / "config.json").is_file() and (tmp_path / "checkpoints" / "2").is_dir()
