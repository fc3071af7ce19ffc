"""The plan's verdict: per-device memory against the chip, the step estimate, and what to change.

Every time in it is the compiler's cost-model estimate (`optimal_seconds`), not a measurement;
model FLOPs utilisation (MFU) divides the model's FLOPs (6 x parameters x trained tokens, 2 x
parameters x forward tokens) by that estimate times the chips' peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import numpy as np

from rlbolt.planning.compile import Executable, compile_executables, packed_layout, prompt_width

GIB = 1 << 30
STEP = ("update", "logps", "rollout")  # a step runs these; grad and optimizer are parts of the update


@dataclasses.dataclass
class PlanReport:
    """The compiled plan of one run on one device set (`plan_run`); `text()` and `to_json()`.

    Attributes:
      target: the topology name or "this host".
      device_kind: the devices' kind.
      devices: how many devices.
      mesh: the training mesh's axis sizes.
      hbm_bytes: memory per device (None: unknown, e.g. a CPU).
      hbm_source: memory_stats, table (<chip>) or unknown.
      peak_flops: peak bf16 FLOP/s per device from the chip table (None: unknown).
      executables: the compiled executables.
      state: per-device bytes of params, gradients, optimizer state and the frozen copies.
      floor_bytes: the analytic floor per device (state + one layer-boundary activation per layer).
      model_flops: {executable: model FLOPs of one call}.
      advice: what to change when it does not fit.
    """

    target: str
    device_kind: str
    devices: int
    mesh: dict[str, int]
    hbm_bytes: int | None
    hbm_source: str
    peak_flops: float | None
    executables: list[Executable]
    state: dict[str, int]
    floor_bytes: int
    model_flops: dict[str, float]
    advice: list[str] = dataclasses.field(default_factory=list)
    accum: int = 1

    def seconds_of(self, e: Executable) -> float | None:
        """The compiler's estimate of one call of `e`. XLA's cost analysis counts a loop body once,
        so the update's A micro batches count as one: with the optimizer compiled too, the update is
        its estimate plus (A - 1) x (update - optimizer). The rollout's decode loop stays one step per
        segment (a lower bound)."""
        if e.seconds is None or e.name != "update" or self.accum == 1:
            return e.seconds
        opt = next((o.seconds for o in self.executables if o.name == "optimizer" and o.seconds is not None), None)
        return None if opt is None else e.seconds + (self.accum - 1) * max(e.seconds - opt, 0.0)

    @property
    def peak_bytes(self) -> int:
        """The largest resident total per device over the executables."""
        return max(e.total_bytes for e in self.executables)

    @property
    def fits(self) -> bool | None:
        """Whether every executable's resident total fits the device (None: memory unknown)."""
        return None if self.hbm_bytes is None else self.peak_bytes <= self.hbm_bytes

    @property
    def step_seconds(self) -> float | None:
        """The compiler's estimate of one global step (sum of calls x estimate; None if any is missing)."""
        chosen = [e for e in self.executables if e.name in STEP]
        seconds = [self.seconds_of(e) for e in chosen]
        return None if not chosen or None in seconds else sum(e.calls * t for e, t in zip(chosen, seconds))

    def mfu(self, name: str | None = None) -> float | None:
        """Model FLOPs utilisation of one executable (or the whole step) under the compiler's estimate."""
        if self.peak_flops is None:
            return None
        chosen = [e for e in self.executables if (e.name == name if name else e.name in STEP)]
        if not chosen or any(self.seconds_of(e) is None for e in chosen):
            return None
        flops = sum(self.model_flops.get(e.name, 0.0) * e.calls for e in chosen)
        seconds = sum(self.seconds_of(e) * e.calls for e in chosen)
        return flops / (seconds * self.peak_flops * self.devices) if seconds > 0 else None

    def to_json(self) -> dict[str, Any]:
        """The report as one JSON-ready dict."""
        return {"target": self.target, "device_kind": self.device_kind, "devices": self.devices, "mesh": self.mesh,
                "hbm_bytes": self.hbm_bytes, "hbm_source": self.hbm_source, "peak_flops": self.peak_flops,
                "fits": self.fits, "peak_bytes": self.peak_bytes, "floor_bytes": self.floor_bytes,
                "state": self.state, "step_seconds_estimate": self.step_seconds, "mfu_estimate": self.mfu(),
                "update_mfu_estimate": self.mfu("update"),
                "grad_accum_steps": self.accum,
                "executables": [{**dataclasses.asdict(e), "total_bytes": e.total_bytes, "summed_bytes": e.summed_bytes,
                                 "seconds_per_call": self.seconds_of(e), "model_flops": self.model_flops.get(e.name)}
                                for e in self.executables],
                "advice": self.advice,
                "note": "times are the compiler's cost-model estimates (optimal_seconds), not measurements; XLA counts "
                        "a loop body once: the update is corrected for its A micro batches, the rollout's decode "
                        "loop is not (a lower bound), and with scanned layers the training executables give no time"}

    def text(self) -> str:
        """The human-readable plan (one table per device, the verdict, the estimate and the advice)."""
        unit, scale = ("GiB", GIB) if self.peak_bytes >= GIB else ("MiB", 1 << 20)
        g = lambda n: f"{n / scale:8.2f}"  # noqa: E731
        hbm = f"{self.hbm_bytes / GIB:.2f} GiB ({self.hbm_source})" if self.hbm_bytes else "unknown (no table entry)"
        mesh = " ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [f"plan for {self.target}: {self.devices} x {self.device_kind}, mesh {mesh}, memory per device {hbm}",
                 f"per device, {unit}   args  outputs    temps  aliased live peak  held outside    total   calls/step     GFLOP  "
                 "GB accessed  est. ms"]
        for e in self.executables:
            seconds = self.seconds_of(e)
            est = f"{seconds * 1e3:8.2f}" if seconds is not None else "       -"
            peak = g(e.live_peak_bytes) if e.live_peak_bytes else "       -"
            lines.append(f"  {e.name:<10}{g(e.argument_bytes)} {g(e.output_bytes)} {g(e.temp_bytes)} "
                         f"{g(e.alias_bytes)}  {peak}      {g(e.held_outside)} {g(e.total_bytes)}   {e.calls:10d} "
                         f"{e.flops / 1e9:9.1f} {e.bytes_accessed / 1e9:12.2f} {est}   (compiled in {e.compile_seconds:.1f} s)")
            if e.refused:
                lines.append(f"    the compiler refused {e.name}: {e.refused}")
        if any(e.live_peak_bytes for e in self.executables):
            lines.append("total: the compiler's live peak (arguments, outputs and temporaries live at once; what its "
                         "own HBM check counts) + code + held outside. args + outputs + temps - aliased overstates it: "
                         "the temporaries are a heap sized past their peak")
        state = ", ".join(f"{k} {v / scale:.2f}" for k, v in self.state.items())
        lines.append(f"state per device ({unit}): {state}; analytic floor {self.floor_bytes / scale:.2f} {unit} "
                     f"(peak / floor = {self.peak_bytes / max(self.floor_bytes, 1):.2f})")
        verdict = {True: "FITS", False: "DOES NOT FIT", None: "fit unknown (device memory not known)"}[self.fits]
        of = f" of {self.hbm_bytes / GIB:.2f} GiB" if self.hbm_bytes else ""
        worst = max(self.executables, key=lambda e: e.total_bytes)
        lines.append(f"{verdict}: peak {self.peak_bytes / scale:.2f} {unit} per device{of} (in {worst.name})")
        step = self.step_seconds
        if step is None:
            lines.append("step estimate: none (this backend's compiler gives no time estimate, an executable was "
                         "refused, the layers run as one scanned body (the compiler counts one layer; plan with "
                         "model.scan_layers: false for the time), or the update's correction for its micro batches "
                         "needs the optimizer compiled too)")
        else:
            mfu, umfu = self.mfu(), self.mfu("update")
            lines.append(f"step estimate (the compiler's cost model, not a measurement): {step:.3f} s per global step"
                         + (f", MFU {mfu:.1%} (update alone {umfu:.1%})" if mfu is not None and umfu is not None else "")
                         + "; the rollout's decode loop counts one step per segment (a lower bound)")
        lines += [f"  - {a}" for a in self.advice]
        return "\n".join(lines)


def plan_run(run: Any, target: str = "this host", names: tuple[str, ...] = ("update", "optimizer", "logps", "rollout"),
             hbm_bytes: int | None = None) -> PlanReport:
    """Compiles `run`'s executables and judges them against the device's memory.

    Args:
      run: a `rlbolt.planning.AbstractRun`.
      target: the topology name, for the report.
      names: the executables to compile.
      hbm_bytes: memory per device to judge against (None: `device_hbm_bytes` of the first device).
    """
    from rlbolt.distributed.sharding import per_device_bytes
    from rlbolt.distributed.topology import chip_of, device_hbm_bytes

    device = run.devices[0]
    source = "given"
    if hbm_bytes is None:
        hbm_bytes, source = device_hbm_bytes(device)
    chip = chip_of(device)
    executables = compile_executables(run, names)
    params = per_device_bytes(run.params)
    extra = run.module.memory_plan(run.sharding)
    state = {"params": params, "gradients": params, "optimizer state": per_device_bytes(run.opt_state),
             **{k: v for k, v in extra.items() if k != "kv cache"}}
    report = PlanReport(target, str(device.device_kind), len(run.devices), dict(run.sharding.mesh.shape), hbm_bytes,
                        source, chip.peak_flops if chip else None, executables, state,
                        sum(state.values()) + boundary_activation_bytes(run), model_flops(run),
                        accum=run.plan.grad_accum_steps)
    report.advice = advice(report, run)
    return report


def boundary_activation_bytes(run: Any) -> int:
    """One [rows, P + C, hidden] residual per layer per device for a train micro batch (what full
    remat keeps), in the compute dtype; with mesh.context = n a device holds 1/n of each row's tokens."""
    config, plan = run.module.model.config, run.plan
    rows = -(-(plan.train_micro_batch_size) // run.sharding.batch_shards)
    tokens = prompt_width(run) + run.module.completion_width
    packed = packed_layout(run, plan.train_micro_batch_size)
    if packed is not None:  # plan.packing: the packed rows' tokens
        rows, tokens = packed
    itemsize = np.dtype(jax.numpy.dtype(config.dtype)).itemsize
    tokens = -(-tokens // run.sharding.mesh.shape.get("context", 1))
    return config.num_layers * rows * tokens * config.hidden_size * itemsize


def model_flops(run: Any) -> dict[str, float]:
    """Model FLOPs of one call of each executable: 6 N T (update), 2 N T (logps, rollout)."""
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(run.module.policy_params(run.module.full_params(run.params))))
    plan, width = run.plan, prompt_width(run) + run.module.completion_width
    packed = packed_layout(run, plan.train_micro_batch_size)
    train = (plan.train_micro_batch_size * width if packed is None  # plan.packing: the packed rows' tokens
             else packed[0] * packed[1] * run.sharding.batch_shards)
    return {"update": 6.0 * n * train * plan.grad_accum_steps,
            "grad": 6.0 * n * train,
            "logps": 2.0 * n * plan.logps_micro_batch_size * width,
            "rollout": 2.0 * n * plan.rollout_micro_batch_size * width}


def advice(report: PlanReport, run: Any) -> list[str]:
    """Which knob to turn and by how much, for each executable that does not fit."""
    if report.fits is not False:
        return []
    hbm, plan, out = report.hbm_bytes, run.plan, []
    shards = run.sharding.batch_shards
    for e in sorted(report.executables, key=lambda e: -e.total_bytes):
        if e.total_bytes <= hbm:
            continue
        fixed, working = e.fixed_bytes, e.working_bytes
        if fixed > hbm:  # parameters, gradients and state alone: shard them over more devices
            ways = math.ceil(fixed / hbm)
            out.append(f"{e.name}: without temporaries it holds {fixed / GIB:.2f} GiB per device, over "
                       f"{hbm / GIB:.2f}: spread parameters, gradients and optimizer state over about {ways}x more "
                       "devices (a larger slice on mesh.fsdp), or give the reference devices of its own "
                       "(trainer.placement.reference)")
            continue
        field, size = {"update": ("plan.train_micro_batch_size", plan.train_micro_batch_size),
                       "grad": ("plan.train_micro_batch_size", plan.train_micro_batch_size),
                       "logps": ("plan.logps_micro_batch_size", plan.logps_micro_batch_size),
                       "rollout": ("plan.rollout_micro_batch_size", plan.rollout_micro_batch_size)
                       }.get(e.name, (None, None))
        if field is None:
            out.append(f"{e.name}: its temporaries ({working / GIB:.2f} GiB) do not fit; use more devices")
            continue
        fitting = int(size * (hbm - fixed) / max(working, 1)) // shards * shards  # temps ~ linear in rows
        if fitting >= shards:
            out.append(f"{e.name}: temporaries {working / GIB:.2f} GiB at {field}={size}; they scale about "
                       f"linearly with it: {field}={fitting} would fit ({hbm - fixed:.0f} B left for them)"
                       .replace(f"({hbm - fixed:.0f} B", f"({(hbm - fixed) / GIB:.2f} GiB"))
        else:
            out.append(f"{e.name}: even {field}={shards} (one row per batch shard) would not fit; "
                       + ", ".join(_per_row_knobs(run.config.model.remat, e.name, run.sharding.mesh.shape["context"])))
    return out


def _per_row_knobs(remat: str, executable: str, context: int = 1) -> list[str]:
    """What is left to turn when one row per batch shard does not fit: the knobs not yet at their end
    (`context`: the mesh's context size now)."""
    knobs = [] if remat == "full" or executable != "update" else [f"model.remat: full (now {remat})"]
    if executable in ("update", "logps"):
        knobs.append("mesh.context (each sequence split over devices)" if context == 1 else
                     f"a larger mesh.context (now {context}; each sequence split over more devices)")
    return knobs + ["move devices to mesh.tp", "or use a larger slice"]


def write_json(report: PlanReport, path: str) -> None:
    """Writes `report.to_json()` to `path` atomically (a temporary file renamed)."""
    import os
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".plan-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(report.to_json(), f, indent=1)
    os.replace(tmp, path)


__all__ = ["PlanReport", "advice", "boundary_activation_bytes", "model_flops", "plan_run", "write_json"]
