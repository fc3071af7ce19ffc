"""ProgressBar: plain lines off a TTY (exact text with a fake clock), a tqdm bar on one."""

import io
import types

import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callbacks.progress import ProgressBar
from rlbolt.plan import BatchPlan
from rlbolt.run_info import RunInfo, total_steps
from rlbolt.state import StepInfo
from rlbolt.trainer import Trainer


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def _trainer(max_steps=10, is_main=True):
    return RunInfo(run_dir=".", is_main_process=is_main, max_steps=max_steps, total_steps=max_steps)


def _drive(bar, trainer, steps, start_step=0, clock=None, seconds_per_step=2.0):
    bar.on_fit_start(trainer, types.SimpleNamespace(step=start_step))
    for step in steps:
        if clock is not None:
            clock[0] += seconds_per_step
        bar.on_step_end(trainer, StepInfo(step=step, state=None, epoch=0.0, metrics={
            "reward/mean": step / 10, "loss": 0.25, "throughput/tokens_per_s": 100.0, "kl": 1.0},
            is_last=trainer.is_last_step(step, 0)))
    bar.on_fit_end(trainer, None)


def test_plain_lines_when_not_a_tty_with_elapsed_and_eta():
    out, now = io.StringIO(), [0.0]
    bar = ProgressBar(plain_every_n_steps=5, plain_every_secs=None, file=out, clock=lambda: now[0])
    _drive(bar, _trainer(max_steps=10), range(1, 11), clock=now)
    assert out.getvalue().splitlines() == [
        "step 5/10 (50%) | reward 0.5 | loss 0.25 | tok/s 100 | elapsed 0:00:10 | eta 0:00:10",
        "step 10/10 (100%) | reward 1 | loss 0.25 | tok/s 100 | elapsed 0:00:20 | eta 0:00:00",
    ]


def test_eta_after_resume_counts_only_this_runs_steps():
    out, now = io.StringIO(), [0.0]
    bar = ProgressBar(plain_every_n_steps=2, plain_every_secs=None, file=out, clock=lambda: now[0])
    # Resumed at step 90 of 100; 3 s per step from here -> at step 92, 8 steps left = 24 s.
    _drive(bar, _trainer(max_steps=100), [91, 92], start_step=90, clock=now, seconds_per_step=3.0)
    assert out.getvalue().splitlines() == [
        "step 92/100 (92%) | reward 9.2 | loss 0.25 | tok/s 100 | elapsed 0:00:06 | eta 0:00:24"]


def test_plain_lines_also_fire_by_time_and_at_the_last_step():
    out, now = io.StringIO(), [0.0]
    bar = ProgressBar(plain_every_n_steps=100, plain_every_secs=5.0, file=out, clock=lambda: now[0])
    _drive(bar, _trainer(max_steps=7), range(1, 8), clock=now)
    assert [line.split(" | ")[0] for line in out.getvalue().splitlines()] == [
        "step 3/7 (42%)", "step 6/7 (85%)", "step 7/7 (100%)"]


def test_plain_lines_by_time_are_decided_by_process_0_alone(monkeypatch):
    # process 0 alone runs this: an agreement across processes there would be a collective the others never
    # join (seen: `rlbolt launch -- rlbolt fit` with its output piped hung or broke the next collective)
    import rlbolt.distributed.agree as agree

    def no_collective(*args, **kwargs):
        raise AssertionError("ProgressBar called a collective on process 0 alone")

    monkeypatch.setattr(agree, "any_process", no_collective)
    out, now = io.StringIO(), [0.0]
    bar = ProgressBar(plain_every_n_steps=100, plain_every_secs=5.0, file=out, clock=lambda: now[0])
    _drive(bar, _trainer(max_steps=4), range(1, 5), clock=now)
    assert [line.split(" | ")[0] for line in out.getvalue().splitlines()] == ["step 3/4 (75%)", "step 4/4 (100%)"]


def test_tqdm_bar_on_a_tty_shows_count_and_postfix():
    out = FakeTTY()
    bar = ProgressBar(file=out)
    _drive(bar, _trainer(max_steps=4), range(1, 5))
    text = out.getvalue()
    assert "4/4" in text and "train" in text
    assert "reward 0.4 | loss 0.25 | tok/s 100" in text
    assert "kl" not in text


def test_refresh_every_n_steps_limits_redraws():
    out = FakeTTY()
    bar = ProgressBar(refresh_every_n_steps=3, file=out, tqdm_kwargs={"mininterval": 0, "miniters": 1})
    _drive(bar, _trainer(max_steps=7), range(1, 8))
    text = out.getvalue()
    assert "reward 0.3 " in text and "reward 0.6 " in text and "reward 0.7 " in text
    assert "reward 0.1 " not in text and "reward 0.5 " not in text


def test_other_processes_print_nothing():
    out = FakeTTY()
    _drive(ProgressBar(file=out), _trainer(is_main=False), range(1, 4))
    assert out.getvalue() == ""


def test_total_is_estimated_from_epochs():
    assert total_steps(None, 3 * 10, 4) == 7  # 3 epochs of 10 prompts, 4 a step: 30 // 4
    assert total_steps(None, 3, 4) == 1  # fewer prompts than a step still runs one
    assert total_steps(None, None, 4) is None
    with pytest.raises(ValueError, match="refresh_every_n_steps=0"):
        ProgressBar(refresh_every_n_steps=0)


def test_real_fit_prints_a_line_per_step_off_a_tty(tmp_path):
    out = io.StringIO()
    Trainer(BatchPlan(prompts_per_step=4, num_generations=2), max_steps=2, run_dir=tmp_path,
            callbacks=[ProgressBar(plain_every_n_steps=1, file=out)]).fit(ToyModule(), prompt_rows(8))
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 1/2 (50%)", "step 2/2 (100%)"]
    assert all(" | reward " in line and " | loss " in line and " | tok/s " in line for line in lines)
