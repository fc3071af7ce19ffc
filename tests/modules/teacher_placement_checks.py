"""The distillation teacher on devices of its own, on 8 CPU devices; run in a fresh process with
XLA_FLAGS=--xla_force_host_platform_device_count=8, prints one JSON line.

    python tests/modules/teacher_placement_checks.py setup FOLDER   set-up, one logps batch, the error
    python tests/modules/teacher_placement_checks.py fit FOLDER     a 2-step fit each way

FOLDER is an empty folder for the teacher this script writes (a tiny Hugging Face folder with a
character tokenizer). Every role is a 2-device fsdp mesh, so the teacher forward sums floats as
the colocated run on devices 0-1 does. Reported for `placement.teacher: train` (colocated, the
teacher on the training devices) and for the teacher on devices 4-5: where the teacher's
parameters live, each device's live bytes after set-up, the memory plan's items, the teacher
logps of one batch and a 2-step fit's metrics; and the one-line error for logps micro batches
that do not split over the teacher mesh.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import jax
import numpy as np

TWO = {"fsdp": 2}
APART = {"train": {"devices": [0, 2], "mesh": TWO}, "rollout": {"devices": [2, 4], "mesh": TWO},
         "teacher": {"devices": [4, 6], "mesh": TWO}}
SHARED = {"train": {"devices": [0, 2], "mesh": TWO}, "rollout": {"devices": [2, 4], "mesh": TWO}}
TINY = {"hidden_size": 32, "intermediate_size": 64, "head_dim": 8, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2}
ROWS = [{"prompt": f"{i:04d}=", "answer": f"{i:04d}"} for i in range(1234, 1234 + 16 * 37, 37)]


def write_teacher(folder: Path) -> Path:
    from flax import nnx

    from rlbolt.data import CharTokenizer
    from rlbolt.data.char_tokenizer_files import save_char_tokenizer
    from rlbolt.models import Decoder, tiny_config
    from rlbolt.models.hf_io import save_hf

    teacher = Decoder(tiny_config(vocab_size=14, **TINY), rngs=nnx.Rngs(7))
    save_hf(teacher, teacher.config, folder)
    save_char_tokenizer(CharTokenizer("0123456789="), folder)
    return folder


def _trainer(teacher: Path, placement, steps=2, record=(), **sizes):
    from rlbolt.modules import GRPO
    from rlbolt.demo.digits import target_match_reward
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    module = GRPO({"algorithm": {"distill_teacher": str(teacher), "lr": 1e-3},
                   "model": {"tokenizer": str(teacher), "tiny": TINY},
                   "rollout": {"max_new_tokens": 4, "stop_at_eos": False},
                   "data": {"prompt_field": "prompt", "max_prompt_tokens": 5, "use_chat_template": False},
                   "reward": {"executor": "thread"}}, reward=target_match_reward)
    plan = BatchPlan(**{"prompts_per_step": 4, "num_generations": 4, "train_micro_batch_size": 8, **sizes})
    trainer = Trainer(plan, max_steps=steps, callbacks=list(record), run_dir="unused", placement=placement)
    return trainer, module


def _device_bytes() -> dict[int, int]:
    out: dict[int, int] = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def _token_batch(n=8):
    from rlbolt.batch import Batch

    rng = np.random.default_rng(3)
    return Batch(prompt_ids=rng.integers(3, 14, size=(n, 5)).astype(np.int32), prompt_mask=np.ones((n, 5), bool),
                 completion_ids=rng.integers(3, 14, size=(n, 4)).astype(np.int32),
                 completion_mask=np.arange(4)[None, :] < rng.integers(1, 5, size=(n, 1)),
                 sampler_logps=np.zeros((n, 4), np.float32))


def setup_case(teacher: Path, placement) -> dict:
    gc.collect()
    before = _device_bytes()
    trainer, module = _trainer(teacher, placement)
    trainer._setup(module, ROWS, None)
    gc.collect()
    after = _device_bytes()
    leaves = jax.tree.leaves(module.teacher_params)
    shard_bytes: dict[str, int] = {}
    for leaf in leaves:
        for shard in leaf.addressable_shards:
            shard_bytes[str(shard.device.id)] = shard_bytes.get(str(shard.device.id), 0) + shard.data.nbytes
    params = module.init_params(jax.random.key(0))
    logps = module.compute_logps(params, _token_batch())["teacher_logps"]
    return {"teacher_devices": sorted({d.id for x in leaves for d in x.sharding.device_set}),
            "teacher_total_bytes": sum(x.nbytes for x in leaves), "teacher_shard_bytes": shard_bytes,
            "live_bytes": {str(d): after.get(d, 0) - before.get(d, 0) for d in range(8)},
            "memory_items": sorted(trainer.memory_plan.items), "teacher_logps": np.asarray(logps).tolist()}


def fit_case(teacher: Path, placement) -> list[dict]:
    from rlbolt.callback import Callback

    rows = []

    class Record(Callback):
        def on_step_end(self, trainer, info):
            rows.append({k: float(info.metrics[k]) for k in ("loss", "reward/mean", "grad_norm", "distill/reverse_kl")})

    trainer, module = _trainer(teacher, placement, record=[Record()])
    trainer.fit(module, ROWS)
    return rows


def errors(teacher: Path) -> list[str]:
    out = []
    odd = {**APART, "teacher": {"devices": [4, 8], "mesh": {"fsdp": 4}}}
    trainer, module = _trainer(teacher, odd, prompts_per_step=3, train_micro_batch_size=6, logps_micro_batch_size=6)
    try:  # logps micro batches of 6 rows cannot split over the teacher mesh's 4 batch shards
        trainer.fit(module, ROWS)
    except ValueError as error:
        out.append(str(error))
    return out


if __name__ == "__main__":
    what, folder = sys.argv[1], write_teacher(Path(sys.argv[2]))
    result = {"devices": len(jax.devices())}
    if what == "setup":
        result.update(shared=setup_case(folder, SHARED), apart=setup_case(folder, APART), errors=errors(folder))
    else:
        result.update(shared=fit_case(folder, SHARED), apart=fit_case(folder, APART))
    print(json.dumps(result))
