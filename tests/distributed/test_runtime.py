"""Starting jax.distributed: which settings start it, and the errors for half-given settings.

Only the decisions are tested here (no runtime is started in the test process); the real
multi-process start-up is in test_multi_process.py.
"""

from __future__ import annotations

import pytest

from rlbolt.distributed import runtime

ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS")


@pytest.fixture
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_one_process_by_default_and_when_off(clean_env):
    assert runtime.initialize() is False
    clean_env.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    assert runtime.initialize("off") is False
    assert not runtime.is_initialized()


def test_a_count_of_one_is_one_process(clean_env):
    assert runtime.initialize(coordinator_address="127.0.0.1:1", num_processes=1, process_id=0) is False


@pytest.mark.parametrize("given, missing", [
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "['num_processes', 'process_id']"),
    ({"JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "1"}, "['coordinator_address']"),
])
def test_half_given_settings_name_what_is_missing(clean_env, given, missing):
    for k, v in given.items():
        clean_env.setenv(k, v)
    with pytest.raises(ValueError, match=missing.replace("[", r"\[").replace("]", r"\]")):
        runtime.initialize()


def test_bad_values_are_refused(clean_env):
    with pytest.raises(ValueError, match="distributed.mode='sometimes'"):
        runtime.initialize("sometimes")
    clean_env.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match=r"\$JAX_NUM_PROCESSES='two' must be an integer"):
        runtime.initialize()
