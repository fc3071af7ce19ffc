"""HFExport: write the current policy as a Hugging Face model folder every n steps and/or at the end.

Layout under `directory`:

    step_<n>/    periodic exports (every_n_steps)
    final/       the params fit ended with (at_end)

Each folder holds config.json + model.safetensors (+ the tokenizer files when the module's
tokenizer came from a folder), written by `rlbolt.models.hf_io.save_hf`: built under a temporary
name and renamed into place, so a crash never leaves a half-written folder, and
`transformers.AutoModelForCausalLM.from_pretrained(folder)` loads it.

The module must hold its network as `module.model` (an `rlbolt.models.Decoder`); the trained
params are put into a view of that model (no copy of the module's own model is changed). A module
whose trainable pytree nests the policy (PPO's value head) exposes `policy_params(params)`; one
with `hf_model(params)` (the LM modules) builds the exported Decoder itself (a LoRA run's
adapters merged into its base).
Only process 0 writes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flax import nnx

from rlbolt.callback import Callback, Periodic
from rlbolt.state import StepInfo, TrainState

log = logging.getLogger(__name__)


class HFExport(Callback):
    """Exports the policy params as a Hugging Face folder.

    Args:
      directory: where the exports go (`step_<n>/`, `final/`).
      every_n_steps: export when `steps completed % every_n_steps == 0` (None: only at the end).
      at_end: export the final params to `final/` when fit ends.
      tokenizer_folder: copy the tokenizer files from here; None uses the module's config
        (`model.tokenizer` or `model.path`) when it names a folder with a tokenizer.json.
      max_shard_bytes: split the weights into shards of at most this many bytes (None: one file).

    Attributes:
      exported: `[(step, folder)]` of every export this fit wrote, in order.
    """

    def __init__(self, directory: str | Path, every_n_steps: int | None = None, at_end: bool = True,
                 tokenizer_folder: str | Path | None = None, max_shard_bytes: int | None = None):
        self.periodic = Periodic(every_n_steps=every_n_steps)  # validates every_n_steps
        self.directory, self.at_end = Path(directory), at_end
        self.tokenizer_folder, self.max_shard_bytes = tokenizer_folder, max_shard_bytes
        self.exported: list[tuple[int, Path]] = []

    def on_fit_start(self, trainer, state: TrainState) -> None:
        model = getattr(trainer.module, "model", None)
        if not isinstance(model, nnx.Module) or not hasattr(model, "config"):
            raise ValueError(f"HFExport needs the module's network as `module.model` (an rlbolt.models.Decoder) after "
                             f"setup; {type(trainer.module).__name__}.model is {type(model).__name__}. Set self.model in "
                             "setup() or drop HFExport")

    def on_step_end(self, trainer, info: StepInfo) -> None:
        if self.periodic.should_fire(info.step):
            self.export(trainer, info.state.params, self.directory / f"step_{info.step}", info.step)

    def on_fit_end(self, trainer, state: TrainState) -> None:
        if getattr(trainer, "interrupted", False):
            log.info("HFExport: fit was interrupted at step %d; no final export (the checkpoint holds the step)", state.step)
        elif self.at_end:
            self.export(trainer, state.params, self.directory / "final", state.step)

    def export(self, trainer, params: Any, folder: Path, step: int) -> Path | None:
        """Writes `params` (the trainable pytree) as a HF folder at `folder` (process 0 only; every
        process calls it, since params sharded over several processes are gathered first)."""
        from rlbolt.data.gguf_tokenizer import hf_tokenizer_folder
        from rlbolt.distributed import gather_to_host
        from rlbolt.models.hf_io import save_hf

        module = trainer.module
        if hasattr(module, "hf_model"):  # LMPolicyModule: LoRA adapters come merged into the base
            model = module.hf_model(params)
        else:
            model = with_params(module.model, module.policy_params(params) if hasattr(module, "policy_params") else params)
        model = with_params(model, gather_to_host(nnx.state(model, nnx.Param)))  # whole, on every process
        if not trainer.is_main_process:
            return None
        with hf_tokenizer_folder(self._tokenizer_folder(module)) as tokenizer_folder:
            save_hf(model, model.config, folder, max_shard_bytes=self.max_shard_bytes, tokenizer_folder=tokenizer_folder)
        self.exported.append((step, folder))
        log.info("HFExport: step %d written to %s", step, folder)
        return folder

    def _tokenizer_folder(self, module) -> Path | None:
        if self.tokenizer_folder is not None:
            return Path(self.tokenizer_folder)
        from rlbolt.models.hf_io import tokenizer_source

        model_cfg = getattr(getattr(module, "config", None), "model", None)
        source = tokenizer_source(getattr(model_cfg, "tokenizer", None), getattr(model_cfg, "path", None))
        return None if source is None else Path(source)


def with_params(model: nnx.Module, params: Any) -> nnx.Module:
    """A new module object with `model`'s structure and non-Param state and the given Params.

    Args:
      model: the template module (not modified).
      params: an `nnx.State` of its `nnx.Param`s (e.g. `TrainState.params`).
    """
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)
