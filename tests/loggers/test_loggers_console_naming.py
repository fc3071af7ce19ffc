"""ConsoleWriter line format and metric-name normalisation."""

import io
import math

import numpy as np
import pytest

from rlbolt.loggers import ConsoleWriter, namespaced, normalize_name
from rlbolt.loggers.console import format_value


def test_console_shows_the_default_subset_in_a_fixed_order_plus_val():
    out = io.StringIO()
    writer = ConsoleWriter(file=out)
    writer.write_scalars(12, {"loss": -0.0123456, "advantage/std": 1.0, "reward/mean": 0.53125,
                              "val/gsm8k/accuracy": 0.75, "throughput/tokens_per_s": 123456.0})
    assert out.getvalue() == ("step 12 | reward/mean 0.5312 | loss -0.01235 | "
                              "throughput/tokens_per_s 1.235e+05 | val/gsm8k/accuracy 0.75\n")


def test_console_explicit_keys_all_keys_and_fallback():
    lines = []
    ConsoleWriter(keys=["kl", "missing", "loss"], printer=lines.append).write_scalars(
        1, {"loss": 2.0, "kl": np.float32(0.5), "other": 3.0})
    ConsoleWriter(keys=[], printer=lines.append).write_scalars(2, {"b": 1.0, "a": 2.0})
    ConsoleWriter(printer=lines.append).write_scalars(3, {"custom/x": 4.0})
    assert lines == ["step 1 | kl 0.5 | loss 2", "step 2 | b 1 | a 2", "step 3 | custom/x 4"]
    with pytest.raises(TypeError, match=r"keys=\['loss'\]"):
        ConsoleWriter(keys="loss")


def test_format_value_edges():
    assert [format_value(v) for v in (0.0, 1.0, 1e-4, 1e5, math.nan, -math.inf)] == [
        "0", "1", "1.000e-04", "1.000e+05", "nan", "-inf"]


def test_normalize_name_lowercases_and_unifies_separators():
    assert normalize_name("Reward/Mean") == "reward/mean"
    assert normalize_name("time:rollout") == "time/rollout"
    assert normalize_name("time\\update") == "time/update"
    assert normalize_name(" response length//clip_ratio/ ") == "response_length/clip_ratio"
    assert normalize_name("val/gsm8k/pass@8") == "val/gsm8k/pass@8"


def test_namespaced_prefixes_keeps_values_and_order():
    values = [np.float32(1.0), 2.0]
    out = namespaced({"GSM8K/Accuracy": values[0], "gsm8k/pass@4": values[1]}, prefix="val")
    assert list(out) == ["val/gsm8k/accuracy", "val/gsm8k/pass@4"]
    assert out["val/gsm8k/accuracy"] is values[0]


def test_namespaced_rejects_collisions_and_bad_names():
    with pytest.raises(ValueError, match="'Loss' and 'loss' both normalise to 'loss'"):
        namespaced({"Loss": 1.0, "loss": 2.0})
    with pytest.raises(ValueError, match=r"holds '\(\)'"):
        namespaced({"reward(mean)": 1.0})
    with pytest.raises(ValueError, match="empty"):
        namespaced({"//": 1.0})
    with pytest.raises(TypeError, match="strings"):
        namespaced({3: 1.0})
