"""`rlbolt plan CONFIG [--topology v5p:2x2x2] [--json FILE]`: compile one step of a run for a device
set and say whether it fits, without weights or the hardware (`rlbolt.planning`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

class PlanInputError(ValueError):
    """A bad `rlbolt plan` option (reported in one line, exit status 2)."""


EXECUTABLES = ("update", "optimizer", "logps", "rollout")  # compiled by default
OPTIONAL = ("grad",)  # one train micro batch's gradients alone (inside the update)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Adds the `plan` subcommand to the CLI's subparsers."""
    plan = sub.add_parser(
        "plan", help="compile one step of a run for a TPU slice or this host's devices: memory, fit, step estimate",
        description="Build the run of CONFIG abstractly (config.json only, no weights), compile its executables "
                    "(update, optimizer, logps, rollout) for the devices of --topology (a TPU slice, compiled on "
                    "this host with libtpu: the rlbolt[tpu] extra) or of this host, and print per device: "
                    "arguments, outputs, temporaries, the total against the device's memory, FITS / DOES NOT FIT, "
                    "flops and the compiler's time estimate. Override fields with --section.key=value.")
    plan.add_argument("config", help="a YAML config, the same as `rlbolt fit` takes")
    plan.add_argument("--topology", help="a TPU slice, e.g. v5e:4x4, v5p:2x2x2, v6e:2x4 (default: this host's devices)")
    plan.add_argument("--json", dest="json_path", metavar="FILE", help="also write the plan as one JSON object")
    plan.add_argument("--only", help=f"comma-separated executables to compile (default: {','.join(EXECUTABLES)}; also: grad)")
    plan.add_argument("--hbm-gib", type=float, help="judge against this memory per device instead of the table's")


def run_plan(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    """The `plan` subcommand: prints the plan (and writes --json); returns 0.

    Raises:
      PlanInputError: a bad --only, --hbm-gib or --json path, or a mesh that does not fit the devices.
      TopologyError, ConfigError, PlanError: refusals, each one line.
    """

    names = tuple(n.strip() for n in args.only.split(",")) if args.only else EXECUTABLES
    unknown = [n for n in names if n not in EXECUTABLES + OPTIONAL]
    if unknown:
        raise PlanInputError(f"--only names {unknown}; choose from {','.join(EXECUTABLES + OPTIONAL)}")
    if args.hbm_gib is not None and args.hbm_gib <= 0:
        raise PlanInputError(f"--hbm-gib={args.hbm_gib} must be > 0 (GiB per device)")
    if args.json_path and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_path))):
        raise PlanInputError(f"--json={args.json_path}: its folder does not exist")
    if args.topology and "JAX_PLATFORMS" not in os.environ:
        import jax

        jax.config.update("jax_platforms", "cpu")  # compile for the slice; never claim this host's accelerator
    from rlbolt.config import load_config
    from rlbolt.distributed.topology import parse_topology, target_devices
    from rlbolt.planning import build_abstract, plan_run
    from rlbolt.planning.report import write_json

    if args.topology:
        parse_topology(args.topology)  # a malformed name is refused before the config is read
    cfg = load_config(args.config, list(overrides))
    from rlbolt.distributed.mesh import MeshError

    devices = target_devices(args.topology)
    try:
        run = build_abstract(cfg, devices)
    except MeshError as error:  # a mesh or batch size that does not fit this device set: one line
        raise PlanInputError(f"{error} (planning for {args.topology or 'this host'}: {len(devices)} devices)") from None
    hbm = None if args.hbm_gib is None else int(args.hbm_gib * (1 << 30))
    report = plan_run(run, args.topology or "this host", names, hbm_bytes=hbm)
    print(report.text(), flush=True)
    if args.json_path:
        write_json(report, args.json_path)
        print(f"wrote {args.json_path}")
    return 0


__all__ = ["EXECUTABLES", "OPTIONAL", "PlanInputError", "add_parser", "run_plan"]
