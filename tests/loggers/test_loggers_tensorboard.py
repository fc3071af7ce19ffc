"""TensorBoardWriter: event files parse with TensorBoard's reader and match metrics.jsonl."""

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from rlbolt.loggers import JsonlWriter, MultiWriter, TensorBoardWriter, read_jsonl


def _load(logdir):
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_event_files_hold_the_values_in_metrics_jsonl(tmp_path):
    writer = MultiWriter([JsonlWriter(tmp_path / "metrics.jsonl"),
                          TensorBoardWriter(tmp_path / "tensorboard")])
    rng = np.random.default_rng(0)
    for step in range(1, 6):
        writer.write_scalars(step, {"loss": rng.normal(), "reward/mean": rng.uniform(),
                                    "time/step": np.float32(0.1 * step)})
    writer.close()

    records = read_jsonl(tmp_path / "metrics.jsonl")
    acc = _load(tmp_path / "tensorboard")
    assert set(acc.Tags()["scalars"]) == {"loss", "reward/mean", "time/step"}
    for tag in ("loss", "reward/mean", "time/step"):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in records]
        # TensorBoard stores float32; the jsonl keeps the float64 that was written.
        np.testing.assert_array_equal(
            np.array([e.value for e in events], np.float32),
            np.array([r[tag] for r in records], np.float32))


def test_texts_and_hparams_land_in_the_same_run(tmp_path):
    writer = TensorBoardWriter(tmp_path)
    writer.write_hparams({"optim": {"lr": 0.001}, "num_generations": 8, "algo": "grpo"})
    writer.write_texts(2, {"sample": "hello world"})
    writer.write_scalars(2, {"loss": 1.0})
    writer.close()

    acc = _load(tmp_path)
    texts = {tag: [bytes(e.tensor_proto.string_val[0]).decode() for e in acc.Tensors(tag)]
             for tag in acc.Tags()["tensors"]}
    assert texts["sample/text_summary"] == ["hello world"]
    table = texts["hparams/text_summary"][0]
    assert "| optim.lr | 0.001 |" in table and "| num_generations | 8 |" in table
    # The HParams plugin summary sits in this run, not in a wall-clock-named sub-run.
    start = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["optim.lr"].number_value == 0.001
    assert start.hparams["num_generations"].number_value == 8
    assert start.hparams["algo"].string_value == "grpo"
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []


def test_closed_writer_refuses_writes(tmp_path):
    writer = TensorBoardWriter(tmp_path)
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        writer.write_scalars(0, {"loss": 1.0})
