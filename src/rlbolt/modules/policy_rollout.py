"""PolicyRollout: how `LMPolicyModule` samples, over one engine handle.

`sample` turns prompt rows into completions through the rollout engine (only the `RolloutEngine`
protocol: `rlbolt.rollout.engines`), or, with an environment (`rollout.env` / `env=`), into
multi-turn episodes (`rlbolt.agents.run_episodes`) whose every turn goes through the same engine.
`generate` is one engine call (validation's greedy and pass@k samples too); it returns a
`Generation` (the engine's output and, when asked, its recorded MoE routing). The object gets what
it needs when the module's `setup` builds it: the config, the tokenizer and prompt encoder, the
`PolicyModel` (the rollout's view of the weights), how to prepare the trainable parameters for the
engine, the engine choice and the environment factory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from flax import nnx

from rlbolt.agents.failures import EnvErrorMonitor, EnvFailureError
from rlbolt.agents.rollout import run_episodes
from rlbolt.batch import Batch, row_fields
from rlbolt.config import ConfigError, RunConfig
from rlbolt.config.references import import_reference
from rlbolt.data.tokenizers import Tokenizer
from rlbolt.distributed.sharding import ShardingPlan
from rlbolt.modules.moe_routing import routing_columns
from rlbolt.modules.policy_model import PolicyModel
from rlbolt.modules.prompts import PromptEncoder, rows_of
from rlbolt.rollout.engine import RolloutEngine, RolloutOutput
from rlbolt.rollout.engines import BUILT_IN, EngineHandle, EngineSpec, build_engine

_log = logging.getLogger("rlbolt.agents")

class Generation(NamedTuple):
    """One engine call's result.

    Attributes:
      output: the engine's RolloutOutput.
      routing: (prompt, completion) experts the native engine recorded (`rollout.record_routing`),
        or None when not asked for.
    """

    output: RolloutOutput
    routing: tuple[np.ndarray, np.ndarray] | None = None


class PolicyRollout:
    """Prompts -> completions or episodes through one engine handle (see the module docstring).

    Args:
      config: the run's RunConfig (its rollout, data and model sections).
      tokenizer: the policy's tokenizer.
      encoder: the prompt encoder (rows -> token ids).
      policy: the PolicyModel (the model the engine is built from and its rollout parameters).
      prepare: trainable params -> the language model's parameters joined with the frozen base.
      engine: `rollout.engine`'s value or `engine=`: a name, a factory or a RolloutEngine.
      rollout_sharding: the rollout role's ShardingPlan (None: one device).
      completion_width: C of the completion columns (`LMPolicyModule.completion_width`).
      env_factory: the environment factory when samples are episodes, else None.
      log: records a scalar metric (`RLModule.log`).
    """

    def __init__(self, config: RunConfig, tokenizer: Tokenizer, encoder: PromptEncoder, policy: PolicyModel, *,
                 prepare: Callable[[Any], Any], engine: Any, rollout_sharding: ShardingPlan | None,
                 completion_width: int, env_factory: Callable | None, log: Callable[[str, float], None]):
        self.config, self.cfg = config, config.rollout
        self.tokenizer, self.encoder, self.policy = tokenizer, encoder, policy
        self.prepare = prepare
        self.engine_choice = engine
        self.rollout_sharding = rollout_sharding
        self.completion_width = completion_width
        self.env_factory = env_factory
        # every error logged, a broken environment stops the run (rollout.env_max_failed_batches)
        self.env_errors = EnvErrorMonitor(self.cfg.env_max_failed_batches) if env_factory is not None else None
        self.log = log
        self.handle: EngineHandle | None = None  # built on first use (`engine()`)
        self.lock = threading.Lock()  # validation (main thread) and rollout (producer) share the engine

    def sample(self, params: Any, batch: Batch) -> dict[str, np.ndarray]:
        """The columns of a rollout micro batch: prompt/completion ids and masks ([N, P], [N, C]),
        `sampler_logps` [N, C] and `completion_text` (object [N]); episodes add theirs
        (`sequence_mask`, `env_reward`, ...), a recorded routing its two columns."""
        rows = rows_of(batch, [k for k in row_fields(batch) if k != "prompt_index"])
        version = int(np.asarray(batch["policy_version"])[0])
        if self.env_factory is not None:
            return self.episodes(params, rows, batch["sample_keys"], version, self.cfg.temperature)
        ids = self.encoder.encode_rows(rows)
        record = self.cfg.record_routing
        out, recorded = self.generate(params, ids, batch["sample_keys"], self.cfg.temperature, version=version,
                                      with_routing=record)
        prompt_ids, prompt_mask = self.encoder.pad_left(ids)
        routing = {}
        if record:  # the experts of every token, as columns (modules/moe_routing.py)
            routing = routing_columns(*recorded, prompt_ids.shape[1], self.policy.model.config.num_experts)
        return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=out.completion_ids,
                    completion_mask=out.completion_mask, sampler_logps=out.logps,
                    completion_text=self.decode(out.completion_ids, out.completion_mask), **routing)

    def episodes(self, params: Any, rows: list[dict], keys: Any, version: int | None, temperature: float,
                 log: bool = True) -> dict[str, np.ndarray]:
        """One multi-turn episode per row (`rlbolt.agents.run_episodes`, each turn one engine call):
        the columns of the episode batch, the `agents/*` metrics logged (`log`: training batches,
        where a broken environment stops the run; validation only logs its errors)."""
        r = self.cfg
        prepared = self.policy.rollout_params(self.prepare(params))  # once: every turn samples with these weights
        rollout = self

        class Engine:  # what the episodes sample through: these weights, one engine call at a time
            def generate(self, prompt_ids, rng_keys, **opts):
                return rollout.generate(params, prompt_ids, rng_keys, opts.pop("temperature", temperature),
                                        version=version, rollout_params=prepared, **opts).output

            def open_session(self, prompt_ids, *, max_total_tokens, **opts):  # None: turns go through generate
                with rollout.lock:
                    handle = rollout.engine()
                    return handle.open_session(prepared, handle.version if version is None else version, prompt_ids,
                                               max_total_tokens=max_total_tokens,
                                               keep=rollout.policy.keeps_rollout_arrays,
                                               **{"temperature": temperature, **opts})

        try:
            episodes = run_episodes(Engine(), self._environments(rows), np.asarray(keys, np.uint32),
                                    tokenizer=self.tokenizer, prompt_ids=self._episode_prompts(rows),
                                    max_turns=r.max_turns, max_total_tokens=self.completion_width,
                                    max_turn_tokens=r.max_new_tokens, temperature=temperature,
                                    step_timeout_s=r.env_step_timeout_s,
                                    template_kwargs=self.config.data.chat_template_kwargs)
        except EnvFailureError as error:  # one line on the terminal; its traceback in train.log
            _log.error("the environment failed: %s", error, exc_info=error, extra={"console": False})
            raise EnvFailureError(f"rollout.env: {error}; fix the environment (RLBOLT_DEBUG=1 shows the "
                                  "traceback)") from error
        if log:
            self.env_errors.record(episodes.num_episodes, episodes.errors)
            for name, value in episodes.metrics().items():
                self.log(name, value)
        else:
            self.env_errors.log(episodes.errors)
        return episodes.columns(self.tokenizer.pad_id, self.encoder.width)

    def _episode_prompts(self, rows: list[dict]) -> list[list[int]] | None:
        """The rows' encoded prompts, for environments whose `reset()` leaves the prompt to the row;
        None when the rows have no `data.prompt_field` (their environments open the conversation)."""
        return self.encoder.encode_rows(rows) if all(self.config.data.prompt_field in r for r in rows) else None

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

    def engine(self) -> EngineHandle:
        """The rollout engine (built on first use from `rollout.engine` or `engine=`), behind an
        EngineHandle: only the RolloutEngine protocol is used."""
        if self.handle is None:
            choice, r, lora = self.engine_choice, self.cfg, self.policy.lora
            model = self.policy.rollout_model(self.rollout_sharding)
            if isinstance(choice, RolloutEngine):
                engine = choice
            else:
                if isinstance(choice, str) and choice not in BUILT_IN:
                    choice = import_reference(choice, "rollout.engine")
                if choice == "vllm" and lora is not None and not lora.merge_for_rollout:
                    raise ConfigError("rollout.engine=vllm takes plain weights: set model.lora.rollout=merged (the "
                                      "adapters are merged into the base before each push)")
                spec = EngineSpec(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_k=r.top_k,
                                  top_p=r.top_p, stop_token_ids=(self.tokenizer.eos_id,) if r.stop_at_eos else (),
                                  pad_id=self.tokenizer.pad_id, prompt_width=self.encoder.width + (
                                      self.completion_width if self.env_factory is not None else 0),
                                  model_path=self.config.model.path, param_dtype=self.config.model.param_dtype,
                                  sharding=self.rollout_sharding, share_prompts=self.config.model.share_prompt,
                                  record_routing=r.record_routing)
                engine = build_engine(choice, model, spec)
            # Merged kernels are a transient copy: the native sampler lets go of them after each call by
            # taking the model's own arrays back (free to hold). Another engine keeps its copy until the next push.
            transient = not self.policy.keeps_rollout_arrays and self.engine_choice == "native"
            self.handle = EngineHandle(engine, release=nnx.state(model) if transient else None)
        return self.handle

    def generate(self, params: Any, ids: list[list[int]], keys: Any, temperature: float, *, version: int | None = None,
                 rollout_params: Any = None, with_routing: bool = False, **opts: Any) -> Generation:
        """One engine call with `params` (or their `rollout_params`, already prepared: an episode's
        turns reuse them, so LoRA weights are merged and pushed once per rollout, not per turn).
        `with_routing` (rollout.record_routing): the native engine's `last_routing` comes back too."""
        with self.lock:
            handle = self.engine()
            version = handle.version if version is None else version  # validation: the latest weights' stamp
            lm_params = self.policy.rollout_params(self.prepare(params)) if rollout_params is None else rollout_params
            out = handle.generate(lm_params, version, ids, np.asarray(keys, np.uint32), temperature=temperature,
                                  keep=self.policy.keeps_rollout_arrays, **opts)
            # Read under the lock: a validation call would overwrite the engine's last routing.
            return Generation(out, handle.engine.last_routing if with_routing else None)

    def decode(self, completion_ids: np.ndarray, completion_mask: np.ndarray) -> np.ndarray:
        """The completions' text (object [N]), each from its real ids."""
        texts = np.empty(len(completion_ids), dtype=object)
        for i, (ids, mask) in enumerate(zip(completion_ids, completion_mask)):
            texts[i] = self.tokenizer.decode([int(t) for t in ids[mask]])
        return texts


