"""A user's algorithm, a GRPO subclass with its own name and defaults, trains through `rlbolt fit`
without any edit to rlbolt: `objects.module` names it, importing it registers its name, and its
declared defaults resolve the fields the config left None."""

from __future__ import annotations

import sys
import textwrap

import pytest
import yaml

from rlbolt.app.cli import main
from rlbolt.config import ConfigError, algorithms, algorithm_class, algorithm_names, load_config
from rlbolt.loggers import read_jsonl
from rlbolt.modules import GRPO

RECIPE = "recipes/configs/grpo_gsm8k.yaml"
USER_MODULE = textwrap.dedent('''
    import numpy as np
    from rlbolt.modules import GRPO

    class WideClipGRPO(GRPO):
        """GRPO with a wider upper clip, and a sign that its own hook ran."""

        algorithm_name = "wide-clip-grpo"
        algorithm_defaults = {"clip_high": 0.5, "loss_aggregation": "token-mean"}

        def compute_advantages(self, batch):
            self.log("wide_clip/advantage_calls", 1.0)
            return super().compute_advantages(batch)
''')


@pytest.fixture()
def user_package(tmp_path, monkeypatch):
    (tmp_path / "user_algos.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_algos:WideClipGRPO"
    sys.modules.pop("user_algos", None)
    algorithms._REGISTRY.pop("wide-clip-grpo", None)  # each test starts from the ready algorithms


def test_a_user_subclass_trains_through_rlbolt_fit(user_package, tmp_path):
    run_dir = tmp_path / "run"
    # 8 new tokens, not the recipe's 32: the run shows the name, defaults and hook, not the sampler (-12 s)
    assert main(["fit", RECIPE, f"--objects.module={user_package}", "--trainer.max_steps=2",
                 "--rollout.max_new_tokens=8", f"--trainer.run_dir={run_dir}", "--trainer.val_every_n_steps=null",
                 "--data.builtin_val_rows=0", "--callbacks.progress=false", "--callbacks.metrics=[jsonl]"]) == 0
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["algorithm"]["name"] == "wide-clip-grpo"
    assert config["objects"]["module"] == user_package  # so `rlbolt resume` imports it again
    assert config["algorithm"]["clip_high"] == 0.5 and config["algorithm"]["clip_low"] == 0.2  # declared, generic
    assert config["algorithm"]["loss_aggregation"] == "token-mean"  # the subclass's, not GRPO's
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["wide_clip/advantage_calls"] == 1.0 for r in records)  # the user's hook trained the run


def test_the_registered_name_is_accepted_once_imported(user_package):
    with pytest.raises(ConfigError, match="not a registered algorithm.*objects.module"):
        load_config({"algorithm": {"name": "wide-clip-grpo"}})
    cfg = load_config({"objects": {"module": user_package}})
    cls = algorithm_class("wide-clip-grpo")
    assert cls.__name__ == "WideClipGRPO" and issubclass(cls, GRPO) and "wide-clip-grpo" in algorithm_names()
    assert load_config({"algorithm": {"name": "wide-clip-grpo"}}).algorithm == cfg.algorithm
    # the subclass inherits nothing it did not declare: GRPO's own defaults are untouched
    assert load_config().algorithm.loss_aggregation == "seq-mean-token-mean"


def test_conflicting_names_are_refused(user_package):
    with pytest.raises(ConfigError, match="objects.module.*wide-clip-grpo"):
        load_config({"algorithm": {"name": "dapo"}, "objects": {"module": user_package}})
    with pytest.raises(ValueError, match="'grpo' is already rlbolt.modules.grpo.GRPO"):
        type("Impostor", (GRPO,), {"algorithm_name": "grpo", "__module__": "somewhere"})
    with pytest.raises(ConfigError, match="must name an RLModule class that sets its own algorithm_name"):
        load_config({"objects": {"module": "rlbolt.modules:LMPolicyModule"}})
