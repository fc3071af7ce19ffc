"""rlbolt.utils.xla_flags: the CPU flag is added once and only for the jaxlib it was checked on;
the decode executables take YNNPACK's single dots back (checked in the compiled HLO of a fresh
process, since XLA reads XLA_FLAGS once)."""

import json
import os
import subprocess
import sys

import pytest

from rlbolt.utils import xla_flags

FLAG = xla_flags._CPU_FLAGS["0.10."]


@pytest.fixture
def jaxlib_010(monkeypatch):
    monkeypatch.setattr(xla_flags, "_jaxlib_version", lambda: "0.10.2")
    monkeypatch.setattr(xla_flags, "_has_module", lambda name: False)
    monkeypatch.delenv("RLBOLT_NO_XLA_FLAGS", raising=False)


def test_configure_adds_the_flag_once_and_keeps_the_users(monkeypatch, jaxlib_010):
    monkeypatch.setenv("XLA_FLAGS", "--xla_user_flag=1")
    assert xla_flags.configure_xla_flags() == [FLAG]
    assert xla_flags.configure_xla_flags() == []
    assert os.environ["XLA_FLAGS"] == f"--xla_user_flag=1 {FLAG}"


@pytest.mark.parametrize("case", ["other jaxlib", "gpu plugin", "disabled", "no metadata"])
def test_configure_adds_nothing_where_unchecked(monkeypatch, jaxlib_010, case):
    monkeypatch.setenv("XLA_FLAGS", "")
    if case == "other jaxlib":
        monkeypatch.setattr(xla_flags, "_jaxlib_version", lambda: "0.11.0")
    elif case == "gpu plugin":
        monkeypatch.setattr(xla_flags, "_has_module", lambda name: name == "jax_cuda12_plugin")
    elif case == "disabled":
        monkeypatch.setenv("RLBOLT_NO_XLA_FLAGS", "1")
    else:
        monkeypatch.setattr(xla_flags, "_jaxlib_version", lambda: "")
    assert xla_flags.configure_xla_flags() == []


def test_decode_options_only_with_the_cpu_flag_on_the_checked_jaxlib(monkeypatch, jaxlib_010):
    monkeypatch.setenv("XLA_FLAGS", f"--xla_user_flag=1 {FLAG}")
    options = xla_flags.decode_compiler_options()
    assert options == {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE,"
                       "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"}
    monkeypatch.setattr(xla_flags, "_jaxlib_version", lambda: "0.11.0")
    assert xla_flags.decode_compiler_options() == {}
    monkeypatch.setattr(xla_flags, "_jaxlib_version", lambda: "0.10.2")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=-individual_dot,-reduce")
    assert xla_flags.decode_compiler_options() == {}  # another setting of the user's: left alone


_PROBE = """
import json
from rlbolt.utils.xla_flags import configure_xla_flags, DecodeJit
added = configure_xla_flags()
import jax, jax.numpy as jnp
x, w = jnp.ones((32, 576)), jnp.ones((576, 960))
dot = lambda x, w: x @ w
decode = DecodeJit(dot)
before = decode._cache_size()
plain_hlo, decode_hlo = (f.lower(x, w).compile().as_text() for f in (jax.jit(dot), decode))
decode(x, w)
print(json.dumps({"added": added, "plain": "ynn_fusion" in plain_hlo, "decode": "ynn_fusion" in decode_hlo,
                  "cache": [before, decode._cache_size()]}))
"""


def test_decode_jit_compiles_its_dots_in_ynnpack_where_the_flag_took_them_out():
    import importlib.metadata

    if not importlib.metadata.version("jaxlib").startswith("0.10."):
        pytest.skip("the flag is only added on jaxlib 0.10.x")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RLBOLT_NO_XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"added": [FLAG], "plain": False, "decode": True, "cache": [0, 1]}
