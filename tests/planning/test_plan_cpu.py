"""`rlbolt plan` on this host's CPU devices (no libtpu): the abstract build holds no arrays, and the
compiled sizes match a hand count of the tiny model's parameters."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rlbolt.app.cli import main
from rlbolt.config import load_config

from plan_tiny import PARAMS, RUN


def test_abstract_values_keep_their_shardings():
    from rlbolt.distributed.layout import init_optimizer, training_plan
    from rlbolt.update import _shardings_of

    plan = training_plan(None)
    s = NamedSharding(plan.mesh, P())
    x = jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)
    placed = plan.place({"w": x}, {"w": s})["w"]
    assert isinstance(placed, jax.ShapeDtypeStruct) and placed.sharding == s  # _put made no array
    assert _shardings_of({"w": placed}) == {"w": s}  # was None for abstract leaves: out_shardings unpinned
    state = init_optimizer(optax.adam(1e-3), {"w": placed}, plan)
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(v, jax.ShapeDtypeStruct) and v.sharding is not None for v in leaves)


@pytest.mark.parametrize("masters", ["auto", "none"])
def test_plan_counts_the_parameters_by_hand_and_holds_no_array(masters):
    from rlbolt.distributed.sharding import per_device_bytes
    from rlbolt.planning import build_abstract, plan_run

    run = build_abstract(load_config({**RUN, "model": {**RUN["model"], "master_weights": masters}}), jax.devices()[:1])
    assert not [x for x in jax.tree.leaves((run.params, run.opt_state)) if isinstance(x, jax.Array)]
    assert per_device_bytes(run.params) == 2 * PARAMS
    report = plan_run(run, names=("optimizer",))
    (opt,) = report.executables
    if masters == "auto":  # as the Trainer: float32 masters and AdamW moments behind the bf16 params
        # float32 gradients (the update sums them in the masters' dtype) + masters + mu + nu + int32 count;
        # the bf16 params are no argument (the new ones are the masters' casts)
        assert opt.argument_bytes == 4 * 4 * PARAMS + 4
        assert report.state["optimizer state"] == 3 * 4 * PARAMS + 4
    else:  # params + gradients + AdamW's mu and nu (bf16 like the params) + its int32 step count
        assert opt.argument_bytes == 4 * 2 * PARAMS + 4
    assert report.fits is None and report.hbm_bytes is None  # a CPU: no memory table entry


def test_cli_plan_writes_json_and_says_what_to_turn(tmp_path, capsys):
    # One layer, short sequences, the logps forward only (the update's compile is the tpu tier's):
    # a few seconds of the default tier.
    config = tmp_path / "run.yaml"
    small = {**RUN, "model": {**RUN["model"], "tiny": {**RUN["model"]["tiny"], "num_layers": 1}},
             "data": {"max_prompt_tokens": 8}, "rollout": {"max_new_tokens": 4}}
    config.write_text(json.dumps(small))
    out = tmp_path / "plan.json"
    code = main(["plan", str(config), "--only", "logps", "--hbm-gib", "0.0001", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "DOES NOT FIT" in text
    record = json.loads(out.read_text())
    assert record["fits"] is False and record["hbm_bytes"] == int(0.0001 * (1 << 30))
    (logps,) = record["executables"]
    assert logps["name"] == "logps" and logps["total_bytes"] > record["hbm_bytes"]
    assert record["advice"] and all(a.startswith("logps: ") for a in record["advice"])


@pytest.mark.parametrize("argv, needle", [
    (["--topology", "v5x:2"], "--topology='v5x:2' is not a slice name"),
    (["--topology", "v5p:2x2"], "v5p slices have three dimensions"),
    (["--only", "decode"], "--only names ['decode']"),
    (["--mesh.fsdp=3"], "mesh {data: 1, fsdp: 3, expert: 1, tp: 1} needs 3 devices"),
])
def test_cli_plan_refuses_in_one_line(tmp_path, capsys, argv, needle):
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps(RUN))
    code = main(["plan", str(config), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


def test_hosts_together_keeps_process_rows_consecutive():
    from rlbolt.distributed.mesh import _hosts_together

    class Dev:  # a stand-in with a process index (the order jax.make_mesh gave a v5p:2x2x2 ring)
        def __init__(self, i, p):
            self.id, self.process_index = i, p

        def __repr__(self):
            return f"D{self.id}"

    import numpy as np
    from jax.sharding import Mesh

    devices = [Dev(i, i % 2) for i in range(8)]
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(1, 8, 1, 1), ("data", "fsdp", "expert", "tp"))
    fixed = _hosts_together(mesh)
    assert [d.process_index for d in fixed.devices.flat] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [d.id for d in fixed.devices.flat] == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("message, expected", [
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (146.17G) "
     "exceeds available HBM (95.74G).", int(146.17 * (1 << 30))),
    ("... HLO temporaries (512.00M) exceeds available HBM (15.75G).", 512 << 20),
    ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory in memory "
     "space hbm. Used 5.50M of 5.00M hbm. Exceeded hbm capacity by 507.0K.", int(5.5 * (1 << 20))),  # its allocator
    ("RESOURCE_EXHAUSTED: out of host memory", None),  # another failure is not read as a refusal
])
def test_a_tpu_refusal_is_read_for_the_bytes_it_asked(message, expected):
    from rlbolt.planning.compile import refused_temporaries

    assert refused_temporaries(message) == expected


def test_a_compile_error_other_than_memory_is_raised():
    import jax

    from rlbolt.planning.compile import analyse

    class Lowered:
        def compile(self):
            raise jax.errors.JaxRuntimeError("INVALID_ARGUMENT: something else")

    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        analyse("update", Lowered(), 1, 0, 0.0)
    refused = analyse("update", type("L", (), {"compile": lambda self: (_ for _ in ()).throw(
        jax.errors.JaxRuntimeError("HLO temporaries (2.50G) exceeds available HBM (1.00G)"))})(), 1, 0, 0.0)
    assert refused.temp_bytes == int(2.5 * (1 << 30)) and refused.total_bytes == refused.temp_bytes and refused.refused


def test_the_resident_total_is_the_live_peak_where_the_compiler_gives_one():
    """Hand sums: a TPU's executable holds its live peak + code + what is held outside; without a live peak
    (CPU, GPU) every buffer counts as live at once. The batch-bound part is what the peak holds past the fixed."""
    from rlbolt.planning.compile import Executable

    kw = dict(flops=0.0, bytes_accessed=0.0, seconds=None, compile_seconds=1.0, held_outside=7)
    summed = Executable("update", 1, 100, 60, 500, 50, 3, **kw)
    assert summed.summed_bytes == 100 + 60 + 500 - 50 and summed.total_bytes == 610 + 3 + 7
    assert summed.fixed_bytes == 100 + 60 - 50 + 3 + 7 and summed.working_bytes == 500
    peaked = Executable("update", 1, 100, 60, 500, 50, 3, **kw, live_peak_bytes=400)
    assert peaked.total_bytes == 400 + 3 + 7 and peaked.summed_bytes == 610
    assert peaked.working_bytes == 410 - 120  # the temporaries live at the peak, not the heap's 500
    assert Executable("update", 1, 100, 0, 0, 0, 0, **kw, live_peak_bytes=90).working_bytes == 0  # never negative


@pytest.mark.parametrize("remat, says_remat, context", [("none", True, 1), ("full", False, 1), ("full", False, 4)])
def test_advice_past_one_row_names_only_knobs_not_yet_turned(remat, says_remat, context):
    """The 7B update at 16k on v6e:2x4 (remat full already) was told to 'rematerialise activations':
    past one row per shard, the advice names model.remat only when it is not full, and mesh.context (a
    larger one, with its size now, when the mesh already splits sequences)."""
    from types import SimpleNamespace

    from rlbolt.planning.compile import Executable
    from rlbolt.planning.report import PlanReport, advice

    gib = 1 << 30
    update = Executable("update", 1, 12 * gib, 12 * gib, 21 * gib, 12 * gib, 0, 0.0, 0.0, None, 1.0)
    report = PlanReport("v6e:2x4", "TPU v6 lite", 8, {"fsdp": 8}, 32 * gib, "table", None, [update], {}, 0, {})
    run = SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(remat=remat)),
                          plan=SimpleNamespace(train_micro_batch_size=8, logps_micro_batch_size=8,
                                               rollout_micro_batch_size=8),
                          sharding=SimpleNamespace(batch_shards=8, mesh=SimpleNamespace(shape={"context": context})))
    (line,) = advice(report, run)
    assert line.startswith("update: even plan.train_micro_batch_size=8 (one row per batch shard) would not fit")
    assert ("model.remat: full" in line) is says_remat and "mesh.context" in line and "mesh.tp" in line
    assert (f"a larger mesh.context (now {context}" in line) is (context > 1)


def test_the_config_callbacks_leave_the_planned_optimizer_as_the_run_compiles_it(tmp_path):
    """The Trainer passes the module's optimizer through every callback's `wrap_optimizer` before the float32
    masters; `build_abstract` plans it without them. That is the run's optimizer exactly while the callbacks a
    config builds return it unchanged (NaNGuard's default "stop"; "skip" would wrap it in apply_if_finite and is
    reachable only from Python). A config field that changes this must be applied in `build_abstract` too."""
    from rlbolt.app.build import build_callbacks

    tx = optax.adamw(1e-3)
    callbacks = build_callbacks(load_config(RUN), tmp_path)
    assert any(type(c).__name__ == "NaNGuard" for c in callbacks)  # the one built-in that can wrap
    for callback in callbacks:
        assert callback.wrap_optimizer(None, tx) is tx, type(callback).__name__
