"""HFExport: a tiny GRPO fit exports step_<n>/ and final/ folders that transformers loads with
the same logits as the rlbolt Decoder holding that step's params; the module's model is untouched."""

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from tokenizers import Tokenizer
from tokenizers import models as tokenizer_models

from float_tolerance import decoder_tolerance
from models.test_hf_config import rlbolt_logits
from rlbolt.callback import Callback
from rlbolt.callbacks import HFExport
from rlbolt.callbacks.hf_export import with_params
from rlbolt.data.tasks import gsm8k_style_rows
from rlbolt.modules import GRPO
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "intermediate_size": 64}
CONFIG = {"model": {"tiny": TINY}, "rollout": {"max_new_tokens": 4, "val_num_samples": 1}, "algorithm": {"lr": 0.05},
          "reward": {"weights": {"answer": 1.0, "digits": 1.0}}, "data": {"max_prompt_tokens": 32}}


class Record(Callback):
    def __init__(self):
        self.params, self.initial = {}, None

    def on_fit_start(self, trainer, state):
        self.initial = jax.tree.map(np.asarray, state.params)

    def on_step_end(self, trainer, info):
        self.params[info.step] = info.state.params


def _hf_logits(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids.astype(np.int64))).logits.numpy()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    tokenizer_dir = root / "tok"
    tokenizer_dir.mkdir()
    Tokenizer(tokenizer_models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(tokenizer_dir / "tokenizer.json"))
    record, export = Record(), HFExport(root / "hf", every_n_steps=1, tokenizer_folder=tokenizer_dir)
    module = GRPO(CONFIG)
    Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=2, callbacks=[record, export],
            run_dir=root / "run").fit(module, gsm8k_style_rows(8))
    return module, record, export, root / "hf"


def test_folders_written_per_step_and_at_end(exported):
    _, _, export, hf = exported
    assert export.exported == [(1, hf / "step_1"), (2, hf / "step_2"), (2, hf / "final")]
    for folder in ("step_1", "step_2", "final"):
        names = {p.name for p in (hf / folder).iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not [p for p in hf.iterdir() if p.name.startswith(".")]  # no staging folders left


@pytest.mark.parametrize("step, folder", [(1, "step_1"), (2, "step_2"), (2, "final")])
def test_transformers_loads_each_export(exported, step, folder):
    module, record, _, hf = exported
    ids = np.random.default_rng(step).integers(0, module.model.config.vocab_size, size=(2, 7))
    ours = rlbolt_logits(with_params(module.model, record.params[step]), ids)  # jitted, as the trainer runs it
    np.testing.assert_allclose(_hf_logits(hf / folder, ids), ours, rtol=0,
                               atol=decoder_tolerance(ours, module.model.config, ids.shape[1]))


def test_steps_differ_and_module_model_untouched(exported):
    module, record, _, hf = exported
    ids = np.arange(12).reshape(2, 6) % module.model.config.vocab_size
    assert np.abs(_hf_logits(hf / "step_1", ids) - _hf_logits(hf / "step_2", ids)).max() > 1e-4
    now = jax.tree.leaves(jax.tree.map(np.asarray, nnx.state(module.model, nnx.Param)))
    for got, want in zip(now, jax.tree.leaves(record.initial)):
        np.testing.assert_array_equal(got, want)


def test_needs_a_model(tmp_path):
    from toy_module import ToyModule, prompt_rows

    with pytest.raises(ValueError, match=r"HFExport needs the module's language model, but ToyModule.card\(\) returned None"):
        Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=1, callbacks=[HFExport(tmp_path)]).fit(
            ToyModule(), prompt_rows(4))
