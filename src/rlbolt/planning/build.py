"""The abstract run: the module, its shardings, parameters and optimizer state built from the same
config as `rlbolt fit`, with ShapeDtypeStructs in place of arrays.

Nothing here reads a weight or places an array: the model comes from config.json alone
(`lm_ops.model_config_only` + `nnx.eval_shape`), the tokenizer is replaced by its vocabulary size,
the mesh is laid over the target devices (a described TPU slice or this host's), and the module's
own `setup` runs on that abstract model (placing abstract values gives abstract values with
shardings: `ShardingPlan.place`, `init_optimizer`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from rlbolt.config import RunConfig


@dataclasses.dataclass(frozen=True)
class VocabOnly:
    """The tokenizer as a plan sees it: a vocabulary size, eos and pad ids, no files, no template."""

    vocab_size: int
    eos_id: int = 0
    pad_id: int = 0
    chat_template: Any = None

    def encode(self, text: str) -> list[int]:  # pragma: no cover - a plan encodes no prompt
        raise NotImplementedError("rlbolt plan reads no tokenizer; prompts are data.max_prompt_tokens wide")


@dataclasses.dataclass
class AbstractRun:
    """Everything the planner compiles, built abstractly.

    Attributes:
      config: the resolved RunConfig.
      module: the RLModule, set up on the abstract model.
      plan: the BatchPlan.
      shardings: role -> ShardingPlan over the target devices.
      params: the trainable parameters (ShapeDtypeStructs with shardings).
      opt_state: the optimizer state (likewise).
      optimizer: the optax transformation.
      devices: the target devices.
    """

    config: RunConfig
    module: Any
    plan: Any
    shardings: dict[str, Any]
    params: Any
    opt_state: Any
    optimizer: Any
    devices: list[Any]

    @property
    def sharding(self) -> Any:
        """The train role's ShardingPlan."""
        return self.shardings["train"]


def build_abstract(cfg: RunConfig, devices: list[Any]) -> AbstractRun:
    """Builds `cfg`'s run for `devices` without weights or device arrays.

    Args:
      cfg: a resolved RunConfig (`load_config`).
      devices: the devices to plan for (`rlbolt.distributed.topology.target_devices`).

    Raises:
      ConfigError, PlanError, MeshError: what `rlbolt fit` would refuse for that device set.
    """
    from rlbolt.app.build import build_module, build_plan
    from rlbolt.distributed.layout import check_batch_plan
    from rlbolt.fit_setup import build_optimizer
    from rlbolt.distributed.placement import Placement
    from rlbolt.modules import lm_ops
    from rlbolt.modules.prompts import builtin_tokenizer
    from rlbolt.planning.schema import abstract_key
    from rlbolt.setup_context import SetupContext

    vocab = None if cfg.model.path else builtin_tokenizer().vocab_size
    model_config = lm_ops.model_config_only(cfg.model, vocab)
    tokenizer = VocabOnly(model_config.vocab_size)
    module = build_module(cfg, model=lm_ops.abstract_model(model_config, cfg.trainer.seed), tokenizer=tokenizer)
    plan = build_plan(cfg)
    module.check_plan(plan)
    placement = Placement.of(cfg.trainer.placement)
    shardings = placement.plans(dataclasses.asdict(cfg.mesh), devices=devices)
    # as `ProcessGroups.of` decides for the Trainer: a placement on a slice of several hosts runs across groups
    across = not placement.colocated and len({d.process_index for d in devices}) > 1
    check_batch_plan(plan, shardings["train"], cfg.trainer.mode, reference=shardings["reference"], across_groups=across)
    module.context = context = SetupContext(plan=plan, seed=cfg.trainer.seed, mode=cfg.trainer.mode,
                                            shardings=shardings)
    module.setup(context)
    sharding = shardings["train"]
    params = sharding.place(module.init_params(abstract_key()))
    # As the Trainer does: float32 master weights and moments behind bfloat16 params (model.master_weights).
    # The Trainer first passes the optimizer through the callbacks' wrap_optimizer: the callbacks a config builds
    # leave it unchanged (NaNGuard's default "stop"; tests/planning/test_plan_cpu.py), so the plan skips them.
    optimizer, opt_state = build_optimizer(module, params, sharding, cfg.model.master_weights)
    _check_abstract(params, opt_state)
    return AbstractRun(cfg, module, plan, dict(shardings), params, opt_state, optimizer, list(devices))


def _check_abstract(*trees: Any) -> None:
    concrete = [x for tree in trees for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if concrete:  # a code path that placed a real array: the plan would be a lie about memory
        raise AssertionError(f"the abstract build holds {len(concrete)} concrete array(s); a path assumed real devices")


__all__ = ["AbstractRun", "VocabOnly", "build_abstract"]
