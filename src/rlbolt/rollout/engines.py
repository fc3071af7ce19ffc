"""Choosing and driving a rollout engine: which engine a module samples with, and how a module
calls it through the `RolloutEngine` protocol only.

    spec = EngineSpec(max_new_tokens=32, temperature=1.0, stop_token_ids=(eos,), pad_id=0, prompt_width=128)
    engine = build_engine("native", model, spec)       # or "vllm", or a factory (model, spec) -> engine
    handle = EngineHandle(engine, release=nnx.state(model))
    out = handle.generate(params, version, prompt_ids, keys)   # weights pushed only when they change

An engine is anything with `generate(prompt_ids, rng_keys, **opts)` and
`update_weights(params, policy_version)` (`rlbolt.rollout.engine`). A factory named in a config
(`rollout.engine: 'package.module:make_engine'`) is called as `factory(model, spec)`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rlbolt.rollout.engine import RolloutEngine, RolloutOutput, SessionEngine, TurnSession

BUILT_IN = ("native", "vllm")


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """What a module asks of its engine: the sampling options and what the engine needs to know
    about the model and the run.

    Attributes:
      max_new_tokens: the completion budget (C of every RolloutOutput).
      temperature, top_k, top_p: sampling (temperature 0 = greedy; top_k 0 and top_p 1 = off).
      stop_token_ids: a completion ends at the first of these (kept, mask True).
      pad_id: the id after a stop token.
      prompt_width: the longest prompt in tokens (the native engine's largest prompt bucket).
      model_path: the Hugging Face folder the model was loaded from (None: built in memory).
      param_dtype: the parameters' dtype name ("float32", "bfloat16").
      sharding: the rollout role's ShardingPlan (None: one device).
      share_prompts: run each group's prompt once (the native engine).
      record_routing: mixture-of-experts models: the native engine keeps each call's experts per
        token in `last_routing` (router replay).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_width: int = 128
    model_path: str | None = None
    param_dtype: str = "float32"
    sharding: Any = None
    share_prompts: bool = True
    record_routing: bool = False


def prompt_buckets(prompt_width: int) -> tuple[int, ...]:
    """Padded prompt lengths: the powers of two below the longest prompt, and the longest itself."""
    return tuple(sorted({b for b in (32, 64, 128, 256, 512, 1024, 2048, 4096) if b < prompt_width} | {prompt_width}))


def native_engine(model: Any, spec: EngineSpec) -> RolloutEngine:
    """rlbolt's own jitted sampler (`NativeSampler`)."""
    from rlbolt.rollout.sampler import NativeSampler

    return NativeSampler(model, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_k=spec.top_k,
                         top_p=spec.top_p, stop_token_ids=spec.stop_token_ids, pad_id=spec.pad_id,
                         prompt_buckets=prompt_buckets(spec.prompt_width), sharding=spec.sharding,
                         share_prompts=spec.share_prompts, record_routing=spec.record_routing)


def vllm_engine(model: Any, spec: EngineSpec) -> RolloutEngine:
    """vLLM in process (the `rlbolt[vllm]` extra; `rlbolt.rollout.vllm_engine`), started on the
    model's Hugging Face folder, or on the model as `save_hf` writes it into a temporary folder
    when it has none (a tiny random model, a `.gguf` file); the trainer's weights are pushed
    before the first generate either way."""
    head_dim = model.config.head_dim
    if _on_cpu() and head_dim < 32:  # checked first: vLLM's own error comes from inside a kernel
        raise ValueError(f"rollout.engine=vllm: vLLM's CPU attention has no kernel for head_dim={head_dim}; use a model "
                         "whose head_dim is at least 32 (e.g. model.tiny.head_dim=32) or rollout.engine=native")
    try:
        from rlbolt.rollout.vllm_engine import VLLMEngine
    except ImportError as error:
        raise ImportError(f"rollout.engine=vllm needs vLLM: pip install 'rlbolt[vllm]' in a venv of its own "
                          f"(docs/howto/engines.md) ({error})") from None
    if spec.sharding is not None and spec.sharding.mesh.size > 1:
        raise ValueError("rollout.engine=vllm runs on one device here; use a mesh of one device or rollout.engine=native")
    folder = spec.model_path
    if folder is None or not Path(folder).is_dir():
        import tempfile

        from rlbolt.models.hf_io import save_hf

        folder = Path(tempfile.mkdtemp(prefix="rlbolt-vllm-")) / "model"
        save_hf(model, model.config, folder)
    return VLLMEngine(folder, max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, top_k=spec.top_k,
                      top_p=spec.top_p, stop_token_ids=spec.stop_token_ids, pad_id=spec.pad_id,
                      prompt_buckets=prompt_buckets(spec.prompt_width), dtype=spec.param_dtype,
                      max_model_len=spec.prompt_width + spec.max_new_tokens,  # the cache holds what a row needs
                      enforce_eager=_on_cpu())  # on CPU: no torch.compile (what was tested)


def _on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


FACTORIES: dict[str, Callable[[Any, EngineSpec], RolloutEngine]] = {"native": native_engine, "vllm": vllm_engine}


def build_engine(engine: str | Callable[[Any, EngineSpec], RolloutEngine], model: Any, spec: EngineSpec) -> RolloutEngine:
    """The engine `engine` names ("native", "vllm") or a factory makes, for `model`.

    Raises:
      ValueError: an unknown name.
      TypeError: what the factory returned is not a RolloutEngine.
    """
    if isinstance(engine, str):
        if engine not in FACTORIES:
            raise ValueError(f"rollout.engine={engine!r}: use one of {list(FACTORIES)} or 'package.module:factory'")
        engine = FACTORIES[engine]
    built = engine(model, spec)
    if not isinstance(built, RolloutEngine):
        raise TypeError(f"the rollout engine factory {getattr(engine, '__qualname__', engine)!r} returned "
                        f"{type(built).__name__}, which has no generate(prompt_ids, rng_keys, **opts) and "
                        "update_weights(params, policy_version)")
    return built


class EngineHandle:
    """A module's side of an engine: pushes weights only when the params object changes, stamps
    the policy version, and can let go of transient weights after a call (merged LoRA kernels).

    Args:
      engine: the RolloutEngine.
      release: params to reinstall after a `keep=False` call (the model's own arrays, which cost
        nothing to hold), so the engine does not keep a transient copy alive. None: keep.
    """

    def __init__(self, engine: RolloutEngine, release: Any = None):
        self.engine = engine
        self._release = release
        self._params: Any = None
        self._version: int | None = None

    @property
    def version(self) -> int:
        """The policy version of the weights the engine holds (0 before any)."""
        return self._version or 0

    def generate(self, params: Any, version: int, prompt_ids: Sequence[Sequence[int]], keys: np.ndarray, *,
                 keep: bool = True, **opts: Any) -> RolloutOutput:
        """Samples with `params` (the weights after `version` optimizer updates).

        Raises:
          RuntimeError: the engine stamped another policy version than the weights it was given
            (it generated with other weights).
        """
        self._push(params, version)
        out = self.engine.generate(prompt_ids, np.asarray(keys, np.uint32), **opts)
        if out.policy_version != version:
            raise RuntimeError(f"the rollout engine {type(self.engine).__name__} generated with policy version "
                               f"{out.policy_version}, but was given the weights of version {version}")
        if not keep:
            self._let_go(version)
        return out

    def open_session(self, params: Any, version: int, prompt_ids: Sequence[Sequence[int]], *, max_total_tokens: int,
                     keep: bool = True, **opts: Any) -> TurnSession | None:
        """The engine's own multi-turn session with `params` (`SessionEngine.open_session`), or None
        where the engine has none or declines (the caller then runs turns through `generate`:
        `rlbolt.rollout.sessions.open_session`). The session holds its weights until closed, so
        with `keep=False` the engine lets go of them at once."""
        if not isinstance(self.engine, SessionEngine):
            return None
        self._push(params, version)
        session = self.engine.open_session(prompt_ids, max_total_tokens=max_total_tokens, **opts)
        if not keep:
            self._let_go(version)
        return session

    def _push(self, params: Any, version: int) -> None:
        if params is not self._params or version != self._version:  # held, so `is` stays meaningful
            self.engine.update_weights(params, version)
            self._params, self._version = params, version

    def _let_go(self, version: int) -> None:
        if self._release is not None:
            self.engine.update_weights(self._release, version)
            self._params = None
