"""create_default_writer: the file layout on process 0 and silence elsewhere."""

import pytest

from rlbolt.loggers import (AsyncWriter, ConsoleWriter, JsonlWriter, NullWriter, TensorBoardWriter,
                            create_default_writer, read_jsonl)


def test_process_other_than_zero_writes_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    writer = create_default_writer(run_dir, console=True, jsonl=True, tensorboard=True,
                                   process_index=1)
    assert isinstance(writer, NullWriter)
    writer.write_hparams({"lr": 1.0})
    writer.write_scalars(1, {"loss": 1.0})
    writer.write_texts(1, {"sample": "x"})
    writer.close()
    assert not run_dir.exists()
    assert capsys.readouterr() == ("", "")


def test_process_zero_gets_console_jsonl_and_tensorboard(tmp_path, capsys):
    writer = create_default_writer(tmp_path, tensorboard=True, process_index=0)
    kinds = [type(w) for w in writer.writers]
    assert kinds == [ConsoleWriter, JsonlWriter, TensorBoardWriter]
    writer.write_scalars(7, {"loss": 0.5, "reward/mean": 0.25})
    writer.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 7, "loss": 0.5, "reward/mean": 0.25}]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert capsys.readouterr().out == "step 7 | reward/mean 0.25 | loss 0.5\n"


def test_default_process_index_comes_from_jax(tmp_path):
    import jax

    assert jax.process_index() == 0
    writer = create_default_writer(tmp_path, console=False)
    writer.write_scalars(1, {"loss": 2.0})
    writer.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.0}]


def test_asynchronous_wraps_file_writers_only(tmp_path):
    writer = create_default_writer(tmp_path, asynchronous=True, process_index=0)
    console, background = writer.writers
    assert isinstance(console, ConsoleWriter) and isinstance(background, AsyncWriter)
    writer.write_scalars(2, {"loss": 1.5})
    writer.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 2, "loss": 1.5}]


@pytest.mark.parametrize("index", [2, 3])
def test_any_nonzero_index_is_silent(tmp_path, index):
    assert isinstance(create_default_writer(tmp_path / "x", process_index=index), NullWriter)
    assert not (tmp_path / "x").exists()
