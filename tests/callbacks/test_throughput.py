"""Throughput: the FLOPs formula on hand-computed cases, the peak table, and a real fit whose
flops_per_s / mfu / time shares equal the hand formula over the step's own timings."""

from types import SimpleNamespace

import numpy as np
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.module import ModuleCard
from rlbolt.callbacks import MetricsLogger, Throughput
from rlbolt.callbacks.throughput import forward_flops, peak_flops_for, step_flops
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer


def test_forward_and_step_flops_by_hand():
    # N = 1000, L = 2, H x Q = 8; T = 6: 6 * (2000 + 4*2*8*6) = 14304; T = 4: 4 * (2000 + 256) = 9024
    assert forward_flops(1000, np.array([6, 4]), 2, 8) == 14304 + 9024
    assert forward_flops(1000, np.array([6, 4])) == 2 * 1000 * 10  # no attention term
    flops = step_flops(1000, np.array([6, 4]), num_iterations=2, logps_forwards=1, num_layers=2, attention_width=8)
    assert flops == {"rollout": 23328.0, "logps": 23328.0, "update": 6 * 23328.0, "total": 8 * 23328.0}


@pytest.mark.parametrize("kind, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-40GB", 312e12), ("cpu", None)])
def test_peak_table(kind, peak):
    assert peak_flops_for(kind) == peak


class Record(Callback):
    def __init__(self):
        self.metrics = []

    def on_step_end(self, trainer, info):
        self.metrics.append(dict(info.metrics))


def _fit(module, callbacks, num_iterations=1):
    plan = BatchPlan(prompts_per_step=2, num_generations=2, num_iterations=num_iterations)
    return Trainer(plan, max_steps=2, callbacks=callbacks).fit(module, prompt_rows(8))


@pytest.mark.parametrize("num_iterations, passes", [(1, 1 + 0 + 3), (2, 1 + 1 + 6)])
def test_fit_metrics_match_the_formula(num_iterations, passes):
    record = Record()
    _fit(ToyModule(), [Throughput(peak_flops=1e9), record], num_iterations)
    # Toy: N = 8 x 8 = 64 params, no model config; 4 samples of 3 prompt + 6 completion tokens.
    forward = 4 * 9 * 2 * 64
    for m in record.metrics:
        # Python float64 products and quotients of the same numbers: rel=1e-9 is ~1e7 float64 ulps
        assert m["throughput/flops_per_s"] == pytest.approx(passes * forward / m["time/step"], rel=1e-9)
        assert m["throughput/mfu"] == pytest.approx(passes * forward / m["time/step"] / 1e9, rel=1e-9)
        for stage in ("rollout", "logps", "reward", "update", "data_wait"):
            assert m[f"time/share/{stage}"] == pytest.approx(m[f"time/{stage}"] / m["time/step"])


def test_attention_term_from_model_config_and_no_mfu_on_cpu():
    record = Record()
    config = SimpleNamespace(num_layers=2, num_heads=4, head_dim=16)
    module = ToyModule()
    module.card = lambda: ModuleCard(model=None, model_config=config, policy_params=lambda p: p, hf_model=lambda p: None)
    throughput = Throughput()
    _fit(module, [throughput, record])
    assert throughput.peak is None and "throughput/mfu" not in record.metrics[-1]
    forward = 4 * 9 * (2 * 64 + 4 * 2 * 64 * 9)
    assert throughput.last_flops["total"] == 4 * forward


def test_listed_after_the_logger_still_reaches_it(tmp_path):
    from rlbolt.loggers import read_jsonl

    Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=1, run_dir=tmp_path,
            callbacks=[MetricsLogger(writer=["jsonl"]), Throughput()]).fit(ToyModule(), prompt_rows(4))
    assert "time/share/update" in read_jsonl(tmp_path / "metrics.jsonl")[0]
    with pytest.raises(ValueError, match="peak_flops=0"):
        Throughput(peak_flops=0)
