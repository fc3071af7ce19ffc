"""One process of a GRPO run on a CPU mesh, for the multi-device and multi-process tests.

    python tests/distributed/mp_worker.py --out OUT --run_dir RUN --devices 8 --steps 3
    python tests/distributed/mp_worker.py ... --devices 4 --num_processes 2 --process_id 0 --port 12345

Each process writes `OUT/result_<process>.npz` (the final params gathered whole, by path) and
`OUT/result_<process>.json` (per-step metrics, the files this process opened for writing outside
the checkpoint folder, the restored step). `--die_at_step K --die_process P` makes process P
SIGKILL itself after step K; `--checkpoint_every N` saves checkpoints (and resumes from the
newest one in RUN/checkpoints, whatever mesh wrote it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--run_dir", required=True)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--mesh", default="{}", help="a {data, fsdp, tp} dict as JSON")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--num_processes", type=int, default=1)
    ap.add_argument("--process_id", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--heartbeat_s", type=int, default=10)
    ap.add_argument("--checkpoint_every", type=int, default=0)
    ap.add_argument("--die_at_step", type=int, default=0)
    ap.add_argument("--die_process", type=int, default=1)
    ap.add_argument("--beta", type=float, default=0.04)
    args = ap.parse_args()

    written: set[str] = set()
    out_dir = Path(args.out).resolve()
    checkpoints = (Path(args.run_dir) / "checkpoints").resolve()

    def audit(event, event_args):  # every file this process opens for writing (Python-level)
        if event == "open" and isinstance(event_args[0], (str, bytes, os.PathLike)):
            mode = event_args[1] if len(event_args) > 1 and isinstance(event_args[1], str) else "r"
            flags = event_args[2] if len(event_args) > 2 and isinstance(event_args[2], int) else 0
            if any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                path = Path(os.fsdecode(event_args[0])).resolve()
                if out_dir not in path.parents and checkpoints not in path.parents and path != checkpoints:
                    written.add(str(path))

    sys.addaudithook(audit)

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    from rlbolt.distributed import initialize

    if args.num_processes > 1:
        initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.num_processes,
                   process_id=args.process_id, heartbeat_timeout_s=args.heartbeat_s)
    import numpy as np
    from flax import nnx

    from rlbolt.callback import Callback
    from rlbolt.callbacks import MetricsLogger, ModelCheckpoint
    from rlbolt.data import gsm8k_style_rows
    from rlbolt.distributed import gather_to_host
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    def digits(completion: str, sample) -> float:  # a dense reward: the fraction of digit characters
        return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)

    steps: list[dict] = []

    def dump(name, tree):  # the params gathered whole, by path (a collective: every process calls it)
        flat = {".".join(map(str, path)): np.asarray(v.get_value() if isinstance(v, nnx.Variable) else v)
                for path, v in nnx.to_flat_state(gather_to_host(tree))}
        out_dir.mkdir(parents=True, exist_ok=True)
        np.savez(out_dir / f"{name}_{jax.process_index()}.npz", **flat)

    class Record(Callback):
        def on_fit_start(self, trainer, state):
            if state.step:
                dump("restored", state.params)

        def on_step_end(self, trainer, info):
            steps.append({k: float(v) for k, v in info.metrics.items() if not k.startswith(("time/", "throughput/"))})
            if args.checkpoint_every and info.step % args.checkpoint_every == 0:
                dump(f"step{info.step}", info.state.params)
            if args.die_at_step and info.step == args.die_at_step and jax.process_index() == args.die_process:
                os.kill(os.getpid(), signal.SIGKILL)

    module = GRPO({"rollout": {"max_new_tokens": 8}, "algorithm": {"lr": 1e-3, "beta": args.beta},
                   "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                                      "num_kv_heads": 2, "head_dim": 8}}},
                  reward=digits)
    callbacks = [Record(), MetricsLogger(writer=["jsonl"])]
    if args.checkpoint_every:
        callbacks.append(ModelCheckpoint(every_n_steps=args.checkpoint_every, async_save=False, keep=None))
    plan = BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8)
    trainer = Trainer(plan, max_steps=args.steps, mesh=json.loads(args.mesh), callbacks=callbacks, run_dir=args.run_dir)
    state = trainer.fit(module, gsm8k_style_rows(32))
    dump("result", state.params)
    restored = [cb.restored_step for cb in trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    pid = jax.process_index()
    (out_dir / f"result_{pid}.json").write_text(json.dumps({
        "steps": steps, "written": sorted(written), "restored_step": restored[0] if restored else None,
        "final_step": state.step, "data_position": state.data_position, "policy_version": state.policy_version,
        "mesh": dict(trainer.sharding.mesh.shape), "process_count": jax.process_count()}))


if __name__ == "__main__":
    main()
