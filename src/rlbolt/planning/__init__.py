"""`rlbolt plan`: build a run abstractly and compile one step's executables for a device set.

    run = build_abstract(cfg, target_devices("v5p:2x2x2"))   no weights read, nothing on any device
    report = plan_run(run)                                   compiles update, optimizer, logps, rollout
    print(report.text()); report.to_json()

`schema.py` declares the batches each executable takes (ShapeDtypeStructs), `build.py` the abstract
run, `compile.py` the executables' memory and cost, `report.py` the verdict, the step estimate and
which knob to turn.
"""

from rlbolt.planning.build import AbstractRun, build_abstract
from rlbolt.planning.compile import Executable, compile_executables
from rlbolt.planning.report import PlanReport, plan_run

__all__ = ["AbstractRun", "Executable", "PlanReport", "build_abstract", "compile_executables", "plan_run"]
