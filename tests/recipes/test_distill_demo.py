"""The distillation recipe end to end on a tiny teacher folder the test writes: the variants train
the same steps on the same rows, and only the distilling ones read the teacher."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from flax import nnx

from rlbolt.data import CharTokenizer
from rlbolt.data.char_tokenizer_files import save_char_tokenizer
from rlbolt.models import Decoder, tiny_config
from rlbolt.models.hf_io import save_hf
from rlbolt.demo.digits import target_match_reward

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "distill_demo.py"
TINY = "model.tiny={hidden_size: 32, intermediate_size: 64, head_dim: 8, num_layers: 1, max_position_embeddings: 10}"


def _load():
    spec = importlib.util.spec_from_file_location("recipe_distill_demo", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reward_is_the_share_of_digits_in_place():
    assert target_match_reward("3141", {"answer": "3141"}) == 1.0
    assert target_match_reward("3104", {"answer": "3141"}) == 0.5  # 3 and 1 in place, 0 and 4 not
    assert target_match_reward("31", {"answer": "3141"}) == 0.5  # a short completion loses the rest
    assert target_match_reward("", {"answer": "3141"}) == 0.0


def test_reward_and_distill_variants_run_the_same_budget(tmp_path):
    teacher = tmp_path / "teacher"
    model = Decoder(tiny_config(vocab_size=14, hidden_size=32, intermediate_size=64, head_dim=8, num_layers=1,
                                max_position_embeddings=10), rngs=nnx.Rngs(3))
    save_hf(model, model.config, teacher)
    save_char_tokenizer(CharTokenizer("0123456789="), teacher)
    recipe = _load()
    runs = recipe.main(["--teacher", str(teacher), "--out", str(tmp_path / "out"), "--steps", "2",
                        "--variants", "reward", "distill",
                        "--set", TINY, "plan.prompts_per_step=2", "plan.num_generations=4"])
    assert [r["variant"] for r in runs] == ["reward", "distill"]
    rows = (tmp_path / "out" / "rows.jsonl").read_text().splitlines()
    assert len(rows) == 2000 and json.loads(rows[0])["answer"] + "=" == json.loads(rows[0])["prompt"]
    for run in runs:
        metrics = [json.loads(line) for line in (tmp_path / "out" / f"{run['variant']}-seed0" / "metrics.jsonl")
                   .read_text().splitlines()]
        assert [m["step"] for m in metrics] == [1, 2]
        assert all(0.0 <= m["reward/mean"] <= 1.0 for m in metrics)
        assert ("distill/reverse_kl" in metrics[0]) == (run["variant"] == "distill")
    # Run again into the same folder: the earlier runs are replaced, not appended to.
    again = recipe.main(["--teacher", str(teacher), "--out", str(tmp_path / "out"), "--steps", "2",
                         "--variants", "distill", "--set", TINY, "plan.prompts_per_step=2", "plan.num_generations=4"])
    assert again[0]["marks"] == {} and len((tmp_path / "out" / "distill-seed0" / "metrics.jsonl")
                                            .read_text().splitlines()) == 2
