"""A run trained from a `.gguf` model on a generated reasoning-gym task, through `rlbolt fit`, and
its export as a normal Hugging Face folder that transformers loads (the wiring of
`models/gguf_io.py`, `data/reasoning_gym.py` and the `task` reward term into the command)."""

from __future__ import annotations

import json

import pytest
import yaml

pytest.importorskip("gguf")
pytest.importorskip("reasoning_gym")

from rlbolt.app.cli import main  # noqa: E402
from rlbolt.config import ConfigError, load_config  # noqa: E402
from rlbolt.loggers import read_jsonl  # noqa: E402


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny Qwen2 GGUF (Q8_0) with a byte-level BPE vocabulary, written by the GGUF tests' own writer."""
    import gguf
    from models.test_gguf import build_family_model, write_gguf
    from models.test_gguf_tokenizer import add_tokenizer_metadata, train_reference

    folder = tmp_path_factory.mktemp("gguf")
    reference = train_reference("qwen2", folder)
    model = build_family_model("qwen2_bias", vocab_size=reference.get_vocab_size(with_added_tokens=True))
    write_gguf(folder / "m.gguf", "qwen2_bias", model, gguf.GGMLQuantizationType.Q8_0,
               add_tokenizer=lambda writer: add_tokenizer_metadata(writer, reference, "qwen2"))
    return folder / "m.gguf"


def test_fit_from_a_gguf_on_a_task_then_export(gguf_file, tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    assert main(["fit", "recipes/configs/grpo_gsm8k.yaml", f"--model.path={gguf_file}", "--model.tiny={}",
                 "--data.train=reasoning_gym:chain_sum", "--data.val=reasoning_gym:chain_sum",
                 "--data.task_train_size=16", "--data.task_val_size=4", "--reward.weights={task: 1.0}",
                 "--trainer.max_steps=2", "--trainer.val_every_n_steps=null", f"--trainer.run_dir={run_dir}",
                 "--rollout.max_new_tokens=4", "--rollout.val_num_samples=1", "--data.system_prompt=null",
                 "--callbacks.progress=false", "--callbacks.metrics=[jsonl]"]) == 0
    records = read_jsonl(run_dir / "metrics.jsonl", merge_steps=False)
    assert [r["step"] for r in records if "reward/mean" in r] == [1, 2]
    assert any("val/accuracy" in r for r in records)  # graded by the task's own scorer
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["data"]["train"] == "reasoning_gym:chain_sum" and config["model"]["path"] == str(gguf_file)
    assert main(["export", str(run_dir), str(out)]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file()
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("12 + 7 =")["input_ids"]  # the GGUF's vocabulary, as HF files
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def test_task_specs_are_checked():
    from rlbolt.app.build import load_data

    with pytest.raises(ConfigError, match="data.val=reasoning_gym:products: .*set data.val=reasoning_gym:chain_sum"):
        load_data(load_config({"data": {"train": "reasoning_gym:chain_sum", "val": "reasoning_gym:products"}}))
    with pytest.raises(ConfigError, match="data.val=reasoning_gym:products draws .* set data.train to the same"):
        load_data(load_config({"data": {"val": "reasoning_gym:products"}}))
    with pytest.raises(ConfigError, match="data.train=reasoning_gym:no_such_task"):
        load_data(load_config({"data": {"train": "reasoning_gym:no_such_task"}}))
    train, val = load_data(load_config({"data": {"train": "reasoning_gym:chain_sum", "task_train_size": 5}}))
    assert len(train) == 5 and val is None and {"question", "answer", "task"} <= set(train[0])
