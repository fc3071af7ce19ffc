"""The `rlbolt` command.

    rlbolt demo   [--run-dir D] [--max-steps N] [--checkpoint-every K] [--seed S]
                  [--task copy|reverse|increment|tool|guess] [--lora-rank R] [--base-run D]
    rlbolt fit    CONFIG [--section.key=value ...]
    rlbolt plan   CONFIG [--topology v5p:2x2x2] [--json FILE] [--section.key=value ...]
    rlbolt resume D [--max-steps N] [--allow-config-change]
    rlbolt plot   D [--out DIR]
    rlbolt export D OUT [--overwrite] [--adapter]
    rlbolt launch --local N [--devices-per-process D] [--gpus-per-process G] -- rlbolt fit CONFIG ...

Exit status: 0 done; 2 bad input or a refusal (an unknown config key, a wrong type, a missing or
non-empty run directory, a run directory another process is training in, no usable checkpoint,
a changed config at resume); 1 a failure while running (a checkpoint that cannot be written,
e.g. a full disk; an environment whose factory or reset() raised, or that failed every episode
for rollout.env_max_failed_batches batches; a reward that failed every sample for
reward.max_failed_batches batches); 130 / 143 stopped by SIGINT / SIGTERM (a run first saves its last completed
step; a second signal exits at once). Each ends with one line on stderr that names the problem
and the fix, no traceback, and nothing after it: library noise at interpreter shutdown is
discarded. Set RLBOLT_DEBUG=1 to see tracebacks instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rlbolt.app.arg_types import positive_int
from rlbolt.demo.tasks import DEMO_TASKS

if TYPE_CHECKING:
    from rlbolt.demo.config import DemoConfig

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1

DESCRIPTION = """rlbolt: RL post-training of language models in JAX.

Start with `rlbolt demo`: a tiny model learns a digit task from scratch with GRPO on your CPU
(about 20 seconds on a 2-core CPU), with a progress bar, a summary and a reward plot in the run
directory."""


class CLIError(Exception):
    """A problem with the command line or its files, reported as one line."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(prog="rlbolt", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser("demo", help="train the built-in demo (a tiny model learns to copy digits)",
                          description="Train the built-in demo: a tiny random-init decoder learns to copy a "
                                      "digit string with GRPO, from near-chance reward to >= 0.9.")
    demo.add_argument("--run-dir", help="the run directory (default: runs/demo-<time>); must be empty or absent")
    demo.add_argument("--max-steps", type=positive_int,
                      help="global steps (default: the task's: 300 for the digit tasks, 600 for tool and guess)")
    demo.add_argument("--checkpoint-every", type=positive_int,
                      help="checkpoint every K steps (default: only the last step)")
    demo.add_argument("--seed", type=int, help="seed of the model, the prompts and sampling (default: 0)")
    demo.add_argument("--task", choices=DEMO_TASKS.names(),
                      help="copy (default), reverse or increment the digits; tool: answer with a value only a lookup "
                           "tool knows; guess: find a number from higher/lower replies (both multi-turn episodes)")
    demo.add_argument("--lora-rank", type=positive_int,
                      help="train only LoRA adapters of this rank on a frozen base (default: every parameter)")
    demo.add_argument("--base-run", help="start from the policy of another demo run's latest checkpoint, e.g. a "
                                         "copy-trained run that --lora-rank then adapts to --task reverse")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")

    fit = sub.add_parser("fit", help="train from a recipe config (YAML) with dotted overrides",
                         description="Train from a YAML config. Override any field with --section.key=value "
                                     "(e.g. --trainer.max_steps=10 --algorithm.beta=0.0). "
                                     "Run `rlbolt fit --list-fields` for every section and key.")
    fit.add_argument("config", nargs="?", help="a YAML config, e.g. recipes/configs/grpo_gsm8k.yaml")
    fit.add_argument("--list-fields", action="store_true", help="print every config section, key and default")

    from rlbolt.app.cli_plan import add_parser as add_plan_parser

    add_plan_parser(sub)
    from rlbolt.app.cli_launch import add_parser as add_launch_parser

    add_launch_parser(sub)

    resume = sub.add_parser("resume", help="continue a run from its latest checkpoint",
                            description="Continue the run in RUN_DIR from its newest usable checkpoint, using its "
                                        "config.yaml (metrics.jsonl and train.log are appended to). A setting "
                                        "that changes the math must match the checkpoint's, unless "
                                        "--allow-config-change.")
    resume.add_argument("run_dir", help="a run directory written by `rlbolt demo` or `rlbolt fit`")
    resume.add_argument("--max-steps", type=positive_int, help="the new total number of steps")
    resume.add_argument("--allow-config-change", action="store_true",
                        help="continue although config.yaml changed a setting that changes the math (model, plan, "
                             "algorithm, rollout, reward, data, seeds); the change is recorded in "
                             "config_changes.jsonl")

    plot = sub.add_parser("plot", help="PNGs of reward, KL, entropy, response length, stage times and the timeline",
                          description="Draw PNGs from RUN_DIR/metrics.jsonl (and the Gantt chart of "
                                      "RUN_DIR/timeline.jsonl) into RUN_DIR/plots (or --out).")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="output folder (default: RUN_DIR/plots)")

    export = sub.add_parser("export", help="write a Hugging Face folder from the latest checkpoint",
                            description="Write OUT (config.json + model.safetensors, and the tokenizer when "
                                        "the run used a tokenizer folder, or the demo's for a digit-task demo "
                                        "run) from RUN_DIR's newest usable checkpoint. A LoRA run writes its adapters merged into the base, or with --adapter "
                                        "the adapters alone in PEFT's layout. Reads only: safe while the run is "
                                        "training.")
    export.add_argument("run_dir")
    export.add_argument("out")
    export.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    export.add_argument("--adapter", action="store_true",
                        help="LoRA runs: write adapter_config.json + adapter_model.safetensors (PEFT, vLLM) "
                             "instead of the merged model")
    return parser


def split_overrides(extra: Sequence[str]) -> list[str]:
    """`--section.key=value` (or `section.key=value`) arguments -> `section.key=value` strings.

    Raises:
      CLIError: an argument that is not of that form.
    """
    out = []
    for arg in extra:
        text = arg[2:] if arg.startswith("--") else arg
        key = text.split("=", 1)[0]
        if "=" not in text or "." not in key or key.startswith("-"):
            raise CLIError(f"unrecognized argument {arg!r}; overrides look like --section.key=value "
                           "(e.g. --trainer.max_steps=10)")
        out.append(text)
    return out


# -- subcommands ------------------------------------------------------------------------------------
def demo_config(args: argparse.Namespace) -> DemoConfig:
    """The DemoConfig a parsed `rlbolt demo` command line asks for, resolved.

    Args:
      args: the parsed `rlbolt demo` arguments (`build_parser().parse_args`).

    Returns:
      The config: each flag given sets its field, every other field is the chosen task's default
      (`DemoConfig.resolved`).
    """
    from rlbolt.demo.config import DemoConfig

    given = {k: v for k, v in (("max_steps", args.max_steps), ("checkpoint_every", args.checkpoint_every),
                               ("seed", args.seed), ("task", args.task), ("lora_rank", args.lora_rank),
                               ("base_run", args.base_run)) if v is not None}
    return DemoConfig(**given).resolved()


def _cmd_demo(args: argparse.Namespace) -> int:
    from rlbolt.app.cli_run import run_demo

    config = demo_config(args)
    run_dir = args.run_dir or str(Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"rlbolt demo: task={config.task}, {config.max_steps} steps, run directory {run_dir}", flush=True)
    run_demo(config, run_dir, progress=not args.no_progress)
    return 0


def _cmd_fit(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from rlbolt.config import describe_fields, load_config

    if args.list_fields:
        print(describe_fields())
        return 0
    if args.config is None:
        raise CLIError("give a CONFIG file, e.g. `rlbolt fit recipes/configs/grpo_gsm8k.yaml`")
    from rlbolt.app.cli_run import run_config

    overrides = split_overrides(extra)
    cfg = load_config(args.config, overrides)
    if cfg.trainer.run_dir is None:  # fix the folder now so it can be checked before anything is built
        run_dir = str(Path("runs") / f"{cfg.algorithm.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        cfg = load_config(args.config, [*overrides, f"trainer.run_dir={run_dir}"])
    run_config(cfg)
    return 0


def _cmd_resume(args: argparse.Namespace) -> int:
    from rlbolt.app import rundir
    from rlbolt.demo.config import is_demo_config
    from rlbolt.utils import runlock
    from rlbolt.utils.jax_env import named_process_id

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CLIError(f"run directory {run_dir} does not exist")
    if not (run_dir / rundir.CONFIG_FILE).is_file():
        raise CLIError(rundir.not_a_run_message(run_dir))
    data = rundir.read_config(run_dir)
    # Before JAX is imported, a second writer is refused at once. Of a run's processes only process 0 locks (as
    # `rlbolt fit` does): the others would find their own process 0's lock on the same folder.
    section = data.get("distributed")
    process = named_process_id(section.get("process_id") if isinstance(section, dict) else None, os.environ)
    with runlock.hold(run_dir) if process in (None, 0) else contextlib.nullcontext():
        if is_demo_config(data):
            from rlbolt.app.cli_run import run_demo
            from rlbolt.demo.config import DemoConfig

            config = DemoConfig.from_dict(data)
            if args.max_steps is not None:
                config = dataclasses.replace(config, max_steps=args.max_steps)
            run_demo(config, run_dir, resume=True, allow_config_change=args.allow_config_change)
            return 0
        from rlbolt.app.cli_run import run_config
        from rlbolt.config import load_config

        overrides = [f"trainer.run_dir={run_dir}"]
        if args.max_steps is not None:
            overrides.append(f"trainer.max_steps={args.max_steps}")
        run_config(load_config(data, overrides), resume=True, allow_config_change=args.allow_config_change)
        return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from rlbolt.app.plotting import TOPICS, plot_metrics

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CLIError(f"run directory {run_dir} does not exist")
    out = Path(args.out) if args.out else run_dir / "plots"
    try:
        written = plot_metrics(run_dir / "metrics.jsonl", out)
    except ValueError as error:  # a malformed metrics line, named by read_jsonl
        raise CLIError(f"{error}; fix or remove that line") from None
    for path in written.values():
        print(path)
    if (run_dir / "timeline.jsonl").is_file():
        from rlbolt.app.gantt import plot_timeline

        gantt = plot_timeline(run_dir / "timeline.jsonl", out / "timeline.png")
        if gantt is not None:
            print(gantt)
    missing = [t for t in TOPICS if t not in written]
    if missing:
        print(f"(no data for: {', '.join(missing)})")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from rlbolt.app.cli_export import export_run

    if not Path(args.run_dir).is_dir():
        raise CLIError(f"run directory {args.run_dir} does not exist")
    out, step = export_run(args.run_dir, args.out, overwrite=args.overwrite, adapter=args.adapter)
    print(f"wrote {out} (checkpoint step {step})")
    return 0


_USER_ERRORS = (  # (module, class): bad input or a refusal, reported in one line with exit status 2
    ("rlbolt.app.rundir", "RunDirError"), ("rlbolt.plan", "PlanError"), ("rlbolt.demo.config", "DemoConfigError"),
    ("rlbolt.config.fields", "ConfigError"), ("rlbolt.utils.runlock", "RunDirBusy"),
    ("rlbolt.checkpointing.io", "NoUsableCheckpoint"), ("rlbolt.checkpointing.config_guard", "ConfigChanged"),
    ("rlbolt.checkpointing.meta", "FrozenParamsMismatch"),  # a LoRA resume or export on another base
    ("rlbolt.data.loaders", "DataFileError"),
    ("rlbolt.distributed.topology", "TopologyError"), ("rlbolt.app.cli_plan", "PlanInputError"),
    ("rlbolt.app.cli_launch", "LaunchError"),
)


_DISK_ERRORS = ("rlbolt.checkpointing.io.CheckpointWriteError", "rlbolt.app.cli_run.RunDiskFull")  # exit 1, one line
# User code that cannot run (an environment's reset or factory raised, or every episode / every
# reward failed for the configured number of batches): exit 1, one line (the traceback is in train.log).
_RUN_FAILURES = (*_DISK_ERRORS, "rlbolt.agents.failures.EnvFailureError", "rlbolt.rewards.runner.RewardFailureError")


def _user_errors() -> tuple[type[BaseException], ...]:
    # An exception's class is loaded once one was raised: looking in sys.modules imports nothing
    # (a refusal that comes before JAX is imported stays fast).
    found = [getattr(sys.modules[m], name) for m, name in _USER_ERRORS if m in sys.modules]
    return (CLIError, FileNotFoundError, FileExistsError, *found)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok, 1 failed, 2 bad input or refused,
    130 / 143 stopped by SIGINT / SIGTERM)."""
    from rlbolt.app.quiet import quiet_libraries
    from rlbolt.signals import RaiseOnSignal
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()  # before the first JAX computation: XLA reads the flags once
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("fit", "plan"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handlers = {"demo": _cmd_demo, "resume": _cmd_resume, "plot": _cmd_plot, "export": _cmd_export}
    debug = bool(os.environ.get("RLBOLT_DEBUG"))

    def fail(message: str, code: int) -> int:
        print(f"rlbolt {args.command}: {message}", file=sys.stderr, flush=True)
        return code

    with RaiseOnSignal(), quiet_libraries(enabled=not debug):
        try:
            if args.command == "fit":
                return _cmd_fit(args, extra)
            if args.command == "launch":
                from rlbolt.app.cli_launch import run_launch

                return run_launch(args)
            if args.command == "plan":
                from rlbolt.app.cli_plan import run_plan

                return run_plan(args, split_overrides(extra))
            return handlers[args.command](args)
        except _user_errors() as error:
            if debug:
                raise
            return fail("error: " + (_one_line(error) or type(error).__name__), EXIT_BAD_INPUT)
        except KeyboardInterrupt as error:  # rlbolt.signals.Interrupted: a signal outside a fit's loop
            return fail(f"{_one_line(error) or 'interrupted'}; nothing more was saved", 128 + getattr(error, "signum", 2))
        except Exception as error:
            kind = f"{type(error).__module__}.{type(error).__name__}"
            if kind == "rlbolt.app.cli_run.RunInterrupted":  # the run saved its last step, then stopped
                return fail(_one_line(error), error.exit_code)
            if kind in _RUN_FAILURES and not debug:
                return fail("error: " + _one_line(error), EXIT_FAILED)
            raise


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def run() -> None:
    """The `rlbolt` program: `main` on sys.argv, then exit with its status. After a failure was
    reported in its one line, the interpreter's shutdown writes nothing more to the terminal
    (`quiet.close_stderr`); RLBOLT_DEBUG=1 keeps everything."""
    code = main()
    if code != 0 and not os.environ.get("RLBOLT_DEBUG"):
        from rlbolt.app.quiet import close_stderr

        close_stderr()
    sys.exit(code)


if __name__ == "__main__":
    run()
