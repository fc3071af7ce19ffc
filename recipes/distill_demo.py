"""On-policy distillation on the demo's copy task, against learning from the reward alone.

Run: `python recipes/distill_demo.py [--teacher DIR] [--out DIR] [--seeds 0 1] [--steps N]
[--variants reward distill mixed] [--set section.key=value ...]` (CPU: about a minute per variant
and seed, plus half a minute for the teacher).

1. The teacher: the built-in demo (`rlbolt demo`: copy 4 digits, GRPO with per-digit process
   advantages, 300 steps) trained and exported as a Hugging Face folder with its tokenizer
   (`rlbolt export`), unless `--teacher` names such a folder.
2. The students: a fresh model of the demo's shape (configs/distill_demo.yaml), the same rows,
   16 prompts x 8 samples per step, the same optimizer and steps for every variant:
   - `reward`: GRPO on the reward alone (the share of digits in place, one reward per sample);
   - `distill`: the teacher's per-token reverse KL alone (`algorithm.distill_teacher`);
   - `mixed`: the reverse KL plus the reward's group advantage (`distill_task_coef=1`).
3. A table of reward/mean (the mean of the 10 steps up to each step), the first step whose
   reward/mean reaches 0.9, and the seconds of each fit, then one JSON line.

Where this departs from the papers (Thinking Machines' on-policy distillation; GKD, arXiv
2306.13649): the signal is the sampled token's k1 reverse-KL estimate, not the full-vocabulary
divergence (see `rlbolt.algorithms.distillation`), and the student is the teacher's size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rlbolt.app.build import build_run
from rlbolt.config import load_config
from rlbolt.loggers import read_jsonl

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "distill_demo.yaml"
VARIANTS = {
    "reward": [],
    "distill": ["algorithm.distill_teacher={teacher}"],
    "mixed": ["algorithm.distill_teacher={teacher}", "algorithm.distill_task_coef=1.0"],
}
MARKS = (10, 25, 50, 100, 150, 200, 300)


def train_teacher(out: Path, seed: int = 0) -> Path:
    """Trains the default demo into `out/teacher-run` and exports it to `out/teacher`."""
    from rlbolt.app.cli_export import export_run
    from rlbolt.app.cli_run import run_demo
    from rlbolt.demo.config import DemoConfig

    run_dir, folder = out / "teacher-run", out / "teacher"
    if not folder.is_dir():
        run_demo(DemoConfig(seed=seed), run_dir, progress=False)
        export_run(run_dir, folder)
    return folder


def write_rows(path: Path, num_prompts: int = 2000, seed: int = 0) -> Path:
    """The demo's copy prompts as `{"prompt": "3141=", "answer": "3141"}` jsonl rows."""
    from rlbolt.demo.config import DemoConfig
    from rlbolt.demo.digits import demo_rows

    rows = demo_rows(DemoConfig(num_prompts=num_prompts, seed=seed))
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["target"]}) + "\n" for r in rows))
    return path


def run_variant(name: str, teacher: Path, rows: Path, run_dir: Path, seed: int, steps: int,
                config: Path = DEFAULT_CONFIG, extra: Sequence[str] = ()) -> dict:
    """Trains one student into a fresh `run_dir` (an earlier one is removed); returns its per-step
    reward/mean and distill/reverse_kl, and the fit's seconds."""
    if run_dir.exists():  # metrics.jsonl appends: a leftover run would prefix its steps
        shutil.rmtree(run_dir)
    overrides = [o.format(teacher=teacher) for o in VARIANTS[name]] + [
        f"data.train={rows}", f"model.tokenizer={teacher}", f"trainer.seed={seed}", f"trainer.max_steps={steps}",
        f"trainer.run_dir={run_dir}", *extra]
    module, trainer, train_rows, val_rows = build_run(load_config(config, overrides))
    start = time.perf_counter()
    trainer.fit(module, train_rows, val_rows)
    seconds = time.perf_counter() - start
    lines = read_jsonl(run_dir / "metrics.jsonl")
    rewards = [m["reward/mean"] for m in lines if "reward/mean" in m]
    kls = [m["distill/reverse_kl"] for m in lines if "distill/reverse_kl" in m]
    return {"variant": name, "seed": seed, "seconds": seconds, "rewards": rewards, "reverse_kl": kls}


def summary(result: dict) -> dict:
    """Reward at the marks (mean of the 10 steps up to each), first step >= 0.9, seconds."""
    r = np.asarray(result["rewards"], np.float64)
    marks = {m: float(r[max(0, m - 10):m].mean()) for m in MARKS if m <= len(r)}
    hit = np.flatnonzero(r >= 0.9)
    return {"variant": result["variant"], "seed": result["seed"], "marks": marks,
            "first_0.9": int(hit[0]) + 1 if hit.size else None, "seconds": round(result["seconds"], 1),
            "last_kl": float(np.mean(result["reverse_kl"][-10:])) if result["reverse_kl"] else None}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Runs the comparison (see the module docstring); returns one summary per run."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", type=Path, help="a teacher folder (default: train and export the demo)")
    parser.add_argument("--out", type=Path, default=Path("runs/distill_demo"), help="where runs go")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="section.key=value overrides for every student, e.g. --set trainer.max_steps=50")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    teacher = (args.teacher or train_teacher(args.out)).resolve()
    rows = write_rows(args.out / "rows.jsonl")
    out = []
    for seed in args.seeds:
        for name in args.variants:
            run_dir = args.out / f"{name}-seed{seed}"
            result = summary(run_variant(name, teacher, rows, run_dir, seed, args.steps, args.config, args.set))
            out.append(result)
            print(f"{name:8s} seed {seed}: " + "  ".join(f"@{m} {v:.3f}" for m, v in result["marks"].items())
                  + f"  first>=0.9: {result['first_0.9']}  {result['seconds']} s", flush=True)
    print(json.dumps({"recipe": "distill_demo", "steps": args.steps, "runs": out}))
    return out


if __name__ == "__main__":
    main()
