"""The `rlbolt` command's argument handling and bad-input paths (no training runs here)."""

from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml

from rlbolt.app import rundir
from rlbolt.app.cli import CLIError, main, split_overrides
from rlbolt.utils import runlock

SUBCOMMANDS = ("demo", "fit", "resume", "plot", "export")


def run_main(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv", [["--help"], *[[sub, "--help"] for sub in SUBCOMMANDS]])
def test_help_exits_zero_and_shows_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rlbolt")
    if len(argv) == 2:
        assert f"rlbolt {argv[0]}" in out


def test_console_script_help_runs_in_a_fresh_process():
    proc = subprocess.run([sys.executable, "-m", "rlbolt.app.cli", "demo", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    assert "--checkpoint-every" in proc.stdout and "--max-steps" in proc.stdout


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["demo", "--max-steps", "0"], ["demo", "--max-steps", "ten"],
                                  ["demo", "--task", "sort"], ["plot"], ["export", "only_one_arg"],
                                  ["resume", "d", "--bogus"]])
def test_malformed_arguments_exit_two(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_split_overrides_accepts_both_spellings():
    assert split_overrides(["--trainer.max_steps=3", "algorithm.beta=0.0"]) == ["trainer.max_steps=3",
                                                                                "algorithm.beta=0.0"]
    for bad in (["--max_steps=3"], ["--trainer.max_steps"], ["positional"]):
        with pytest.raises(CLIError, match="section.key=value"):
            split_overrides(bad)


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_fit_unknown_key_names_it_and_suggests(tmp_path, capsys):
    code, _, err = run_main(["fit", "recipes/configs/grpo_gsm8k.yaml", "--trainer.max_step=3",
                             f"--trainer.run_dir={tmp_path / 'r'}"], capsys)
    _one_line_error(code, err, "max_step", "max_steps")
    assert not (tmp_path / "r").exists()  # nothing written for a bad config


def test_fit_unknown_section_lists_sections(tmp_path, capsys):
    code, _, err = run_main(["fit", "recipes/configs/grpo_gsm8k.yaml", "--trainr.max_steps=3"], capsys)
    _one_line_error(code, err, "trainr", "trainer")


def test_fit_wrong_type_names_field_and_type(tmp_path, capsys):
    code, _, err = run_main(["fit", "recipes/configs/grpo_gsm8k.yaml", "--trainer.max_steps=many"], capsys)
    _one_line_error(code, err, "max_steps", "many")


def test_fit_bad_choice_lists_allowed_values(capsys):
    code, _, err = run_main(["fit", "recipes/configs/grpo_gsm8k.yaml", "--algorithm.name=ddpg"], capsys)
    _one_line_error(code, err, "ddpg", "grpo", "dapo")


def test_fit_missing_config_file(tmp_path, capsys):
    code, _, err = run_main(["fit", str(tmp_path / "nope.yaml")], capsys)
    _one_line_error(code, err, "nope.yaml")


def test_fit_refuses_non_empty_run_dir(tmp_path, capsys):
    (tmp_path / "old.txt").write_text("an earlier run")
    code, _, err = run_main(["fit", "recipes/configs/grpo_gsm8k.yaml", f"--trainer.run_dir={tmp_path}"], capsys)
    _one_line_error(code, err, str(tmp_path), "not empty", "rlbolt resume")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.txt"]


def test_demo_refuses_non_empty_run_dir(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    code, _, err = run_main(["demo", "--run-dir", str(tmp_path), "--max-steps", "1"], capsys)
    _one_line_error(code, err, "not empty")
    assert (tmp_path / "keep.txt").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


@pytest.mark.parametrize("sub", ["resume", "plot"])
def test_missing_run_dir(sub, tmp_path, capsys):
    code, _, err = run_main([sub, str(tmp_path / "missing")], capsys)
    _one_line_error(code, err, "missing", "does not exist")


def test_export_missing_run_dir(tmp_path, capsys):
    code, _, err = run_main(["export", str(tmp_path / "missing"), str(tmp_path / "out")], capsys)
    _one_line_error(code, err, "does not exist")


def test_resume_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    code, _, err = run_main(["resume", str(tmp_path)], capsys)
    _one_line_error(code, err, "config.yaml")


def test_resume_of_a_fit_run_without_checkpoints(tmp_path, capsys):
    rundir.prepare_run_dir(tmp_path / "run")
    rundir.write_config(tmp_path / "run", {"trainer": {"max_steps": 2}})
    code, _, err = run_main(["resume", str(tmp_path / "run")], capsys)
    _one_line_error(code, err, "no checkpoint")


def test_export_without_checkpoints(tmp_path, capsys):
    run = rundir.prepare_run_dir(tmp_path / "run")
    rundir.write_config(run, {"demo": {"max_steps": 2}})
    code, _, err = run_main(["export", str(run), str(tmp_path / "hf")], capsys)
    _one_line_error(code, err, "no checkpoint")
    assert not (tmp_path / "hf").exists()


def test_plot_without_metrics(tmp_path, capsys):
    code, _, err = run_main(["plot", str(tmp_path)], capsys)
    _one_line_error(code, err, "metrics.jsonl")


def test_resume_demo_config_with_unknown_key(tmp_path, capsys):
    run = rundir.prepare_run_dir(tmp_path / "run")
    rundir.write_config(run, {"demo": {"max_steps": 2, "learning_rat": 0.1}})
    code, _, err = run_main(["resume", str(run)], capsys)
    _one_line_error(code, err, "learning_rat", "learning_rate")


# -- the run directory ------------------------------------------------------------------------------
def test_prepare_run_dir_layout_and_refusal(tmp_path):
    run = rundir.prepare_run_dir(tmp_path / "a" / "b")
    assert sorted(p.name for p in run.iterdir()) == [".rlbolt.lock", "checkpoints", "plots"]
    assert runlock.is_held(run)  # locked for this process until released
    rundir.release_run_dir(run)
    assert not runlock.is_held(run)
    with pytest.raises(rundir.RunDirError, match="not empty"):
        rundir.prepare_run_dir(run)
    (tmp_path / "file").write_text("")
    with pytest.raises(rundir.RunDirError, match="is a file"):
        rundir.prepare_run_dir(tmp_path / "file")
    with pytest.raises(rundir.RunDirError, match="config.yaml"):
        rundir.prepare_run_dir(run, resume=True)
    rundir.write_config(run, {"demo": {"seed": 3, "tags": ("a", "b")}})
    assert rundir.prepare_run_dir(run, resume=True) == run
    rundir.release_run_dir(run)
    assert yaml.safe_load((run / "config.yaml").read_text()) == {"demo": {"seed": 3, "tags": ["a", "b"]}}
    assert rundir.read_config(run) == {"demo": {"seed": 3, "tags": ["a", "b"]}}


def test_read_config_rejects_non_mapping(tmp_path):
    (tmp_path / "config.yaml").write_text("- just\n- a list\n")
    with pytest.raises(rundir.RunDirError, match="mapping"):
        rundir.read_config(tmp_path)


def test_log_file_receives_rlbolt_records_and_detaches(tmp_path):
    import logging

    handler = rundir.attach_log_file(tmp_path)
    logging.getLogger("rlbolt.run").info("hello %d", 7)
    logging.getLogger("other").info("not ours")
    rundir.detach_log_file(handler)
    logging.getLogger("rlbolt.run").info("after detach")
    text = (tmp_path / "train.log").read_text()
    assert "rlbolt.run: hello 7" in text
    assert "not ours" not in text and "after detach" not in text
    assert logging.getLogger("rlbolt").propagate is True


def test_a_log_file_on_a_full_disk_drops_its_records_without_a_word_on_stderr(tmp_path, capsys):
    """The disk-full fault at its worst moment: Orbax logs its failed save (through absl) while the
    run folder's disk is full. logging would print "--- Logging error ---" and a traceback per
    record; the command's one-line report must stay the only line."""
    import errno
    import logging

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):  # a buffered file flushes its tail when closed
            raise OSError(errno.ENOSPC, "No space left on device")

    handler = rundir.attach_log_file(tmp_path)
    for h in (handler, handler.rlbolt_restore[3]):  # rlbolt's records and the libraries' (absl)
        h.stream.close()
        h.stream = FullDisk()
    logging.getLogger("rlbolt.run").info("a step summary")
    logging.getLogger("absl").error("Save Finalize thread failed", exc_info=ValueError("RESOURCE_EXHAUSTED"))
    assert capsys.readouterr().err == ""
    rundir.detach_log_file(handler)  # the run ends on the full disk: flushing and closing raise ENOSPC
    assert capsys.readouterr().err == ""
    assert logging.getLogger("rlbolt").propagate is True and handler.stream is None

    handler = rundir.attach_log_file(tmp_path)
    try:  # a bug in a record (two %d, one argument) is still reported: only write failures are dropped
        logging.getLogger("rlbolt.run").info("%d %d", 1)
        assert "--- Logging error ---" in capsys.readouterr().err
    finally:
        rundir.detach_log_file(handler)


def test_parameter_table_names_every_array_and_counts_them():
    import jax.numpy as jnp
    from flax import nnx

    from rlbolt.models import Decoder, tiny_config

    model = Decoder(tiny_config(vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                head_dim=8, intermediate_size=24), rngs=nnx.Rngs(0))
    params = {"policy": nnx.state(model, nnx.Param), "value_head": {"kernel": jnp.zeros((16, 1)), "bias": jnp.zeros(1)}}
    text = rundir.parameter_table(params)
    expected = {"policy/embed/embedding": (40, 16), "policy/layers/0/mlp/down_proj/kernel": (24, 16),
                "value_head/kernel": (16, 1), "value_head/bias": (1,)}
    for name, shape in expected.items():
        assert f"| {name} " in text and str(shape) in text
    assert "/value " not in text
    total = sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params))
    assert f"Total: {total:,}" in text
