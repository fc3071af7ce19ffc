"""Runs made with `Trainer.fit` from a Python script (no config.yaml, no train.log):

- `rlbolt export` works from the checkpoint alone (it records the model's config) and writes
  exactly what `save_hf` writes for the trained model (whose loading in `transformers` is
  tested in tests/models and tests/cli/test_cli_resume_export.py);
- `rlbolt resume` says in one line how a script run resumes (run the script again);
- rerunning a script whose run already reached max_steps trains nothing and logs nothing;
- a policy nested in the trainable pytree (PPO's {"policy", "value_head"}) exports too.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rlbolt.app.cli import main
from rlbolt.demo import DemoConfig, DigitsGRPO, demo_rows
from rlbolt.callback import CallbackList
from rlbolt.callbacks import MetricsLogger, ModelCheckpoint
from rlbolt.loggers import read_jsonl
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

# The shapes of tests/cli/test_cli_resume_export.py's run: in one pytest process they share its compilations.
SMALL = DemoConfig(max_steps=2, prompts_per_step=4, num_generations=4, num_prompts=64)


def script(run_dir):
    """What a user's script does: no config.yaml, a checkpoint callback, val data."""
    module = DigitsGRPO(SMALL)
    # 16 validation prompts in one batch: the shape of a rollout batch (4 x 4), no extra compile.
    trainer = Trainer(BatchPlan(4, 4), max_steps=2, seed=1, run_dir=run_dir, val_every_n_steps=1, val_batch_size=16,
                      callbacks=[ModelCheckpoint(), MetricsLogger(writer=["jsonl"])])
    state = trainer.fit(module, demo_rows(SMALL), val_data=demo_rows(SMALL)[:16])
    return module, state


@pytest.fixture(scope="module")
def script_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("script") / "run"
    module, state = script(run_dir)
    return run_dir, module, state


def test_export_of_a_script_run_needs_only_the_checkpoint(script_run, tmp_path, capsys):
    from rlbolt.models.hf_io import save_hf

    run_dir, module, state = script_run
    assert not (run_dir / "config.yaml").exists()
    out = tmp_path / "hf"
    assert main(["export", str(run_dir), str(out)]) == 0
    assert "checkpoint step 2" in capsys.readouterr().out
    trained = nnx.merge(module.graphdef, state.params)
    save_hf(trained, trained.config, tmp_path / "direct")
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "direct" / "model.safetensors").read_bytes()
    assert (out / "config.json").read_text() == (tmp_path / "direct" / "config.json").read_text()


def test_resume_of_a_script_run_says_to_rerun_the_script(script_run, capsys):
    run_dir = script_run[0]
    assert main(["resume", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trained from a Python script" in err and "running that script again" in err


def test_rerunning_a_finished_script_trains_and_logs_nothing(script_run):
    run_dir, _, state = script_run
    lines = (run_dir / "metrics.jsonl").read_text()
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    _, again = script(run_dir)
    assert again.step == state.step == 2 and again.policy_version == state.policy_version
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(state.params)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert (run_dir / "metrics.jsonl").read_text() == lines  # no step, no validation appended
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == steps
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]


def test_a_policy_nested_in_the_trainable_pytree_exports(tmp_path):
    """PPO trains {"policy": the Decoder's params, "value_head": ...}: the checkpoint records
    where the policy sits, and export writes exactly what save_hf writes for that Decoder."""
    from rlbolt.app.cli_export import export_run
    from rlbolt.models import Decoder, tiny_config
    from rlbolt.models.hf_io import save_hf
    from rlbolt.state import TrainState
    from rlbolt.producer.weights import WeightStore

    model = Decoder(tiny_config(vocab_size=32, hidden_size=32, intermediate_size=64, head_dim=8), rngs=nnx.Rngs(3))
    params = {"policy": nnx.state(model, nnx.Param), "value_head": {"kernel": jnp.ones((32, 1)), "bias": jnp.zeros(1)}}
    module = types.SimpleNamespace(model=model, policy_params=lambda p: p["policy"])
    state = TrainState(step=1, params=params, opt_state={}, rng=jnp.zeros(2, jnp.uint32), policy_version=1,
                       data_position=4)
    ckpt = ModelCheckpoint(async_save=False)
    trainer = types.SimpleNamespace(run_dir=tmp_path / "run", callbacks=CallbackList([ckpt]), weights=WeightStore(0),
                                    mode="sync", is_main_process=True, last_state=None, module=module)
    ckpt.on_restore(trainer, state)
    ckpt.on_fit_end(trainer, state)
    export_run(tmp_path / "run", tmp_path / "exported")
    save_hf(model, model.config, tmp_path / "direct")
    assert (tmp_path / "exported" / "model.safetensors").read_bytes() == (tmp_path / "direct" / "model.safetensors").read_bytes()
