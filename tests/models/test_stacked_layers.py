"""Layers stored stacked (`rlbolt.models.stacked_layers`, what `model.scan_layers` runs): the scanned
forward over the stored stack gives the loop's logits and gradients without the per-forward stack
copy, the passes that loop (decode with a KV cache, the prompt-shared forward) read per-layer views,
and every boundary sees the per-layer layout (Hugging Face export, checkpoints either way).

Tolerances: `decoder_tolerance` for the scan against the loop (another fusion of the same ops; the
gradients take 3x their own magnitude's bound, as tests/models/test_scan_layers.py explains);
`decoder_logps_tolerance` for the looping passes, whose views are slices of the same values.
Layout conversions move values without arithmetic: bit equality.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from float_tolerance import decoder_logps_tolerance, decoder_tolerance

from rlbolt.models import Decoder, tiny_config
from rlbolt.models.cache import init_cache
from rlbolt.models.hf_io import load_hf, save_hf
from rlbolt.models.logps import token_logps
from rlbolt.models.moe import moe_layers, record_routing, replay_routing
from rlbolt.models.hf_layout import flat_params
from rlbolt.models.stacked_layers import (LayerSlice, StackedLayers, is_stacked, stack_layer_state, stack_layers,
                                          unstack_layer_state)

LAYERS = 3
KINDS = 6  # parameter kinds per llama layer: two norms, qkv, o, gate|up, down


def _models(**config):
    """(per-layer model, the same weights stored stacked)."""
    per_layer = Decoder(tiny_config(num_layers=LAYERS, **config), rngs=nnx.Rngs(0))
    stacked = stack_layers(nnx.clone(per_layer))
    return per_layer, stacked


def _batch(vocab: int):
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, vocab)
    mask = jnp.arange(12)[None] >= jnp.asarray([0, 4])[:, None]  # one left-padded row
    return ids, jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0), mask


def _loss_and_grads(model, scan: bool, run: bool = True):
    """(the loss's jaxpr, its logits at real positions, its gradients); run=False: the jaxpr alone (traced, not
    compiled)."""
    model.scan_layers = scan
    graphdef, params = nnx.split(model, nnx.Param)
    ids, positions, mask = _batch(model.config.vocab_size)

    def loss(p):
        logits = nnx.merge(graphdef, p)(ids, positions, attention_mask=mask)[0]
        return jnp.sum(jnp.where(mask, jax.nn.log_softmax(logits)[..., 3], 0.0)), logits

    jaxpr = str(jax.make_jaxpr(lambda p: loss(p)[0])(params))
    if not run:
        return jaxpr, None, None
    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return jaxpr, np.where(mask[..., None], logits, 0.0), grads


def test_the_stored_stack_scans_to_the_loops_logits_and_gradients_without_a_copy():
    per_layer, stacked = _models()
    assert is_stacked(stacked) and not is_stacked(per_layer)
    params = nnx.state(stacked, nnx.Param)
    assert len(jax.tree.leaves(params)) == 3 + KINDS  # embed, final norm, lm_head + one leaf per kind
    assert params["layers"]["block"]["attn"]["qkv_proj"]["kernel"].shape[0] == LAYERS
    _, loop_logits, loop_grads = _loss_and_grads(per_layer, False)
    copying, _, _ = _loss_and_grads(per_layer, True, run=False)  # per-layer storage scanned: jnp.stack at each forward
    jaxpr, logits, grads = _loss_and_grads(stacked, True)
    assert jaxpr.count(" scan[") == 1
    # Per-layer storage scanned stacks each parameter kind at every forward; the stored stack is read as it is.
    assert (copying.count(" stack[axis=0]"), jaxpr.count(" stack[")) == (KINDS, 0)
    config = per_layer.config
    np.testing.assert_allclose(logits, loop_logits, rtol=0, atol=decoder_tolerance(loop_logits, config, 12))
    grads = unstack_layer_state(grads)  # the gradient comes back stacked, like the parameters
    assert jax.tree.structure(grads) == jax.tree.structure(loop_grads)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(loop_grads)):
        np.testing.assert_allclose(g, ref, rtol=0, atol=3 * decoder_tolerance(np.asarray(ref), config, 12) + 1e-30)
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def test_a_stacked_mixture_of_experts_model_scans_to_the_loops_logits_and_gradients():
    """MoE layers stored stacked (a run without routing features): the scan reads the [L, E, ...] expert
    kernels as they lie (per layer, it stacked every kind at each forward), with the loop's logits and
    gradients, router included; the block's static settings reach the views through the graph definition,
    and routing cannot be recorded or replayed per layer on it (refused, not written to a view)."""
    per_layer, stacked = _models(**MOE)
    assert nnx.state(stacked, nnx.Param)["layers"]["block"]["mlp"]["gate_up"].shape == (LAYERS, 4, 64, 64)
    _, loop_logits, loop_grads = _loss_and_grads(per_layer, False)
    jaxpr, logits, grads = _loss_and_grads(stacked, True)
    assert (jaxpr.count(" scan["), jaxpr.count(" stack[")) == (1, 0)  # per layer: one stack per kind (7)
    config = per_layer.config
    np.testing.assert_allclose(logits, loop_logits, rtol=0, atol=decoder_tolerance(loop_logits, config, 12))
    grads = unstack_layer_state(grads)
    assert jax.tree.structure(grads) == jax.tree.structure(loop_grads)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(loop_grads)):
        np.testing.assert_allclose(g, ref, rtol=0, atol=3 * decoder_tolerance(np.asarray(ref), config, 12) + 1e-30)
    assert all(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))  # the router and every expert kernel

    (block,) = moe_layers(stacked)  # the one stacked block stands for every layer
    block.block_size, block.matmul = 16, "ragged_dot"
    view = stacked.layers[1].mlp
    assert (view.block_size, view.matmul, view.gate_up.shape) == (16, "ragged_dot", (4, 64, 64))
    with pytest.raises(ValueError, match=r"^record_routing: this model's mixture-of-experts layers are stored stacked"):
        record_routing(stacked)
    with pytest.raises(ValueError, match=r"^replay_routing: .* cannot be set per layer"):
        replay_routing(stacked, [jnp.zeros((24, 2), jnp.int32)] * LAYERS)
    record_routing(stacked, False)  # clearing is harmless
    replay_routing(stacked, None)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "moe"])
def test_the_looping_passes_read_per_layer_views(family):
    """Decode with a KV cache and the prompt-shared forward loop over `model.layers[i]` (slow: the
    default tier's GRPO-free cover is the scan test; the slow GRPO fit below samples through them too)."""
    per_layer, stacked = _models(**(MOE if family == "moe" else {}))
    for model in (per_layer, stacked):
        model.scan_layers = True  # the cache path and the shared prompt loop whatever the flag
    ids, positions, mask = _batch(per_layer.config.vocab_size)

    def decode(model):
        graphdef, params = nnx.split(model)

        @jax.jit
        def run(params):
            m = nnx.merge(graphdef, params)
            cache = init_cache(m.config, 2, 16)
            logits, cache = m(ids, positions, attention_mask=mask, cache=cache)
            step, _ = m(ids[:, :1], positions[:, -1:] + 1, cache=cache)
            return logits[:, -1], step[:, 0]

        return run(params)

    bound = decoder_logps_tolerance(per_layer, 13)
    for got, want in zip(decode(stacked), decode(per_layer)):
        np.testing.assert_allclose(got, want, rtol=0, atol=bound)
    prompt = jnp.repeat(ids[:1, :6], 2, axis=0)
    completion, completion_mask = ids[:, 6:], mask[:, 6:]
    shared = [token_logps(*nnx.split(m), prompt, jnp.ones_like(prompt, bool), completion, completion_mask,
                          group_size=2) for m in (stacked, per_layer)]
    np.testing.assert_allclose(shared[0], shared[1], rtol=0, atol=decoder_logps_tolerance(per_layer, 12))
    view = stacked.layers[-1]
    np.testing.assert_array_equal(view.attn.o_proj.kernel[...], per_layer.layers[LAYERS - 1].attn.o_proj.kernel[...])
    assert view.attn.o_proj.kernel.get_metadata()["out_sharding"] == ("heads", "embed")


def test_layers_that_differ_are_refused_in_one_line():
    moe = Decoder(tiny_config(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(0,)),
                  rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"^stack_layers: the layers differ in structure; keep them per layer$"):
        stack_layers(moe)
    with pytest.raises(IndexError):
        StackedLayers(nnx.clone(moe.layers[1]), 2)[2]


def test_hugging_face_export_of_a_stacked_model_round_trips_bit_exact(tmp_path):
    from safetensors.numpy import load_file

    per_layer, _ = _models(architecture="Qwen2ForCausalLM", attention_bias=True)
    save_hf(per_layer, per_layer.config, tmp_path / "a")
    loaded, config = load_hf(tmp_path / "a")
    stack_layers(loaded)
    assert is_stacked(loaded)
    flat = flat_params(nnx.state(loaded, nnx.Param))  # export reads one layer's slice at a time
    assert isinstance(flat["layers.2.mlp.down_proj.kernel"], LayerSlice)
    assert flat["layers.2.mlp.down_proj.kernel"].get_metadata()["out_sharding"] == ("mlp", "embed")
    save_hf(loaded, config, tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert sorted(a) == sorted(b) and any(".layers.2." in name for name in a)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


@pytest.mark.parametrize("saved_stacked,family", [(False, "llama"), (True, "llama"), (False, "moe")])
def test_a_checkpoint_restores_into_the_other_layout(tmp_path, saved_stacked, family):
    """Per-layer checkpoint (a run before stacking, or scan_layers off) -> stacked run, and the reverse:
    parameters, AdamW moments and the retained weights of async mode, bit for bit. The MoE case: a
    per-layer MoE checkpoint (saved before MoE layers were stored stacked) resumes into a stacked run."""
    from fake_fit import FakeFit

    from rlbolt.callbacks.checkpoint import ModelCheckpoint
    from rlbolt.state import StepInfo, TrainState

    tx = optax.adam(0.1)
    per_layer, stacked = _models(**(MOE if family == "moe" else {}))
    ones = jax.tree.map(jnp.ones_like, nnx.state(per_layer, nnx.Param))
    # jitted: eagerly, AdamW's every primitive compiles for each parameter shape, at each of the five states
    moments = jax.jit(lambda grads, params: tx.update(grads, tx.init(params), params)[1])

    def state(model, step):
        params = nnx.state(model, nnx.Param)
        opt_state = moments(ones if not is_stacked(model) else stack_layer_state(ones), params)
        return TrainState(step=step, params=params, opt_state=opt_state, rng=jnp.array([7, step], jnp.uint32),
                          policy_version=step, data_position=step)

    saving, restoring = (stacked, per_layer) if saved_stacked else (per_layer, stacked)
    ckpt = ModelCheckpoint(every_n_steps=2, async_save=False)
    trainer = FakeFit(tmp_path, [ckpt], lag=1, mode="async")
    trainer.restore_with(ckpt, state(saving, 0))
    for step in (1, 2):
        saved = state(saving, step)
        trainer.weights.publish(step - 1, saved.params, step - 1)
        trainer.callbacks.on_step_end(trainer.run, StepInfo(step, saved, {"loss": 0.0}, 0.0))
    ckpt.finish()

    again = ModelCheckpoint()
    resumed = FakeFit(tmp_path, [again], lag=1, mode="async")
    restored = resumed.restore_with(resumed.callbacks, state(restoring, 0))
    assert again.restored_step == 2
    want = state(restoring, 2)
    assert jax.tree.structure(restored.params) == jax.tree.structure(want.params)
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(want.opt_state)
    for got, ref in zip(jax.tree.leaves((restored.params, restored.opt_state)), jax.tree.leaves((want.params, want.opt_state))):
        assert got.dtype == ref.dtype and np.array_equal(got, ref)
    (params, version), = resumed.weights.retained().values()
    assert version == 1
    assert jax.tree.structure(params) == jax.tree.structure(want.params)
    for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want.params)):
        assert np.array_equal(got, ref)
    if saved_stacked:  # `rlbolt export` rebuilds a per-layer Decoder from the stacked arrays as saved
        import dataclasses

        from rlbolt.app.cli_export import decoder_from_checkpoint
        from rlbolt.checkpointing.io import CheckpointIO

        raw, _ = CheckpointIO(tmp_path / "checkpoints", read_only=True).restore_params(2)
        exported = decoder_from_checkpoint(raw, {"config": dataclasses.asdict(per_layer.config)}, tmp_path)
        ref = nnx.state(per_layer, nnx.Param)
        assert jax.tree.structure(nnx.state(exported, nnx.Param)) == jax.tree.structure(ref)
        for got, want_leaf in zip(jax.tree.leaves(nnx.state(exported, nnx.Param)), jax.tree.leaves(ref)):
            assert np.array_equal(got, want_leaf)



LR, STEPS = 0.05, 3
# The stacked and the per-layer runs differ in float32 rounding only: the global-norm clip sums 9
# stacked leaves where the per-layer run sums 3 + 6 L, and XLA fuses the scan's weight reads
# differently. AdamW moves a weight by lr * m/sqrt(v) per step, |m/sqrt(v)| <= 1, and a rounding-level
# change of the gradients changes that ratio by a small relative amount: 2**-12 bounds it with
# room (observed: 6.7e-8 absolute after 3 steps, 2**-23.8), so |delta theta| <= STEPS * LR * 2**-12.
PARAM_TOLERANCE = STEPS * LR * 2.0 ** -12


def _fit(run_dir, *, stacked: bool, monkeypatch, resume=None):
    """A GRPO fit of a tiny model with model.scan_layers (stacked, or per layer with the stacking
    turned off, as main stored it): (final params per layer, each step's sampled tokens)."""
    import rlbolt.modules.policy_setup as policy_setup
    from rlbolt.callback import Callback
    from rlbolt.callbacks import ModelCheckpoint
    from rlbolt.data import gsm8k_style_rows
    from rlbolt.modules import GRPO
    from rlbolt.plan import BatchPlan
    from rlbolt.trainer import Trainer

    sampled, initial = [], []

    class Record(Callback):
        def on_fit_start(self, trainer, state):
            initial.append(jax.tree.map(np.asarray, unstack_layer_state(state.params)))

        def on_rollout_end(self, trainer, produced):
            sampled.append(np.asarray(produced.batch["completion_ids"]))

    with monkeypatch.context() as patch:
        if not stacked:
            patch.setattr(policy_setup, "stack_layers", lambda model: model)
        config = {"model": {"tiny": dict(hidden_size=32, num_layers=LAYERS, num_heads=2, num_kv_heads=1, head_dim=16,
                                         intermediate_size=64), "scan_layers": True},
                  "algorithm": {"lr": LR, "beta": 0.04}, "rollout": {"max_new_tokens": 6},
                  "data": {"max_prompt_tokens": 24}, "reward": {"weights": {"digits": 1.0, "answer": 1.0}}}
        module = GRPO(config)
        trainer = Trainer(BatchPlan(2, 4), max_steps=STEPS, seed=0, run_dir=run_dir,
                          callbacks=[Record(), ModelCheckpoint(every_n_steps=1, async_save=False,
                                                               resume="latest" if resume is None else resume)])
        state = trainer.fit(module, gsm8k_style_rows(16))
    assert is_stacked(module.model) == stacked
    return jax.tree.map(np.asarray, unstack_layer_state(state.params)), sampled, initial[0]


@pytest.mark.slow
def test_a_grpo_fit_stored_stacked_equals_the_per_layer_scanned_fit_and_resumes_across_layouts(tmp_path, monkeypatch):
    """Three GRPO steps: the stacked run samples the per-layer scanned run's tokens at every step
    and ends on its parameters (to rounding); a stacked run resumed from the per-layer run's step-2
    checkpoint samples step 3's tokens and ends there too."""
    stacked, stacked_tokens, initial = _fit(tmp_path / "stacked", stacked=True, monkeypatch=monkeypatch)
    per_layer, per_layer_tokens, _ = _fit(tmp_path / "per_layer", stacked=False, monkeypatch=monkeypatch)
    resumed, resumed_tokens, _ = _fit(tmp_path / "per_layer", stacked=True, monkeypatch=monkeypatch, resume=2)
    assert len(stacked_tokens) == STEPS and len(resumed_tokens) == 1
    for got, want in zip(stacked_tokens + resumed_tokens, per_layer_tokens + per_layer_tokens[-1:]):
        np.testing.assert_array_equal(got, want)
    assert jax.tree.structure(stacked) == jax.tree.structure(per_layer) == jax.tree.structure(resumed)
    trained = min(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(initial)))
    assert trained > 100 * PARAM_TOLERANCE  # every parameter kind of every layer moved: the tolerance has teeth
    for run in (stacked, resumed):
        for got, want in zip(jax.tree.leaves(run), jax.tree.leaves(per_layer)):
            np.testing.assert_allclose(got, want, rtol=0, atol=PARAM_TOLERANCE)
