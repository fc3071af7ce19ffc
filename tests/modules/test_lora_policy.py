"""GRPO with LoRA (model.lora) through Trainer.fit: only the adapters train, the base stays
bit-identical and exists once, no base gradient is ever formed, the KL reference is the base with
adapters off, the sampler rolls out with the current adapters, checkpoints hold adapters plus the
base's identity and a resume on another base is refused."""

import dataclasses
import gc
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from float_tolerance import decoder_logps_tolerance
from module_helpers import prompt_batch

from rlbolt.callback import Callback
from rlbolt.callbacks import ModelCheckpoint
from rlbolt.callbacks.checkpoint import FrozenParamsMismatch
from rlbolt.checkpointing.io import CheckpointIO
from rlbolt.data import gsm8k_style_rows
from rlbolt.models.lora import merge_adapters
from rlbolt.modules import GRPO, PPO
from rlbolt.modules import lm_ops
from rlbolt.plan import BatchPlan
from rlbolt.setup_context import SetupContext
from rlbolt.models.logps import token_logps
from rlbolt.trainer import Trainer
from rlbolt.update import make_update_fn, split_micro_batches

# Shapes no other test uses, so the live-buffer count sees only this model: H=48, q=48, k=v=16,
# I=112 -> qkv [48, 80], gate|up [48, 224], down [112, 48]
TINY = dict(hidden_size=48, num_layers=2, num_heads=3, num_kv_heads=1, head_dim=16, intermediate_size=112)
LORA = {"rank": 4, "alpha": 8, "targets": ["q", "v", "o", "up", "down"]}
STEPS = 3


def _config(**model):
    return {"model": {"tiny": TINY, "lora": LORA, **model}, "algorithm": {"lr": 0.05, "beta": 0.04},
            "rollout": {"max_new_tokens": 6}, "data": {"max_prompt_tokens": 24},
            "reward": {"weights": {"digits": 1.0, "answer": 1.0}}}


class _Record(Callback):
    def __init__(self):
        self.produced, self.metrics = [], []

    def on_rollout_end(self, trainer, produced):
        self.produced.append(produced.batch)

    def on_step_end(self, trainer, info):
        self.metrics.append(info.metrics)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora_run")
    module, record = GRPO(_config()), _Record()
    trainer = Trainer(BatchPlan(2, 4), max_steps=STEPS, seed=0, run_dir=run_dir,
                      callbacks=[record, ModelCheckpoint(every_n_steps=1, async_save=False)])
    initial = {}

    class Snapshot(Callback):
        def on_fit_start(self, trainer, state):
            initial["base"] = jax.tree.map(lambda x: np.array(x), trainer.module.lora.base)
            initial["adapters"] = jax.tree.map(lambda x: np.array(x), state.params)

    trainer.callbacks = type(trainer.callbacks)([*trainer.callbacks, Snapshot()])
    state = trainer.fit(module, gsm8k_style_rows(16))
    return module, trainer, state, record, initial, run_dir


def _flat(tree):
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_only_the_adapters_train_and_the_base_stays_bit_identical(run):
    module, _, state, record, initial, _ = run
    # r * (in + out) per target and layer, by hand: q (48+48), v (48+16), o (48+48), up (48+112), down (112+48)
    assert sum(x.size for x in jax.tree.leaves(state.params)) == 2 * 4 * (96 + 64 + 96 + 160 + 160)
    assert all(jax.tree.leaves(jax.tree.map(lambda v: isinstance(v, nnx.LoRAParam), state.params,
                                            is_leaf=lambda v: isinstance(v, nnx.Variable))))
    base_now, base_then = _flat(module.lora.base), _flat(initial["base"])
    assert base_now.keys() == base_then.keys()
    assert all(base_now[k].tobytes() == base_then[k].tobytes() for k in base_now)
    # ... and it is the model the config describes, rebuilt from scratch
    fresh = _flat(nnx.state(lm_ops.build_model(module.config.model, module.tokenizer.vocab_size, 0), nnx.Param))
    assert fresh.keys() == base_now.keys() and all(fresh[k].tobytes() == base_now[k].tobytes() for k in fresh)
    moved = [k for k, v in _flat(state.params).items() if not np.array_equal(v, _flat(initial["adapters"])[k])]
    assert len(moved) == len(_flat(state.params))  # every A and B moved (B from zero)
    assert all(np.isfinite(m["kl"]) for m in record.metrics) and record.metrics[-1]["kl"] > 0


def test_the_optimizer_state_covers_only_the_adapters(run):
    _, _, state, _, _, _ = run
    adapter_shapes = sorted(x.shape for x in jax.tree.leaves(state.params))
    moments = sorted(x.shape for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    assert moments == sorted(adapter_shapes * 2)  # AdamW's mu and nu of each adapter, nothing else


def _live_buffers(shape):
    gc.collect()
    return {x.unsafe_buffer_pointer() for x in jax.live_arrays() if x.shape == shape and not x.is_deleted()}


def test_live_device_buffers_hold_one_copy_of_the_base(run):
    module, _, state, _, _, _ = run
    assert module.algo.beta > 0 and module.ref_params is None
    layers = TINY["num_layers"]
    for shape in [(48, 80), (48, 224), (112, 48)]:  # qkv, gate|up, down kernels
        assert len(_live_buffers(shape)) == layers, shape
    copy = jnp.array(module.lora.base["layers"][0]["attn"]["qkv_proj"]["kernel"][...], copy=True)
    assert len(_live_buffers((48, 80))) == layers + 1  # a second copy would be seen
    del copy


def _output_shapes(jaxpr):
    """Shapes of every value any equation computes, nested jaxprs (scan, pjit, remat, vjp) included."""
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    shapes += _output_shapes(inner)
    return shapes


def test_no_gradient_of_the_base_is_ever_formed(run):
    module, trainer, state, record, _, _ = run
    mini = jax.device_put(split_micro_batches(record.produced[-1].numeric(), 1))  # the update takes [A, M/A, ...]
    base_shapes = {(48, 80), (48, 224), (112, 48), (module.tokenizer.vocab_size, 48)}
    lora_jaxpr = jax.make_jaxpr(trainer._update.func)(state.params, state.opt_state, mini, frozen=module.lora.base)
    assert not base_shapes & set(_output_shapes(lora_jaxpr.jaxpr))
    # Control: differentiating the joined params (full fine-tuning of the same model) forms them.
    full = module.full_params(state.params)
    tx = optax.adam(1e-3)
    full_update = make_update_fn(module.training_step, tx, 1)
    full_jaxpr = jax.make_jaxpr(full_update.func)(full, tx.init(full), mini, frozen=None)
    assert base_shapes <= set(_output_shapes(full_jaxpr.jaxpr))


def test_the_reference_is_the_base_with_adapters_off(run):
    module, _, _, record, _, _ = run
    batch = record.produced[-1]
    plain = lm_ops.build_model(module.config.model, module.tokenizer.vocab_size, 0)
    graphdef, params = nnx.split(plain)
    inputs = [jnp.asarray(batch[k]) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    expected = jax.jit(lambda p, *a: token_logps(graphdef, p, *a))(params, *inputs)
    seq = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]  # adapters off against a plain graph
    np.testing.assert_allclose(batch["ref_logps"], np.asarray(expected), rtol=0,
                               atol=decoder_logps_tolerance(plain, seq))
    # the policy that sampled step 3 had moved away from it
    mask = batch["completion_mask"]
    assert np.abs(batch["sampler_logps"][mask] - batch["ref_logps"][mask]).max() > 1e-3


@pytest.mark.parametrize("mode", ["merged", "adapters"])
def test_rollout_runs_the_current_adapters(run, mode):
    module, _, state, _, _, _ = run
    if module.lora.config.rollout != mode:  # the fixture trained with the default (merged); rebuild the sampler
        module.lora.config = dataclasses.replace(module.lora.config, rollout=mode)
        module.rollout.handle = None
    batch = module.on_rollout(state.params, prompt_batch(gsm8k_style_rows(2, seed=5)))
    if mode == "merged":  # the merged kernels were a transient copy: the sampler let go of them
        assert len(_live_buffers((48, 80))) == TINY["num_layers"]
    merged = merge_adapters(module.lora.adapted_model(state.params))  # the adapters folded into the kernels
    graphdef, params = nnx.split(merged)
    inputs = [jnp.asarray(batch[k]) for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")]
    expected = np.asarray(jax.jit(lambda p, *a: token_logps(graphdef, p, *a))(params, *inputs))
    mask = batch["completion_mask"]
    seq = batch["prompt_ids"].shape[1] + batch["completion_ids"].shape[1]  # the sampler's decode graph: the bound
    np.testing.assert_allclose(batch["sampler_logps"][mask], expected[mask], atol=decoder_logps_tolerance(merged, seq),
                               rtol=0)


def test_checkpoints_hold_the_adapters_and_the_base_identity(run):
    module, _, state, _, _, run_dir = run
    io = CheckpointIO(run_dir / "checkpoints", async_save=False)
    try:
        assert io.steps()[-1] == STEPS
        meta = io.read_meta(STEPS)
        template = {"params": state.params, "opt_state": state.opt_state, "rng": state.rng}
        arrays, _, _ = io.restore(STEPS, template, state.params)
    finally:
        io.close()
    identity = meta["frozen"]
    assert identity == module.frozen_identity() and identity["path"] is None and identity["quantize"] is None
    assert len(identity["fingerprint"]) == 64
    saved, now = _flat(arrays["params"]), _flat(state.params)
    assert saved.keys() == now.keys() and all(np.array_equal(saved[k], now[k]) for k in now)
    # What Orbax wrote, array by array (its own index; file sizes vary with OCDBT's layout):
    # the adapters, their moments, the step count and the rng key, no array of the base.
    index = json.loads((run_dir / "checkpoints" / str(STEPS) / "state" / "array_metadatas" / "process_0").read_text())
    written = {a["array_metadata"]["param_name"]: a["array_metadata"]["write_shape"] for a in index["array_metadatas"]}
    assert all("lora" in name or name.endswith(("count", "rng")) for name in written), sorted(written)
    saved_elements = sum(int(np.prod(shape)) for shape in written.values())
    base_elements = sum(x.size for x in jax.tree.leaves(module.lora.base))
    assert saved_elements == 3 * sum(x.size for x in jax.tree.leaves(state.params)) + 1 + 2  # + count + rng key
    assert saved_elements < base_elements / 2


def test_resuming_on_another_base_is_refused_in_one_line(run):
    _, _, _, _, _, run_dir = run
    other = GRPO(_config())  # seed 1 below: another random base, so another fingerprint
    trainer = Trainer(BatchPlan(2, 4), max_steps=STEPS + 1, seed=1, run_dir=run_dir,
                      callbacks=[ModelCheckpoint(every_n_steps=1, async_save=False)])
    with pytest.raises(FrozenParamsMismatch, match=r"was trained on the base path=None, fingerprint=[0-9a-f]{16} but "
                                                   r"this run loads path=None, fingerprint=[0-9a-f]{16}; point model.path"
                       ) as error:
        trainer.fit(other, gsm8k_style_rows(16))
    assert "\n" not in str(error.value)
    full = GRPO({**_config(), "model": {"tiny": TINY}})
    trainer = Trainer(BatchPlan(2, 4), max_steps=STEPS + 1, seed=0, run_dir=run_dir,
                      callbacks=[ModelCheckpoint(every_n_steps=1, async_save=False)])
    with pytest.raises(FrozenParamsMismatch, match="written with a frozen base .LoRA. but this run is without"):
        trainer.fit(full, gsm8k_style_rows(16))


def test_ppo_with_lora_trains_the_adapters_and_the_value_head(tokenizer):
    module = PPO({**_config(), "algorithm": {"name": "ppo", "beta": 0.04}})
    module.setup(SetupContext(BatchPlan(2, 4)))
    params = module.init_params(jax.random.key(0))
    assert set(params) == {"policy", "value_head"}
    assert all(isinstance(v, nnx.LoRAParam) for v in jax.tree.leaves(
        params["policy"], is_leaf=lambda v: isinstance(v, nnx.Variable)))
    joined = module.with_frozen(params, module.frozen_params())
    assert joined["value_head"] is params["value_head"]
    assert len(jax.tree.leaves(joined["policy"])) == len(jax.tree.leaves(params["policy"])) + len(
        jax.tree.leaves(module.lora.base))
