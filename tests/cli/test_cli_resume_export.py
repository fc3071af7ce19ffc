"""`rlbolt resume` and `rlbolt export` on a small demo run (in-process, to share compilation)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlbolt.app.cli import main
from rlbolt.app.cli_run import run_demo
from rlbolt.demo import DemoConfig, DigitsGRPO
from rlbolt.loggers import read_jsonl

SMALL = DemoConfig(max_steps=2, prompts_per_step=4, num_generations=4, num_prompts=64, checkpoint_every=1)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("small") / "run"
    run_demo(SMALL, run_dir, progress=False)
    return run_dir


def test_resume_continues_from_the_last_checkpoint(small_run, capsys):
    before = read_jsonl(small_run / "metrics.jsonl")
    assert [r["step"] for r in before] == [1, 2]
    assert main(["resume", str(small_run), "--max-steps", "3"]) == 0
    after = read_jsonl(small_run / "metrics.jsonl", merge_steps=False)
    # Steps 1-2 are not trained again: the resumed run appends step 3 only.
    assert [r["step"] for r in after] == [1, 2, 3]
    for old, new in zip(before, after):
        assert old == new
    log = (small_run / "train.log").read_text()
    assert "fit starts at step 0" in log and "fit starts at step 2" in log
    assert "max_steps: 3" in (small_run / "config.yaml").read_text()
    steps = sorted(int(p.name) for p in (small_run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [2, 3]  # keep=2
    out = capsys.readouterr().out
    assert "3 steps in" in out
    assert f"resumed from the checkpoint of step 2 in {small_run / 'checkpoints'}" in out  # on the console


def test_resume_with_a_changed_config_is_refused_unless_allowed_and_then_recorded(small_run, tmp_path, capsys):
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(small_run, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["demo"]["learning_rate"] = 0.002  # changes the math
    config["demo"]["checkpoint_every"] = 5  # does not
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    last = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    assert main(["resume", str(run), "--max-steps", str(last + 1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "demo.learning_rate: 0.0005 -> 0.002;" in err and "--allow-config-change" in err
    assert "checkpoint_every" not in err and not (run / "config_changes.jsonl").exists()

    assert main(["resume", str(run), "--max-steps", str(last + 1), "--allow-config-change"]) == 0
    recorded = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert recorded == [{"step": last, "time": recorded[0]["time"], "changes": {"demo.learning_rate": [0.0005, 0.002]}}]
    # The next resume compares with the new config, recorded in the checkpoints since.
    assert main(["resume", str(run), "--max-steps", str(last + 2)]) == 0


def test_export_writes_the_checkpointed_weights_for_transformers(small_run, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    out = tmp_path / "hf"
    assert main(["export", str(small_run), str(out)]) == 0
    assert "checkpoint step" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()

    from rlbolt.app.cli_export import latest_model

    model, step, _ = latest_model(small_run)
    assert step == max(int(p.name) for p in (small_run / "checkpoints").iterdir() if p.name.isdigit())
    ids = np.asarray([DigitsGRPO(SMALL).tokenizer.encode("3141=2718")], np.int32)
    positions = jnp.arange(ids.shape[1], dtype=jnp.int32)[None]
    ours, _ = model(jnp.asarray(ids), positions)
    with torch.no_grad():
        theirs = hf(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    from float_tolerance import decoder_tolerance

    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0,
                               atol=decoder_tolerance(theirs, model.config, ids.shape[1]))
    # The demo's tokenizer comes along (the folder then serves as a teacher or a model.path).
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("3141=2718", add_special_tokens=False).input_ids == ids[0].tolist()
    assert tokenizer.eos_token_id == DigitsGRPO(SMALL).tokenizer.eos_id

    fresh = DigitsGRPO(SMALL)
    fresh.init_params(jax.random.PRNGKey(SMALL.seed))
    initial, _ = fresh.model(jnp.asarray(ids), positions)
    assert np.abs(np.asarray(initial) - theirs).max() > 1e-3  # trained weights, not the initial ones

    # A second export into the same folder is refused unless asked.
    assert main(["export", str(small_run), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err

    # Every file gets the mode a plain open() gives (safetensors alone would make the weights 0600).
    probe = tmp_path / "probe"
    probe.write_text("")
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes) >= {"config.json", "model.safetensors"}
    assert set(modes.values()) == {oct(probe.stat().st_mode & 0o777)}, modes


def test_same_seed_same_run(small_run, tmp_path):
    run_demo(SMALL, tmp_path / "again", progress=False)
    first = {r["step"]: r for r in read_jsonl(small_run / "metrics.jsonl") if r["step"] <= 2}
    second = {r["step"]: r for r in read_jsonl(tmp_path / "again" / "metrics.jsonl")}
    assert sorted(second) == [1, 2]
    for step in (1, 2):
        timing_free = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
        assert timing_free(first[step]) == timing_free(second[step])
