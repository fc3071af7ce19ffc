"""The imports a Lightning or Keras user tries first work, and `rlbolt --help` stays light."""

from __future__ import annotations

import subprocess
import sys


def test_main_classes_import_from_the_top_level_and_are_the_core_classes():
    import rlbolt
    from rlbolt import BatchPlan, Callback, RLModule, Trainer
    from rlbolt.callback import Callback as core_callback
    from rlbolt.module import RLModule as core_module
    from rlbolt.plan import BatchPlan as core_plan
    from rlbolt.trainer import Trainer as core_trainer

    assert (Trainer, RLModule, Callback, BatchPlan) == (core_trainer, core_module, core_callback, core_plan)
    assert set(rlbolt.__all__) <= set(dir(rlbolt))


def test_base_classes_import_from_the_plural_packages_too():
    from rlbolt.callback import Callback, Periodic
    from rlbolt.callbacks import Callback as from_callbacks
    from rlbolt.callbacks import Periodic as periodic_from_callbacks
    from rlbolt.module import RLModule
    from rlbolt.modules import RLModule as from_modules

    assert from_callbacks is Callback and periodic_from_callbacks is Periodic and from_modules is RLModule


def test_unknown_top_level_name_is_an_attribute_error():
    import rlbolt

    try:
        rlbolt.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("rlbolt.NoSuchThing did not raise")


def test_importing_the_package_does_not_import_jax():
    code = "import sys, rlbolt, rlbolt.app.cli; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_python_dash_m_rlbolt_is_the_command():
    out = subprocess.run([sys.executable, "-m", "rlbolt", "--help"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("usage: rlbolt")
