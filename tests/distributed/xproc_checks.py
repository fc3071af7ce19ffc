"""One process of a GRPO fit with train and rollout on separate process groups (sync mode).

    rlbolt launch --local 4 --devices-per-process 1 -- python tests/distributed/xproc_checks.py OUT
    python tests/distributed/xproc_checks.py OUT --devices 4        the same placement in one process

Placement: train on devices [0, 2) (fsdp=2), rollout on [2, 4) (fsdp=2); the reference with
train. With 4 processes of one CPU device each that is processes 0, 1 (training group) and 2, 3
(rollout group). GRPO (AdamW, beta 0.04) on a tiny decoder, 3 steps, 4 prompts x 4 generations.
Files: `OUT/params.npz` (the final params, gathered whole within the training group, by path),
`OUT/steps.json` (per step: the metrics that do not measure time, the completion ids trained on),
written by process 0; `OUT/role_<process>.json` (the process's group and the steps it rolled out
or trained).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import jax


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--devices", type=int, default=0, help="CPU devices of a one-process run (0: the launcher's)")
    args = ap.parse_args()
    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    from rlbolt.distributed import initialize

    initialize()
    import numpy as np
    from flax import nnx

    from rlbolt.callback import Callback
    from rlbolt.data import gsm8k_style_rows
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def digits(completion: str, sample) -> float:  # a dense reward: the fraction of digit characters
        return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)

    steps: list[dict] = []

    class Record(Callback):
        def on_step_end(self, run, info):
            metrics = {k: float(v) for k, v in info.metrics.items() if not k.startswith(("time/", "throughput/"))}
            steps.append({"metrics": metrics, "completions": np.asarray(info.batch["completion_ids"]).tolist()})

    module = GRPO({"rollout": {"max_new_tokens": 8}, "algorithm": {"lr": 1e-3, "beta": 0.04},
                   "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                                      "num_kv_heads": 2, "head_dim": 8}}}, reward=digits)
    placement = {"train": {"devices": [0, 2], "mesh": {"fsdp": 2}}, "rollout": {"devices": [2, 4], "mesh": {"fsdp": 2}}}
    plan = BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8)
    trainer = Trainer(plan, max_steps=3, callbacks=[Record()], run_dir=out / "run", placement=placement)
    state = trainer.fit(module, gsm8k_style_rows(16))
    role = "train" if trainer.groups is None else trainer.groups.role
    (out / f"role_{jax.process_index()}.json").write_text(json.dumps({
        "role": role, "trained_steps": len(steps), "process_count": jax.process_count(),
        "pid": os.getpid()}))
    if role != "train":
        return
    flat = nnx.to_flat_state(state.params)
    mesh = trainer.sharding.mesh
    whole = jax.jit(lambda xs: xs, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(
        [v.get_value() for _, v in flat])  # within the training group: the rollout group holds none of it
    if jax.process_index() == 0:
        np.savez(out / "params.npz", **{".".join(map(str, path)): np.asarray(x.addressable_data(0))
                                        for (path, _), x in zip(flat, whole)})
        (out / "steps.json").write_text(json.dumps(steps))


if __name__ == "__main__":
    main()
