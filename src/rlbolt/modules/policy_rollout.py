"""PolicyRollout: how `LMPolicyModule` samples (a mixin, as `PolicySetup` is for its set-up).

`on_rollout` turns prompt rows into completions through the module's rollout engine (only the
`RolloutEngine` protocol: `rlbolt.rollout.engines`), or, with an environment (`rollout.env` /
`env=`), into multi-turn episodes (`rlbolt.agents.run_episodes`) whose every turn goes through
the same engine. It relies on what `LMPolicyModule` and `PolicySetup` set: `config`,
`rollout_cfg`, `tokenizer`, `encoder`, `model`, `lora`, `context`, `env_factory` and the engine slots.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flax import nnx

from rlbolt.agents.failures import EnvFailureError
from rlbolt.agents.rollout import run_episodes
from rlbolt.batch import Batch, row_fields  # noqa: F401 - row_fields: policy.py imports it from here
from rlbolt.config import ConfigError
from rlbolt.config.references import import_reference
from rlbolt.modules.moe_routing import routing_columns
from rlbolt.modules.prompts import rows_of
from rlbolt.rollout.engine import RolloutEngine
from rlbolt.rollout.engines import BUILT_IN, EngineHandle, EngineSpec, build_engine

_log = logging.getLogger("rlbolt.agents")

class PolicyRollout:
    """The rollout hooks of `LMPolicyModule` (a mixin; see the module docstring)."""

    # -- rollout ----------------------------------------------------------------------------------
    def on_rollout(self, params: Any, batch: Batch) -> Batch:
        """Tokenises the prompt rows, samples one completion per sample with its `sample_keys`,
        and adds prompt/completion ids and masks ([N, P], [N, C]), `sampler_logps` [N, C] and
        `completion_text` (object [N])."""
        rows = rows_of(batch, [k for k in row_fields(batch) if k != "prompt_index"])
        version = int(np.asarray(batch["policy_version"])[0])
        if self.env_factory is not None:
            return batch.with_columns(self._episodes(params, rows, self._episode_prompts(rows), batch["sample_keys"],
                                                     version, self.rollout_cfg.temperature))
        ids = self.encoder.encode_rows(rows)
        record = self.rollout_cfg.record_routing
        out = self._generate(params, ids, batch["sample_keys"], self.rollout_cfg.temperature, version=version,
                             with_routing=record)
        prompt_ids, prompt_mask = self.encoder.pad_left(ids)
        routing = {}
        if record:  # the experts of every token, as columns (modules/moe_routing.py)
            out, recorded = out
            routing = routing_columns(*recorded, prompt_ids.shape[1], self.model.config.num_experts)
        return batch.with_columns(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            completion_ids=out.completion_ids, completion_mask=out.completion_mask,
            sampler_logps=out.logps, completion_text=self._decode(out.completion_ids, out.completion_mask), **routing)

    @property
    def completion_width(self) -> int:
        """C of the completion columns: `rollout.max_new_tokens`, or with episodes the ids after the
        prompt of a whole episode (`rollout.max_total_tokens`, default max_turns * max_new_tokens)."""
        r = self.rollout_cfg
        if self._env_choice is None:
            return r.max_new_tokens
        return r.max_total_tokens or r.max_turns * r.max_new_tokens

    def _episode_prompts(self, rows: list[dict]) -> list[list[int]] | None:
        """The rows' encoded prompts, for environments whose `reset()` leaves the prompt to the row;
        None when the rows have no `data.prompt_field` (their environments open the conversation)."""
        return self.encoder.encode_rows(rows) if all(self.config.data.prompt_field in r for r in rows) else None

    def _episodes(self, params: Any, rows: list[dict], ids: list[list[int]] | None, keys: Any, version: int | None,
                  temperature: float, log: bool = True) -> dict[str, np.ndarray]:
        """One multi-turn episode per row (`rlbolt.agents.run_episodes`, each turn one engine call):
        the columns of the episode batch, the `agents/*` metrics logged."""
        r = self.rollout_cfg
        prepared = self._rollout_params(params)  # once: every turn samples with the same weights

        module = self

        class Engine:  # what the episodes sample through: these weights, one engine call at a time
            def generate(self, prompt_ids, rng_keys, **opts):
                return module._generate(params, prompt_ids, rng_keys, opts.pop("temperature", temperature),
                                        version=version, rollout_params=prepared, **opts)

            def open_session(self, prompt_ids, *, max_total_tokens, **opts):  # None: turns go through generate
                with module._engine_lock:
                    handle = module.rollout_engine()
                    return handle.open_session(prepared, handle.version if version is None else version, prompt_ids,
                                               max_total_tokens=max_total_tokens,
                                               keep=module.lora is None or not module.lora.merge_for_rollout,
                                               **{"temperature": temperature, **opts})

        try:
            episodes = run_episodes(Engine(), self._environments(rows), np.asarray(keys, np.uint32),
                                    tokenizer=self.tokenizer, prompt_ids=ids, max_turns=r.max_turns,
                                    max_total_tokens=self.completion_width, max_turn_tokens=r.max_new_tokens,
                                    temperature=temperature, step_timeout_s=r.env_step_timeout_s,
                                    template_kwargs=self.config.data.chat_template_kwargs)
        except EnvFailureError as error:  # one line on the terminal; its traceback in train.log
            _log.error("the environment failed: %s", error, exc_info=error, extra={"console": False})
            raise EnvFailureError(f"rollout.env: {error}; fix the environment (RLBOLT_DEBUG=1 shows the "
                                  "traceback)") from error
        if log:  # training batches: a broken environment stops the run (validation only logs)
            self.env_errors.record(episodes.num_episodes, episodes.errors)
            for name, value in episodes.metrics().items():
                self.log(name, value)
        else:
            self.env_errors.log(episodes.errors)
        return episodes.columns(self.tokenizer.pad_id, self.encoder.width)

    def _environments(self, rows: list[dict]) -> list:
        """One environment per row from the factory; a factory that raises stops the run (`EnvFailureError`)."""
        envs = []
        for i, row in enumerate(rows):
            try:
                envs.append(self.env_factory(row))
            except Exception as error:  # noqa: BLE001 - user code: a set-up bug, named in one line
                raise EnvFailureError(f"the environment factory raised {type(error).__name__}: {error} "
                                      f"for row {i} of the batch (fields {sorted(row)})") from error
        return envs

    def rollout_engine(self) -> EngineHandle:
        """The module's rollout engine (built on first use from `rollout.engine` or `engine=`),
        behind an EngineHandle: only the RolloutEngine protocol is used."""
        if self._engine is None:
            choice, r = self._engine_choice, self.rollout_cfg
            model = self._rollout_model()
            if isinstance(choice, RolloutEngine):
                engine = choice
            else:
                if isinstance(choice, str) and choice not in BUILT_IN:
                    choice = import_reference(choice, "rollout.engine")
                if choice == "vllm" and self.lora is not None and not self.lora.merge_for_rollout:
                    raise ConfigError("rollout.engine=vllm takes plain weights: set model.lora.rollout=merged (the "
                                      "adapters are merged into the base before each push)")
                spec = EngineSpec(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                                  top_p=r.top_p, stop_token_ids=(self.tokenizer.eos_id,) if r.stop_at_eos else (),
                                  pad_id=self.tokenizer.pad_id, prompt_width=self.encoder.width + (
                                      self.completion_width if self.env_factory is not None else 0),
                                  model_path=self.config.model.path, param_dtype=self.config.model.param_dtype,
                                  sharding=self.context.sharding_for("rollout"),
                                  share_prompts=self.config.model.share_prompt,
                                  record_routing=self.rollout_cfg.record_routing)
                engine = build_engine(choice, model, spec)
            # Merged kernels are a transient copy: the native sampler lets go of them after each call by
            # taking the model's own arrays back (free to hold). Another engine keeps its copy until the next push.
            transient = self.lora is not None and self.lora.merge_for_rollout and self._engine_choice == "native"
            release = nnx.state(model) if transient else None
            self._engine = EngineHandle(engine, release=release)
        return self._engine

    def _rollout_params(self, params: Any) -> Any:
        """What the engine samples with: the policy's part of `params` joined with the frozen base
        (LoRA: merged into it, or adapters in the graph)."""
        lm_params = self.policy_params(self.full_params(params))
        return self.lora.rollout_params(lm_params) if self.lora is not None else lm_params

    def _generate(self, params: Any, ids: list[list[int]], keys: Any, temperature: float, *, version: int | None = None,
                  rollout_params: Any = None, with_routing: bool = False, **opts: Any):
        """One engine call with `params` (or their `rollout_params`, already prepared: an episode's
        turns reuse them, so LoRA weights are merged and pushed once per rollout, not per turn).
        `with_routing` (rollout.record_routing): returns (output, the native engine's `last_routing`)."""
        with self._engine_lock:
            handle = self.rollout_engine()
            version = handle.version if version is None else version  # validation: the latest weights' stamp
            lm_params = self._rollout_params(params) if rollout_params is None else rollout_params
            out = handle.generate(lm_params, version, ids, np.asarray(keys, np.uint32), temperature=temperature,
                                  keep=self.lora is None or not self.lora.merge_for_rollout, **opts)
            # Read under the lock: a validation call would overwrite the engine's last routing.
            return (out, handle.engine.last_routing) if with_routing else out

    def _rollout_model(self) -> Any:
        """The model the sampler runs: on its own devices (placement), a view of it whose
        activation constraints name the rollout mesh (the arrays are shared, not copied)."""
        model = self.model if self.lora is None else self.lora.rollout_model()
        rollout = self.context.sharding_for("rollout")
        if rollout is None or rollout is self.sharding:
            return model
        return rollout.shard_activations(nnx.merge(*nnx.split(model)))

    def _decode(self, completion_ids: np.ndarray, completion_mask: np.ndarray) -> np.ndarray:
        texts = np.empty(len(completion_ids), dtype=object)
        for i, (ids, mask) in enumerate(zip(completion_ids, completion_mask)):
            texts[i] = self.tokenizer.decode([int(t) for t in ids[mask]])
        return texts



