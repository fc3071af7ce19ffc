"""Compile the executables of one step of an abstract run and read what the compiler says.

    update     the training micro-batch gradients (a scan over the A micro batches) and the optimizer
               step: the one executable `Trainer` compiles per mini batch (`rlbolt.update`)
    grad       one train micro batch's loss and gradients alone (not compiled by default: the update
               holds it; `--only grad` shows its share)
    optimizer  the optimizer step alone (gradients in, parameters and state out): its share of the update
    logps      one logps micro batch's forward, the old and the reference log-probs' executable
    reference  (compiled with logps when the reference is placed on devices of its own) its forward
    teacher    on that role's mesh; its devices hold nothing else, and they run beside the training ones
    rollout    one sampler call: each group's prompt prefilled into the KV cache, then the decode loop

Each is lowered with ShapeDtypeStructs under the run's shardings and compiled for the mesh's devices
(a described TPU slice compiles with libtpu's real TPU compiler on this host). `memory_analysis()`
is the buffer assignment per device; `cost_analysis()` the compiler's flops, bytes and time estimate.

What an executable holds per device: on a TPU, the compiler's own peak of live buffers
(`peak_memory_in_bytes`: arguments, outputs and temporaries live at once), the figure libtpu's
compile-time HBM check counts; its `temp_size_in_bytes` is a heap sized past that peak, so
arguments + outputs + temporaries - aliased overstates it. Other backends report no comparable peak
(XLA:CPU's leaves the arguments out), and there the sum stands.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from typing import Any

import jax

from rlbolt import master_weights
from rlbolt.models.scan_layers import scan_reason
from rlbolt.packing.layout import source_slots
from rlbolt.packing.logps import PackedLogps
from rlbolt.planning import schema


@dataclasses.dataclass(frozen=True)
class Executable:
    """What the compiler says about one executable, per device.

    Attributes:
      name: update, optimizer, logps or rollout.
      calls: how many times one global step runs it.
      argument_bytes, output_bytes, temp_bytes, alias_bytes, code_bytes: `memory_analysis()`.
      flops, bytes_accessed: `cost_analysis()` (a loop's body is counted once by XLA's cost analysis).
      seconds: the compiler's time estimate (`optimal_seconds`; None when the backend gives none).
      compile_seconds: how long lowering and compiling took here.
      held_outside: bytes per device resident while it runs that are not its arguments (optimizer
        state during the rollout, the reference during the update, ...).
      refused: the compiler's own words when it refused to compile because the temporaries exceed the
        device's memory (then `temp_bytes` is the amount it asked for and the other sizes are 0).
      live_peak_bytes: the TPU compiler's peak of live buffers, arguments included (`peak_memory_in_bytes`;
        0 where the backend gives none comparable).
    """

    name: str
    calls: int
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    code_bytes: int
    flops: float
    bytes_accessed: float
    seconds: float | None
    compile_seconds: float
    held_outside: int = 0
    refused: str | None = None
    live_peak_bytes: int = 0

    @property
    def summed_bytes(self) -> int:
        """Arguments + outputs + temporaries - aliased: every buffer as if all were live at once."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    @property
    def fixed_bytes(self) -> int:
        """What it holds whatever its batch: arguments + outputs - aliased + code + held outside."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.code_bytes + self.held_outside

    @property
    def total_bytes(self) -> int:
        """Resident per device while it runs: the compiler's live peak (else `summed_bytes`) + code + held outside."""
        return (self.live_peak_bytes or self.summed_bytes) + self.code_bytes + self.held_outside

    @property
    def working_bytes(self) -> int:
        """The part of `total_bytes` that grows with the batch: the temporaries live at the peak."""
        return max(self.total_bytes - self.fixed_bytes, 0)


_REFUSALS = (re.compile(r"HLO temporaries \(([0-9.]+)([KMGT]?)\) exceeds available HBM"),
             re.compile(r"memory space hbm\. Used ([0-9.]+)([KMGT]?) of [0-9.]+[KMGT]? hbm"))
_UNIT = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def refused_temporaries(message: str) -> int | None:
    """The bytes per device a TPU compile that ran out of memory asked for (None: another error).

    libtpu refuses in two places, both counting the live peak with the arguments: before allocating,
    "RESOURCE_EXHAUSTED: ... the total memory required for HLO temporaries (146.17G) exceeds available
    HBM (95.74G)", and in its allocator, "RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: ... Ran out of
    memory in memory space hbm. Used 5.50M of 5.00M hbm.".
    """
    for pattern in _REFUSALS:
        found = pattern.search(message)
        if found is not None:
            return int(float(found.group(1)) * _UNIT[found.group(2)])
    return None


def analyse(name: str, lowered: Any, calls: int, held_outside: int, started: float,
            loop_counted_once: bool = False, live_peak: bool = False) -> Executable:
    """Compiles `lowered` and reads its memory and cost analyses.

    A compile the TPU compiler refuses for memory becomes an Executable with `refused` set, so the
    report says DOES NOT FIT with the compiler's figure instead of failing. With `loop_counted_once`
    (the layers run as one scanned body) the cost analysis counts one layer, so no time is reported.
    With `live_peak` (a TPU) the compiler's `peak_memory_in_bytes` is kept as the executable's peak.
    """
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        asked = refused_temporaries(str(error))
        if asked is None:
            raise
        return Executable(name, calls, 0, 0, asked, 0, 0, 0.0, 0.0, None, time.perf_counter() - started,
                          held_outside, refused=str(error).strip().splitlines()[0][:300])
    took = time.perf_counter() - started
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, (list, tuple)):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    get = lambda field: int(getattr(memory, field, 0) or 0) if memory is not None else 0  # noqa: E731
    seconds = None if loop_counted_once else cost.get("optimal_seconds")
    return Executable(name, calls, get("argument_size_in_bytes"), get("output_size_in_bytes"),
                      get("temp_size_in_bytes"), get("alias_size_in_bytes"), get("generated_code_size_in_bytes"),
                      float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)),
                      float(seconds) if seconds is not None and seconds > 0 else None, took, held_outside,
                      live_peak_bytes=get("peak_memory_in_bytes") if live_peak else 0)


def compile_executables(run: Any, names: tuple[str, ...] = ("update", "optimizer", "logps", "rollout")
                        ) -> list[Executable]:
    """The `names` executables of one step of `run` (a `rlbolt.planning.AbstractRun`), compiled.

    Args:
      run: the abstract run.
      names: which executables (a subset of update, optimizer, logps, rollout).
    """
    from rlbolt.distributed.sharding import per_device_bytes

    module, plan, sharding = run.module, run.plan, run.sharding
    extra = module.memory_plan(sharding)
    frozen_copies = sum(v for k, v in extra.items() if k in ("reference", "teacher"))
    opt_bytes = per_device_bytes(run.opt_state)
    model = run.module.model
    scanned = model.scan_layers and scan_reason(model) is None  # the training forwards run one scanned body
    analyse_ = functools.partial(analyse, live_peak=run.devices[0].platform == "tpu")
    out = []
    for name in names:
        started = time.perf_counter()
        if name == "update":
            out.append(analyse_(name, _lower_update(run), _updates_per_step(plan), frozen_copies, started, scanned))
        elif name == "grad":
            out.append(analyse_(name, _lower_grad(run), _updates_per_step(plan) * plan.grad_accum_steps,
                               opt_bytes + frozen_copies, started, scanned))
        elif name == "optimizer":
            out.append(analyse_(name, _lower_optimizer(run), _updates_per_step(plan), frozen_copies, started))
        elif name == "logps":
            calls = (plan.global_batch_size // plan.logps_micro_batch_size) * _forwards(run)
            if calls:  # none on the training devices when the only forward is a placed reference's
                out.append(analyse_(name, _lower_logps(run), calls, opt_bytes + frozen_copies, started, scanned))
            for role, scorer in _placed_scorers(run).items():  # each on its own devices: nothing else held there
                started = time.perf_counter()
                inputs = schema.logps_inputs(plan.logps_micro_batch_size, prompt_width(run), module.completion_width,
                                             scorer.plan)
                out.append(analyse_(role, scorer.lower(*inputs), plan.global_batch_size // plan.logps_micro_batch_size,
                                   0, started, scanned))
        elif name == "rollout":
            lowered, calls = _lower_rollout(run)
            apart = run.shardings["rollout"] is not sharding  # its own devices hold only its weights and cache
            out.append(analyse_(name, lowered, calls, 0 if apart else opt_bytes + frozen_copies, started))
        else:
            raise ValueError(f"unknown executable {name!r}; choose from update, grad, optimizer, logps, rollout")
    return out


def prompt_width(run: Any) -> int:
    """P: the padded prompt width (`data.max_prompt_tokens`)."""
    return run.module.encoder.width


def _updates_per_step(plan: Any) -> int:
    return plan.num_iterations * plan.global_batch_size // plan.mini_batch_size


def packed_layout(run: Any, samples: int) -> tuple[int, int] | None:
    """plan.packing: (packed rows per batch shard, tokens per row) of a micro batch of `samples`:
    `plan.packed_rows` when fixed, else one row per sample (the most a step can need); None: padded."""
    plan = run.plan
    if plan.packing != "on":
        return None
    block = max(1, samples // run.sharding.batch_shards)
    width = plan.packed_row_tokens or prompt_width(run) + run.module.completion_width
    return (plan.packed_rows or block), width


def packed_sources(run: Any, samples: int) -> int | None:
    """plan.packing: S, the `pack_sources` entries per sample of a micro batch of `samples` (the most a
    step can need when `plan.packed_rows` is not fixed); None: padded."""
    layout = packed_layout(run, samples)
    if layout is None:
        return None
    block = max(1, samples // run.sharding.batch_shards)
    return source_slots(block, run.module.completion_width, layout[1], rows=run.plan.packed_rows)


_ROLE = {"ref": "reference", "teacher": "teacher"}


def _placed_scorers(run: Any) -> dict[str, Any]:
    """role -> the module's scorer that runs on devices of its own (`trainer.placement.reference|teacher`)."""
    return {_ROLE.get(name, name): s for name, s in run.module.scorers.items() if not s.on_train_devices}


def _forwards(run: Any) -> int:
    """Logps forwards per sample on the training devices: each colocated scorer's (the reference when
    beta > 0, a teacher) and the old policy's (num_iterations > 1)."""
    colocated = sum(1 for s in run.module.scorers.values() if s.on_train_devices)
    return colocated + int(run.plan.num_iterations > 1)


def _lower_update(run: Any) -> Any:
    from rlbolt.update import make_update_fn

    module, plan = run.module, run.plan
    accum = plan.grad_accum_steps
    update = make_update_fn(module.training_step, run.optimizer, accum, frozen=module.frozen_params(),
                            with_frozen=module.with_frozen, sharding=run.sharding, params=run.params,
                            opt_state=run.opt_state)
    packed = packed_layout(run, plan.mini_batch_size // accum)
    micro = schema.train_batch(accum, plan.mini_batch_size // accum, prompt_width(run), module.completion_width,
                               reference=run.config.algorithm.beta > 0, sharding=run.sharding,
                               packed_rows=packed and packed[0],
                               packed_sources=packed_sources(run, plan.mini_batch_size // accum))
    return update.func.lower(run.params, run.opt_state, micro, module.frozen_params())


def _lower_grad(run: Any) -> Any:
    from rlbolt.update import _shardings_of

    module, plan = run.module, run.plan
    accum = plan.grad_accum_steps
    packed = packed_layout(run, plan.mini_batch_size // accum)
    micro = schema.train_batch(1, plan.mini_batch_size // accum, prompt_width(run), module.completion_width,
                               reference=run.config.algorithm.beta > 0, sharding=run.sharding,
                               packed_rows=packed and packed[0],
                               packed_sources=packed_sources(run, plan.mini_batch_size // accum))
    micro = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=run.sharding.batch_sharding()),
                         micro)
    rows = micro["completion_mask"].shape[0]
    micro = micro.with_columns(
        mini_batch_num_tokens=jax.ShapeDtypeStruct((rows,), jax.numpy.float32, sharding=run.sharding.batch_sharding()),
        mini_batch_num_samples=jax.ShapeDtypeStruct((rows,), jax.numpy.float32, sharding=run.sharding.batch_sharding()))
    frozen = module.frozen_params()

    def loss(params, batch, frozen):
        return module.training_step(module.with_frozen(params, frozen), batch)

    grad = jax.value_and_grad(loss, has_aux=True)
    return jax.jit(grad, out_shardings=((run.sharding.replicated, run.sharding.replicated), _shardings_of(run.params))
                   ).lower(run.params, micro, frozen)


def _lower_optimizer(run: Any) -> Any:
    from rlbolt.update import _shardings_of

    p, o = _shardings_of(run.params), _shardings_of(run.opt_state)

    def step(params, grads, opt_state):
        updates, opt_state = run.optimizer.update(grads, opt_state, params)
        return master_weights.apply(params, updates, opt_state), opt_state

    # The gradients as the update hands them over: summed in the masters' dtype when there are masters.
    masters = master_weights.masters_of(run.opt_state)
    return jax.jit(step, out_shardings=(p, o)).lower(run.params, run.params if masters is None else masters,
                                                     run.opt_state)


def _lower_logps(run: Any) -> Any:
    module, plan = run.module, run.plan
    rows = plan.logps_micro_batch_size
    inputs = schema.logps_inputs(rows, prompt_width(run), module.completion_width, run.sharding)
    lm_params = module.policy_params(module.full_params(run.params))
    packed = packed_layout(run, rows)
    if packed is not None and isinstance(module.policy.logps, PackedLogps):  # plan.packing: the packed forward
        return module.policy.logps.lower_packed(
            lm_params, *inputs, rows_per_block=packed[0],
            blocks=run.sharding.batch_shards if rows % run.sharding.batch_shards == 0 else 1)
    return module.policy.logps.lower(lm_params, *inputs, group_size=module.group_size_for(rows, plan))


def _lower_rollout(run: Any) -> tuple[Any, int]:
    from rlbolt.rollout.compaction import next_power_of_two
    from rlbolt.rollout.decode import _generate_jit, decode_segments
    from rlbolt.rollout.sampler import DEFAULT_PROMPT_BUCKETS, NativeSampler

    module, plan, r = run.module, run.plan, run.config.rollout
    target = run.shardings["rollout"]
    eos = module.tokenizer.eos_id
    sampler = NativeSampler(module.policy.rollout_model(target), max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                            top_p=r.top_p, stop_token_ids=(eos,) if r.stop_at_eos else (), pad_id=module.tokenizer.pad_id,
                            share_prompts=run.config.model.share_prompt, sharding=target)
    width = prompt_width(run)
    bucket = next((b for b in DEFAULT_PROMPT_BUCKETS if b >= width), width)
    rows = next_power_of_two(plan.rollout_micro_batch_size)
    rows = -(-rows // target.batch_shards) * target.batch_shards
    g = plan.num_generations
    group = g if sampler.share_prompts and rows % g == 0 else 1
    calls = -(-plan.global_batch_size // rows)
    inputs = schema.rollout_inputs(rows, group, bucket, target)
    lowered = _generate_jit.lower(sampler._params, *inputs, graphdef=sampler._graphdef, sp=sampler.sampling,
                                  group=group, segments=decode_segments(r.max_new_tokens, sampler.decode_segment),
                                  layout=sampler._layout, compact=sampler.compact_finished,
                                  record_routing=sampler.record_routing)
    return lowered, calls


__all__ = ["Executable", "analyse", "compile_executables", "prompt_width"]
