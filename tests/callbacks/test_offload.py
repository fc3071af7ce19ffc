"""CPUOffload: placements around each stage, recorded from inside the stage, and a run that is
bit-identical to the same run without offload (also through a checkpoint resume)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy_module import ToyModule, prompt_rows

from rlbolt.callback import Callback
from rlbolt.callbacks.checkpoint import ModelCheckpoint
from rlbolt.callbacks.offload import CPUOffload, Offloaded, host_memory_kind, placement
from rlbolt.plan import BatchPlan
from rlbolt.trainer import Trainer

PLAN = dict(prompts_per_step=2, num_generations=2, mini_batch_size=2, num_iterations=2)
STEPS = 3


class RefToyModule(ToyModule):
    """The toy policy plus a frozen reference table and a KL-like term, so ref_params are used."""

    def __init__(self, trace=None):
        super().__init__()
        self.trace = trace if trace is not None else []
        self.ref_params = None

    def setup(self, trainer):
        self.ref_params = {"table": 0.05 * jax.random.normal(jax.random.PRNGKey(42), (self.vocab, self.vocab))}

    def compute_logps(self, params, batch):
        self.trace.append(("logps", _kinds(self.ref_params)))
        batch = super().compute_logps(params, batch)
        ref = self._logps(self.ref_params, jnp.asarray(batch["prompt_ids"]), jnp.asarray(batch["completion_ids"]))
        return batch.with_columns(ref_logps=np.asarray(ref, np.float32))

    def training_step(self, params, batch):
        loss, metrics = super().training_step(params, batch)
        logps = self.token_logps(params, batch["prompt_ids"], batch["completion_ids"])
        kl = jnp.sum((logps - batch["ref_logps"]) ** 2) / batch["mini_batch_num_tokens"][0]
        return loss + 0.1 * kl, {**metrics, "kl": kl}


class Recorder(Callback):
    def __init__(self, trace):
        self.trace = trace
        self.metrics = []

    def on_rollout_end(self, trainer, produced):
        self.trace.append(("between", _kinds(trainer.module.ref_params)))

    def on_update_start(self, trainer, state):
        self.trace.append(("update", _kinds(state.opt_state)))

    def on_step_end(self, trainer, info):
        self.trace.append(("step_end", _kinds(info.state.opt_state) | _kinds(trainer.module.ref_params)))
        self.metrics.append({k: v for k, v in info.metrics.items() if not k.startswith(("time/", "throughput/"))})


def _kinds(tree):
    return {placement(x) for x in jax.tree.leaves(tree) if isinstance(x, (jax.Array, np.ndarray))}


def _fit(tmp_path, callbacks=(), max_steps=STEPS):
    trace = []
    recorder = Recorder(trace)
    module = RefToyModule(trace)
    trainer = Trainer(BatchPlan(**PLAN), max_steps=max_steps, run_dir=tmp_path, callbacks=[*callbacks, recorder])
    state = trainer.fit(module, prompt_rows(12))
    return state, recorder.metrics, trace, module


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return _fit(tmp_path_factory.mktemp("plain"))


def test_cpu_backend_has_host_memory_kinds():
    # Documented behaviour on CPU: the backend lists pinned_host, so the memory-kind path is the one tested.
    assert host_memory_kind() == "pinned_host"


@pytest.mark.parametrize("host_kind, expected", [(None, "pinned_host"), ("numpy", "numpy")])
def test_placements_per_stage_and_identical_run(tmp_path, baseline, host_kind, expected):
    offload = CPUOffload(host_kind=host_kind, reference_attrs=("ref_params",))  # a module without a card names them
    state, metrics, trace, module = _fit(tmp_path, [offload])
    assert offload.host_kind == expected and offload.offloaded_attrs == ("ref_params",)
    # The producer runs ahead of the consumer, so compare each stage's own records.
    logps = [kinds for stage, kinds in trace if stage == "logps"]
    updates = [kinds for stage, kinds in trace if stage == "update"]
    between = [kinds for stage, kinds in trace if stage in ("between", "step_end")]
    # logps micro batches of 2 samples: two calls per step, each with its own device copy.
    assert len(logps) == 2 * STEPS and all(k == {"device"} for k in logps)
    assert len(updates) == STEPS and all(k == {"device"} for k in updates)
    assert len(between) == 2 * STEPS and all(k == {expected} for k in between)
    # After fit the module is as it was: the device reference and its own compute_logps back.
    assert _kinds(module.ref_params) == {"device"} and "compute_logps" not in vars(module)
    base_state, base_metrics, _, _ = baseline
    assert metrics == base_metrics
    np.testing.assert_array_equal(np.asarray(state.params["table"]), np.asarray(base_state.params["table"]))
    for got, want in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(base_state.opt_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_module_without_a_card_is_not_probed_for_copies(tmp_path):
    # The default reads the card's idle_copies; the toy module has no card, so its ref_params
    # stay on the device (only the optimizer state moves) unless the user names them.
    offload = CPUOffload()
    _, _, trace, module = _fit(tmp_path, [offload], max_steps=1)
    assert offload.offloaded_attrs == () and module.card() is None
    between = [kinds for stage, kinds in trace if stage == "between"]  # the reference between stages
    assert between and all(kinds == {"device"} for kinds in between)


def test_only_optimizer_state(tmp_path):
    state, _, trace, module = _fit(tmp_path, [CPUOffload(reference=False)], max_steps=1)
    assert [k for s, k in trace if s == "between"] == [{"device"}]  # ref_params untouched
    assert _kinds(state.opt_state) == {"pinned_host"}


def test_resume_through_checkpoint_with_offload(tmp_path, baseline):
    # ModelCheckpoint saves and restores host (pinned_host) arrays; resuming at step 1 ends where
    # the uninterrupted run does. CPUOffload first: the restored state replaces the offloaded one.
    ckpt = tmp_path / "ckpt"
    _fit(tmp_path, [ModelCheckpoint(ckpt, every_n_steps=1, async_save=False), CPUOffload(reference_attrs=("ref_params",))], max_steps=1)
    state, metrics, trace, _ = _fit(tmp_path, [CPUOffload(reference_attrs=("ref_params",)), ModelCheckpoint(ckpt, async_save=False)])
    assert [k for s, k in trace if s == "update"] == [{"device"}] * (STEPS - 1)
    assert _kinds(state.opt_state) == {"pinned_host"}
    base_state, base_metrics, _, _ = baseline
    assert metrics == base_metrics[1:]
    np.testing.assert_array_equal(np.asarray(state.params["table"]), np.asarray(base_state.params["table"]))


def test_offloaded_roundtrip_keeps_values_and_sharding():
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "n": 3}
    off = Offloaded(tree, "unpinned_host")
    assert placement(off.host["a"]) == "unpinned_host" and off.host["n"] == 3
    back = off.to_device()
    assert placement(back["a"]) == "device" and back["a"].sharding == tree["a"].sharding
    np.testing.assert_array_equal(np.asarray(back["a"]), np.arange(6.0).reshape(2, 3))


def test_bad_host_kind():
    with pytest.raises(ValueError, match="host_kind='gpu'"):
        CPUOffload(host_kind="gpu")
    with pytest.raises(TypeError, match="reference_attrs"):
        CPUOffload(reference_attrs="ref_params")


@pytest.mark.slow
def test_grpo_with_reference_model_is_identical(tmp_path):
    # The real LM module: LMPolicyModule.compute_logps reads self.ref_params (beta > 0).
    from rlbolt.data.tasks import gsm8k_style_rows
    from rlbolt.modules import GRPO

    tiny = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "intermediate_size": 64}
    config = {"model": {"tiny": tiny}, "rollout": {"max_new_tokens": 4}, "algorithm": {"lr": 0.05, "beta": 0.1},
              "reward": {"weights": {"answer": 1.0, "digits": 1.0}}, "data": {"max_prompt_tokens": 32}}

    def run(callbacks):
        recorder = Recorder([])
        module = GRPO(config)
        state = Trainer(BatchPlan(prompts_per_step=2, num_generations=2), max_steps=2, run_dir=tmp_path,
                        callbacks=[*callbacks, recorder]).fit(module, gsm8k_style_rows(8))
        return state, recorder

    offload = CPUOffload()
    state, recorder = run([offload])
    base_state, base_recorder = run([])
    assert offload.offloaded_attrs == ("ref_params",)
    assert [k for s, k in recorder.trace if s == "between"] == [{"pinned_host"}] * 2
    assert all("kl" in m for m in recorder.metrics) and recorder.metrics == base_recorder.metrics
    for got, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(base_state.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
