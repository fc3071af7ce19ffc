"""HFExport: write the current policy as a Hugging Face model folder every n steps and/or at the end.

Layout under `directory`:

    step_<n>/    periodic exports (every_n_steps)
    final/       the params fit ended with (at_end)

Each folder holds config.json + model.safetensors (+ the tokenizer files when the module's
tokenizer came from a folder), written by `rlbolt.models.hf_io.save_hf`: built under a temporary
name and renamed into place, so a crash never leaves a half-written folder, and
`transformers.AutoModelForCausalLM.from_pretrained(folder)` loads it.

The module declares its language model in its card (`RLModule.card()`): `card.hf_model(params)`
builds the exported Decoder from the trainable pytree (the policy's part of it; a LoRA run's
adapters merged into its base), and `card.tokenizer_folder` names the tokenizer files to copy.
A module whose card is None is refused when the fit starts (it has no model to export).
Only process 0 writes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from flax import nnx

from rlbolt.callback import Callback, Periodic
from rlbolt.run_info import RunInfo
from rlbolt.state import StepInfo, TrainState

log = logging.getLogger(__name__)


class HFExport(Callback):
    """Exports the policy params as a Hugging Face folder.

    Args:
      directory: where the exports go (`step_<n>/`, `final/`).
      every_n_steps: export when `steps completed % every_n_steps == 0` (None: only at the end).
      at_end: export the final params to `final/` when fit ends.
      tokenizer_folder: copy the tokenizer files from here; None uses the module card's
        `tokenizer_folder` (the config's `model.tokenizer` or `model.path`) when there is one.
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

    def on_fit_start(self, run: RunInfo, state: TrainState) -> None:
        if run.card is None:
            raise ValueError(f"HFExport needs the module's language model, but {type(run.module).__name__}.card() "
                             "returned None; return a rlbolt.module.ModuleCard from card() or drop HFExport")

    def on_step_end(self, run: RunInfo, info: StepInfo) -> None:
        if self.periodic.should_fire(info.step):
            self.export(run, info.state.params, self.directory / f"step_{info.step}", info.step)

    def on_fit_end(self, run: RunInfo, state: TrainState) -> None:
        if run.control.interrupted:
            log.info("HFExport: fit was interrupted at step %d; no final export (the checkpoint holds the step)", state.step)
        elif self.at_end:
            self.export(run, state.params, self.directory / "final", state.step)

    def export(self, run: RunInfo, params: Any, folder: Path, step: int) -> Path | None:
        """Writes `params` (the trainable pytree) as a HF folder at `folder` (process 0 only; every
        process calls it, since params sharded over several processes are gathered first)."""
        from rlbolt.data.gguf_tokenizer import hf_tokenizer_folder
        from rlbolt.distributed import gather_to_host
        from rlbolt.models.hf_io import save_hf

        model = run.card.hf_model(params)  # a LoRA run's adapters come merged into the base
        model = with_params(model, gather_to_host(nnx.state(model, nnx.Param)))  # whole, on every process
        if not run.is_main_process:
            return None
        with hf_tokenizer_folder(self._tokenizer_folder(run.card)) as tokenizer_folder:
            save_hf(model, model.config, folder, max_shard_bytes=self.max_shard_bytes, tokenizer_folder=tokenizer_folder)
        self.exported.append((step, folder))
        log.info("HFExport: step %d written to %s", step, folder)
        return folder

    def _tokenizer_folder(self, card) -> Path | None:
        if self.tokenizer_folder is not None:
            return Path(self.tokenizer_folder)
        return None if card.tokenizer_folder is None else Path(card.tokenizer_folder)


def with_params(model: nnx.Module, params: Any) -> nnx.Module:
    """A new module object with `model`'s structure and non-Param state and the given Params.

    Args:
      model: the template module (not modified).
      params: an `nnx.State` of its `nnx.Param`s (e.g. `TrainState.params`).
    """
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, params, rest)
