"""One process of a GRPO fit with train and rollout on separate process groups (sync or async mode).

    rlbolt launch --local 4 --devices-per-process 1 -- python tests/distributed/xproc_checks.py OUT
    python tests/distributed/xproc_checks.py OUT --devices 4        the same placement in one process
    ... xproc_checks.py OUT --mode async      async mode, max_staleness 1 (lag 1), with rollout correction (tis)
    ... xproc_checks.py OUT --dapo            DAPO's dynamic sampling: half the prompts (in pairs) score one value
                                              for every sample, their groups are dropped, refill rounds fill the step

Placement: train on devices [0, 2) (fsdp=2), rollout on [2, 4) (fsdp=2); the reference with
train. With 4 processes of one CPU device each that is processes 0, 1 (training group) and 2, 3
(rollout group). GRPO (AdamW, beta 0.04) on a tiny decoder, 3 steps, 4 prompts x 4 generations.
Files: `OUT/params.npz` (the final params, gathered whole within the training group, by path),
`OUT/steps.json` (per step: the metrics that do not measure time, the completion ids trained on),
written by process 0; `OUT/role_<process>.json` (the process's group and the steps it rolled out
or trained).

Faults (tests/distributed/test_group_faults.py): `RLBOLT_XPROC_FAULT=kill:P` SIGKILLs process P at
step 2 (index 1): a training process at the start of its update, a rollout process at its first
rollout after the second weight push (async, lag 1: step index 2); `stop:P` SIGSTOPs it there instead;
`killput:P` SIGKILLs rollout process P in the put of that rollout's first micro batch, once its first row
has crossed to the training process's Flight dock (the rest of the micro batch never does);
`killsave:P:S` SIGKILLs training process P inside the checkpoint of step S, once its own shards are
written and before the commit (Orbax's barrier before the primary renames the step into place: the
worst moment). `RLBOLT_XPROC_CHECKPOINT=N` adds a ModelCheckpoint every N steps (keep all), which
resumes from the newest checkpoint in `OUT/run/checkpoints` when the same command runs again;
`RLBOLT_XPROC_SEED=S` runs with `trainer.seed` S (data_seed stays 0) and lets a resume change it
(`allow_config_change`), `RLBOLT_XPROC_BETA` sets the KL coefficient (0.04). `RLBOLT_XPROC_DEADLINE_S`
sets `prefetch_timeout_s` (the wait between the groups), `RLBOLT_XPROC_HEARTBEAT_S` the
coordination service's heartbeat timeout (default 30 s). Every process writes `OUT/pid_<process>`
at start, and process 0 logs `OUT/run/metrics.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import jax


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--devices", type=int, default=0, help="CPU devices of a one-process run (0: the launcher's)")
    ap.add_argument("--mode", default="sync", choices=("sync", "async"))
    ap.add_argument("--dapo", action="store_true", help="DAPO with refill rounds (a parity reward)")
    args = ap.parse_args()
    if args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    from rlbolt.distributed import initialize

    initialize(heartbeat_timeout_s=int(os.environ.get("RLBOLT_XPROC_HEARTBEAT_S", "30")))
    import numpy as np
    from flax import nnx

    from rlbolt.callback import Callback
    from rlbolt.data import gsm8k_style_rows
    from rlbolt.modules import DAPO, GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pid_{jax.process_index()}").write_text(str(os.getpid()))
    _inject_fault(os.environ.get("RLBOLT_XPROC_FAULT", ""))
    deadline = os.environ.get("RLBOLT_XPROC_DEADLINE_S")

    def digits(completion: str, sample) -> float:  # a dense reward: the fraction of digit characters
        return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)

    def parity(completion: str, sample) -> float:
        # Prompts in pairs: 0-1, 4-5, ... score one value for every sample (their groups are dropped), 2-3, 6-7, ...
        # spread. A step then always misses whole pairs, so a refill round draws the same prompts on one process
        # as on two data shares (which round each round up to a multiple of 2 prompts).
        if sample["prompt_index"] // 2 % 2 == 0:
            return 1.0
        return float(sum(map(ord, completion)) % 7)

    steps: list[dict] = []

    class Record(Callback):
        def on_step_end(self, run, info):
            metrics = {k: float(v) for k, v in info.metrics.items() if not k.startswith(("time/", "throughput/"))}
            steps.append({"step": info.step, "metrics": metrics,
                          "completions": np.asarray(info.batch["completion_ids"]).tolist()})

    beta = float(os.environ.get("RLBOLT_XPROC_BETA", "0.04"))
    algorithm = {"lr": 1e-3, "beta": beta, **({"rollout_correction": "tis"} if args.mode == "async" else {})}
    if args.dapo:
        algorithm["overlong_cache_length"] = 0  # its shaping would spread the constant groups' rewards
    module = (DAPO if args.dapo else GRPO)({"rollout": {"max_new_tokens": 8}, "algorithm": algorithm,
                                            "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64,
                                                               "num_heads": 4, "num_kv_heads": 2, "head_dim": 8}}},
                                           reward=parity if args.dapo else digits)
    placement = {"train": {"devices": [0, 2], "mesh": {"fsdp": 2}}, "rollout": {"devices": [2, 4], "mesh": {"fsdp": 2}}}
    plan = BatchPlan(prompts_per_step=4, num_generations=4, train_micro_batch_size=8,
                     max_refill_rounds=4 if args.dapo else 0)
    from rlbolt.callbacks import MetricsLogger, ModelCheckpoint

    callbacks = [Record(), MetricsLogger(writer=["jsonl"], every_n_steps=1)]
    if os.environ.get("RLBOLT_XPROC_CHECKPOINT"):
        callbacks.append(ModelCheckpoint(every_n_steps=int(os.environ["RLBOLT_XPROC_CHECKPOINT"]), keep=None,
                                         allow_config_change="RLBOLT_XPROC_SEED" in os.environ))
    seed = int(os.environ.get("RLBOLT_XPROC_SEED", "0"))
    trainer = Trainer(plan, max_steps=3, callbacks=callbacks, run_dir=out / "run", placement=placement,
                      seed=seed, data_seed=0, shuffle=not args.dapo,  # dapo: prompt_index is the draw order
                      mode=args.mode, max_staleness=1 if args.mode == "async" else None,
                      prefetch_timeout_s=None if deadline is None else float(deadline))
    state = trainer.fit(module, gsm8k_style_rows(48 if args.dapo else 16))
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


def _inject_fault(fault: str) -> None:
    """`kill:P` / `stop:P`: process P sends itself SIGKILL / SIGSTOP at step index 1 (see the module doc)."""
    if not fault:
        return
    how, target, *at = fault.split(":")
    if int(target) != jax.process_index():
        return
    sig = {"kill": signal.SIGKILL, "killsave": signal.SIGKILL, "killput": signal.SIGKILL, "stop": signal.SIGSTOP}[how]
    out = Path(sys.argv[1])

    def fault() -> None:
        (out / "fault_at").write_text(repr(time.time()))  # when, for the test's bound on the launcher's exit
        os.kill(os.getpid(), sig)

    if how == "killsave":
        _kill_inside_save(int(at[0]), fault)
        return

    from rlbolt.distributed.process_groups import ProcessGroups
    from rlbolt.modules import GRPO
    from rlbolt.trainer import Trainer

    train_on, on_rollout, receive = Trainer._train_on, GRPO.on_rollout, ProcessGroups.receive_weights
    pushes = [0]

    def train_on_then_fault(self, state, produced):
        if int(state.step) == 1:  # the update of step 2
            fault()
        return train_on(self, state, produced)

    def receive_counted(self, abstract):
        pushes[0] += 1
        return receive(self, abstract)

    def on_rollout_then_fault(self, params, batch):
        if pushes[0] == 2:  # the rollout of step 2, after the weights of step 1
            fault()
        return on_rollout(self, params, batch)

    ProcessGroups.receive_weights = receive_counted
    if how == "killput":
        _kill_mid_put(pushes, fault)
        return
    Trainer._train_on, GRPO.on_rollout = train_on_then_fault, on_rollout_then_fault


def _kill_mid_put(pushes: list[int], fault) -> None:
    """Runs `fault` inside the first Flight put after the second push: its micro batch's columns go one row
    per message, and the fault comes once the first message is written."""
    from rlbolt.distributed.group_rows import FlightRows
    from rlbolt.producer.dock.flight import wire

    put, whole = FlightRows.put, wire.messages

    def one_row_then_fault(batch):
        yield batch.slice(0, 1)
        fault()

    def put_then_fault(self, key, rows):
        if pushes[0] == 2:
            wire.messages = one_row_then_fault
        put(self, key, rows)
        wire.messages = whole

    FlightRows.put = put_then_fault


def _kill_inside_save(step: int, fault) -> None:
    """Runs `fault` in Orbax's background save of `step`: after this process's shards are on disk (its
    commit futures done), before the barrier at which the primary waits to rename the step into place."""
    from orbax.checkpoint._src.checkpointers import async_checkpointer
    from orbax.checkpoint._src.futures import future

    wait = async_checkpointer._background_wait_for_commit_futures

    def wait_then_fault(directory, commit_futures, on_commit_callback, **kwargs):
        if directory.name == str(step):
            future.ChainedFuture(commit_futures, cb=lambda: None).result(timeout=kwargs["timeout_secs"])
            fault()
        return wait(directory, commit_futures, on_commit_callback, **kwargs)

    async_checkpointer._background_wait_for_commit_futures = wait_then_fault


if __name__ == "__main__":
    main()
