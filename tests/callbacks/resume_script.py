"""A real training process for the resume-contract tests (run as a subprocess, then killed).

Trains the toy bigram module with ModelCheckpoint(every_n_steps=1), writes `metrics.jsonl` in the
run directory and, when fit returns, the final params to `<run_dir>/final_params.npz`. Running it
again with the same flags resumes from the newest usable checkpoint.

    python tests/callbacks/resume_script.py --run_dir /tmp/run --steps 8 --num_iterations 2

Test-only flags: --step_sleep slows each step down (room for a kill), --kill_in_save N SIGKILLs
the process itself after step N's files are written but before Orbax renames its directory,
--signal_in_save N sends itself SIGTERM at that same moment (a signal during a checkpoint
write), and --nan_at_step K makes the advantages of step K (1-based) NaN. --lora trains GRPO with
LoRA adapters (model.lora, KL to the base with adapters off) on a tiny random base instead of the
toy module.

When fit returns interrupted (SIGINT / SIGTERM), the script exits 128 + signum after printing
`interrupted step=...`, as docs/howto/resume.md suggests for a script.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (toy_module)

from toy_module import ToyModule, prompt_rows  # noqa: E402

from rlbolt.batch import Batch  # noqa: E402
from rlbolt.callback import Callback  # noqa: E402
from rlbolt.callbacks.checkpoint import ModelCheckpoint  # noqa: E402
from rlbolt.callbacks.nan_guard import NaNGuard  # noqa: E402
from rlbolt.loggers import JsonlWriter  # noqa: E402
from rlbolt.plan import BatchPlan  # noqa: E402
from rlbolt.trainer import Trainer  # noqa: E402


class ResumeToy(ToyModule):
    """ToyModule plus the old-logps forward pass num_iterations > 1 needs, and optional NaNs."""

    def __init__(self, nan_at_step: int | None = None, prompts_per_step: int = 1, **kwargs):
        super().__init__(**kwargs)
        self.nan_at_step, self.prompts_per_step = nan_at_step, prompts_per_step

    def compute_logps(self, params, batch: Batch) -> Batch:
        if self.context.plan.num_iterations == 1:
            return super().compute_logps(params, batch)
        logps = self._logps(params, jnp.asarray(batch["prompt_ids"]), jnp.asarray(batch["completion_ids"]))
        return batch.with_columns(old_logps=np.asarray(logps, np.float32))

    def on_advantage(self, batch: Batch) -> Batch:
        batch = super().on_advantage(batch)
        step = int(np.asarray(batch["prompt_index"])[0]) // self.prompts_per_step + 1  # 1-based, no refills
        if self.nan_at_step is not None and step == self.nan_at_step:
            batch = batch.with_columns(advantages=np.full_like(np.asarray(batch["advantages"]), np.nan))
        return batch


class JsonlMetrics(Callback):
    """Appends each step's metrics to <run_dir>/metrics.jsonl (placed before ModelCheckpoint, so a
    step's line is written before its checkpoint can exist)."""

    def on_fit_start(self, trainer, state):
        self.writer = JsonlWriter(Path(trainer.run_dir) / "metrics.jsonl")

    def on_step_end(self, trainer, info):
        self.writer.write_scalars(info.step, info.metrics)

    def on_fit_end(self, trainer, state):
        self.writer.close()

    def on_exception(self, trainer, exc):
        self.writer.close()


class Sleep(Callback):
    """Sleeps after every step; first writes the step's number to `<run_dir>/sleeping` (atomically),
    so a test can send a signal at the start of a sleep, with the whole sleep still ahead."""

    def __init__(self, seconds: float, run_dir: str):
        self.seconds, self.marker = seconds, Path(run_dir) / "sleeping"

    def on_step_end(self, run, info):
        tmp = self.marker.with_suffix(".tmp")
        tmp.write_text(str(info.step))
        os.replace(tmp, self.marker)
        time.sleep(self.seconds)


def kill_during_save(step: int, signum: int = signal.SIGKILL) -> None:
    """Sends `signum` to this process when Orbax is about to rename step `step`'s tmp dir into place."""
    from orbax.checkpoint._src.path import atomicity

    original = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize(self):
        if self.get_final().name == str(step):
            name = "killed_in_save" if signum == signal.SIGKILL else "signalled_in_save"
            (self.get_final().parent.parent / name).write_text(str(step))
            os.kill(os.getpid(), signum)
        return await original(self)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize


def flat_params(params) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_dir", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--num_prompts", type=int, default=64, help="small values cross epoch boundaries")
    p.add_argument("--prompts_per_step", type=int, default=4)
    p.add_argument("--num_generations", type=int, default=4)
    p.add_argument("--num_iterations", type=int, default=1)
    p.add_argument("--mini_batch_size", type=int, default=None)
    p.add_argument("--train_micro_batch_size", type=int, default=None, help="< mini: gradient accumulation")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--mode", default="sync", choices=("sync", "async"))
    p.add_argument("--max_staleness", type=int, default=None)
    p.add_argument("--sync_save", action="store_true", help="ModelCheckpoint(async_save=False)")
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--step_sleep", type=float, default=0.0)
    p.add_argument("--kill_in_save", type=int, default=None)
    p.add_argument("--signal_in_save", type=int, default=None)
    p.add_argument("--nan_at_step", type=int, default=None)
    p.add_argument("--lora", action="store_true", help="GRPO with model.lora on a tiny random base")
    args = p.parse_args(argv)

    if args.kill_in_save is not None:
        kill_during_save(args.kill_in_save)
    if args.signal_in_save is not None:
        kill_during_save(args.signal_in_save, signal.SIGTERM)
    plan = BatchPlan(prompts_per_step=args.prompts_per_step, num_generations=args.num_generations,
                     mini_batch_size=args.mini_batch_size, train_micro_batch_size=args.train_micro_batch_size,
                     num_iterations=args.num_iterations)
    callbacks = [NaNGuard()] if args.nan_at_step is not None else []
    callbacks += [JsonlMetrics(), ModelCheckpoint(every_n_steps=1, keep=args.keep, async_save=not args.sync_save)]
    if args.step_sleep:
        callbacks.append(Sleep(args.step_sleep, args.run_dir))
    trainer = Trainer(plan, max_steps=args.steps, max_epochs=None, seed=3, shuffle=args.shuffle, callbacks=callbacks,
                      mode=args.mode, max_staleness=args.max_staleness, run_dir=args.run_dir)
    if args.lora:
        from rlbolt.data import gsm8k_style_rows
        from rlbolt.modules import GRPO

        module = GRPO({"model": {"tiny": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
                                          "head_dim": 16, "intermediate_size": 64},
                                 "lora": {"rank": 2, "alpha": 4, "targets": ["q", "v", "down"]}},
                       "algorithm": {"lr": 0.05, "beta": 0.04}, "rollout": {"max_new_tokens": 4},
                       "data": {"max_prompt_tokens": 16}, "reward": {"weights": {"digits": 1.0}}})
        rows = gsm8k_style_rows(args.num_prompts)
    else:
        module = ResumeToy(nan_at_step=args.nan_at_step, prompts_per_step=args.prompts_per_step)
        rows = prompt_rows(args.num_prompts)
    state = trainer.fit(module, rows)
    if trainer.interrupted:
        print(f"interrupted step={state.step}", flush=True)
        sys.exit(128 + trainer.stop_signal)
    np.savez(Path(args.run_dir) / "final_params.npz", **flat_params(state.params))
    print(f"finished step={state.step} policy_version={state.policy_version} data_position={state.data_position}")


if __name__ == "__main__":
    main()
