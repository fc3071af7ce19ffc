"""The run config's sections: frozen dataclasses, one per section, every field with a default,
help text and its allowed values (`rlbolt.config.fields.option`). `RunConfig` holds them all; an
empty file is a valid config (the tiny random model on built-in GSM8K-style rows).

Fields left None in the algorithm section take the algorithm's own default when the config is
resolved (`rlbolt.config.load.resolve`, from the module class's `algorithm_defaults`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from rlbolt.config.fields import option as _f
from rlbolt.config.registries import objective_names

METRIC_WRITERS = ("console", "jsonl", "tensorboard", "wandb")
# The policy objectives (algorithm.policy_loss) and reward terms (reward.weights) are registries
# beside their code: rlbolt.config.registries reads their names.


def default_reward_weights(has_env: bool) -> dict:
    """`reward.weights` when the config leaves it None: the environment's reward with an
    environment (rollout.env, or env= from Python), else the GSM8K answer check."""
    return {"env": 1.0} if has_env else {"answer": 1.0, "format": 0.0}


# Positions of every row per chunk of the dense MLP in the training and logps forwards (model.mlp_chunk_positions).
MLP_CHUNK_POSITIONS = 2048
# Intermediate units per weight block of the dense MLP on a mesh that splits its kernels' hidden dim (model.mlp_block_size).
MLP_BLOCK_SIZE = 2048

# Activation rematerialisation per decoder layer (rlbolt.models.remat maps each to its jax.checkpoint policy).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload")
# The attention kernel of the training, logps and prefill forwards (rlbolt.models.attention_kernels resolves it per platform).
ATTENTION_CHOICES = ("auto", "xla", "flash")
# Intermediate units of every expert per gathered block of the MoE kernels under gmm (model.expert_block_size): the
# smallest that fills gmm's 128-wide tiles (the down kernel's contraction is one block's units).
EXPERT_BLOCK_SIZE = 128
# The grouped matmul of the mixture-of-experts layers (rlbolt.models.moe_matmul resolves it per platform).
MOE_MATMUL_CHOICES = ("auto", "ragged_dot", "gmm")
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class ModelSection:
    """The policy model."""

    path: str | None = _f(None, "local Hugging Face model folder (config.json + safetensors), a .gguf file, or 'package:NAME/file' inside an installed package; None: a tiny random model")
    tiny: dict = _f({}, "ModelConfig overrides for the tiny random model, e.g. {hidden_size: 128, num_layers: 4}")
    param_dtype: str = _f("float32", "parameter dtype (compute stays float32 where it matters)", ("float32", "bfloat16"))
    master_weights: str = _f("auto", "auto: with param_dtype bfloat16 the optimizer keeps float32 master weights and float32 AdamW moments (forward, backward, rollout and exports see the bfloat16 params, the masters' casts; checkpoints save the masters; 18 bytes per trained parameter with AdamW against none's 8); none: the optimizer runs on the bfloat16 params themselves (bfloat16 moments; an update below half a bfloat16 ulp of a weight, |update| < |w|/512, rounds away); float32 params: no masters either way", ("auto", "none"))
    tokenizer: str | None = _f(None, "tokenizer folder; None: model.path, or a built-in character tokenizer for the tiny model")
    share_prompt: bool = _f(True, "run each prompt once per group of num_generations samples (rollout prefill, logps, training) instead of once per sample; same results to float32 rounding; stages whose micro batches split groups, and meshes with more than one batch shard, run unshared")
    router_aux_loss_coef: float = _f(0.0, "mixture-of-experts models: add this times the Switch load-balancing loss (over the completion tokens the forward runs, per layer, as transformers' load_balancing_loss_func) to the training loss, logged as moe/aux_loss; 0: off (a Hugging Face config's own router_aux_loss_coef is not read: set it here)", at_least=0)
    lora: dict | None = _f(None, "train LoRA adapters on a frozen base: {rank: 8, alpha: 16, targets: [q, k, v, o, gate, up, down], quantize: null|int8|int4|nf4, rollout: merged|adapters} (omitted keys take these defaults; rollout defaults to adapters when quantized); None: train every parameter")
    remat: str = _f("none", "activation rematerialisation of each decoder layer in every training forward (the backward recomputes what the policy does not keep; same losses and gradients): none (keep everything), full (keep only each layer's input), dots_saveable (keep the matmul outputs), dots_with_no_batch_dims_saveable (keep the weight products, recompute attention), offload (as the last, kept in host memory); docs/performance.md", REMAT_POLICIES)
    scan_layers: bool = _f(False, "run the decoder's layers as one jax.lax.scan body in the unshared cache-free forwards (compile time stops growing with depth); the layers are then stored stacked (one [L, ...] array per parameter kind: no copy per forward; checkpoints, Hugging Face / GGUF export and resume see the per-layer layout); a LoRA run keeps them stored per layer and stacks them at each forward (one more copy of the layer weights); mixture-of-experts layers are stored stacked too unless the run records or replays their routing (model.router_aux_loss_coef > 0, rollout.record_routing, algorithm.router_replay: then stored per layer, stacked at each forward, and the forwards that record or replay routing loop), and layers that differ in structure keep the loop; the prompt-shared forward and decoding loop over per-layer views")
    attention: str = _f("auto", "the attention of the training, logps and prefill forwards: flash (a fused kernel that keeps no [T, T] score matrix, memory linear in length: Pallas splash attention on TPU, cuDNN on GPU; an error on CPU), xla (XLA's products and softmax over 128-row query chunks), auto (flash where the platform has a kernel, else xla); a layer the kernel cannot run (cuDNN: float32 params, soft-capping, packed rows) runs xla, logged once; decode steps always run xla; docs/architecture.md", ATTENTION_CHOICES)
    moe_matmul: str = _f("auto", "mixture-of-experts models: the experts' grouped matmul: gmm (Pallas megablox, TPU only: visits only each expert's row tiles, run under shard_map over the mesh so each chip sorts and multiplies its own rows), ragged_dot (jax.lax.ragged_dot; on a TPU slice XLA's partitioner runs every chip's tokens on every chip unless mesh.expert > 1), auto (gmm on TPU, else ragged_dot); same outputs and gradients to float32 accumulation; docs/architecture.md", MOE_MATMUL_CHOICES)
    mlp_chunk_positions: int = _f(MLP_CHUNK_POSITIONS, "the dense MLP of every decoder layer runs this many positions of every row at a time, each chunk recomputed in the backward, so its [B, T, 2 x intermediate] activations exist for one chunk at a time (the largest per-layer buffers at 16k+ tokens; same results to float32 rounding, no extra products under model.remat); 0: all positions at once", at_least=0)
    mlp_block_size: int = _f(MLP_BLOCK_SIZE, "on a mesh whose axes (fsdp) split the dense MLP kernels' hidden dim: the MLP gathers its gate|up and down kernels, and forms and reduce-scatters their gradients, this many intermediate units at a time (the fewest blocks that divide the intermediate size), so one block of each exists per chip at a time, not the layer's whole kernels and gradients; same results to float32 rounding, the same bytes moved; LoRA, quantised and tensor-parallel MLPs keep whole kernels; 0: whole kernels", at_least=0)
    expert_block_size: int = _f(EXPERT_BLOCK_SIZE, "mixture-of-experts models under gmm on a mesh whose axes (fsdp) split the experts' kernels' hidden dim: each MoE layer gathers all experts' gate|up and down kernels, and forms and reduce-scatters their gradients, this many intermediate units at a time (the fewest blocks that divide the experts' intermediate size), so one block exists per chip at a time, not the layer's whole expert kernels and gradients; same results to float32 rounding, the same bytes moved; 0: whole kernels", at_least=0)
    logits_chunk_tokens: int | None = _f(1024, "sets the block of the output projection + log-softmax in the logps and training forwards: both passes run over vocabulary blocks of every token at once, each about this many tokens (all rows of a micro batch together) x V float32 logits in the forward, half that in the backward (which recomputes each block's), so the [B, T, V] logits never exist at once and the weight is read a block at a time; same results to float32 rounding; 0 or null: unchunked", at_least=0)


@dataclass(frozen=True)
class DataSection:
    """Prompt rows for training and validation."""

    train: str | None = _f(None, "train rows: a .jsonl, .json or .parquet file, or a generated reasoning-gym task 'reasoning_gym:<name>' (the rlbolt[tasks] extra; score it with reward.weights: {task: 1.0}); None: built-in GSM8K-style rows")
    val: str | None = _f(None, "validation rows (same formats; 'reasoning_gym:<name>' of the train task draws rows from seeds training never used); None: no validation unless data.builtin_val_rows > 0")
    task_options: dict = _f({}, "a reasoning_gym:<name> task's options (its dataset config fields, e.g. {min_terms: 2, max_terms: 3})")
    task_train_size: int = _f(1000, "rows generated for a reasoning_gym:<name> data.train", at_least=1)
    task_val_size: int = _f(200, "rows generated for a reasoning_gym:<name> data.val (fewer when some repeat a training question)", at_least=1)
    task_seed: int = _f(0, "the seed of a reasoning_gym:<name> task's training rows (validation rows come from seeds after them)")
    prompt_field: str = _f("question", "row field holding the prompt text")
    answer_field: str = _f("answer", "row field holding the gold answer ('... #### 42' or '42')")
    system_prompt: str | None = _f(None, "system message put before each prompt when the tokenizer has a chat template")
    use_chat_template: bool = _f(True, "format prompts with the tokenizer's chat template when it has one")
    chat_template_kwargs: dict = _f({}, "extra chat-template variables for every render (prompts, and with rollout.env each environment reply), e.g. {enable_thinking: false} for Qwen3")
    max_prompt_tokens: int = _f(256, "longer prompts keep their last max_prompt_tokens tokens (the question's end)", at_least=1)
    shuffle: bool = _f(True, "reshuffle the train rows every epoch")
    builtin_train_rows: int = _f(256, "how many built-in rows to generate when data.train is None", at_least=1)
    builtin_val_rows: int = _f(0, "how many built-in validation rows to generate when data.val is None", at_least=0)
    builtin_seed: int = _f(0, "seed of the built-in row generator")


@dataclass(frozen=True)
class PlanSection:
    """Batch sizes, in samples unless the name says prompts (see rlbolt.plan.BatchPlan)."""

    prompts_per_step: int = _f(4, "prompts per global step", at_least=1)
    num_generations: int = _f(4, "completions sampled per prompt (the group size G)", at_least=1)
    mini_batch_size: int | None = _f(None, "samples per optimizer update; None: the whole global batch", at_least=1)
    train_micro_batch_size: int | None = _f(None, "samples per gradient call; None: the mini batch", at_least=1)
    logps_micro_batch_size: int | None = _f(None, "samples per logps forward; None: train_micro_batch_size", at_least=1)
    rollout_micro_batch_size: int | None = _f(None, "samples per sampler call; None: the global batch", at_least=1)
    reward_micro_batch_size: int | None = _f(None, "samples per reward call (scored while later samples still "
                                                 "generate); None: the global batch", at_least=1)
    num_iterations: int = _f(1, "update passes over each global batch (mu)", at_least=1)
    max_refill_rounds: int | None = _f(None, "extra prompt draws when groups are dropped (DAPO); None: 4 with dynamic sampling, else 0", at_least=0)
    packing: str = _f("off", "on: the update and the log-prob forwards lay several samples end to end in each row (segment ids, positions restarting per sample, attention never crossing samples), so tokens, not rows, set the cost; same losses, gradients and metrics to float32 rounding; replaces model.share_prompt in those forwards (rollout keeps it); mixture-of-experts router terms and router replay run padded (docs/architecture.md, Packed batches)", ("off", "on"))
    packed_row_tokens: int | None = _f(None, "packing only: tokens per packed row; every sample (prompt + completion) must fit; None: the padded width (prompt + completion budget)", at_least=1)
    packed_rows: int | None = _f(None, "packing only: packed rows per train micro batch and batch shard, fixed (one compiled shape, the one `rlbolt plan` compiles; a micro batch that needs more is refused); None: as many as each step needs, rounded up to three binary digits (a few compiled shapes; `rlbolt plan` then assumes one row per sample)", at_least=1)


@dataclass(frozen=True)
class RolloutSection:
    """Sampling."""

    max_new_tokens: int = _f(32, "completion budget in tokens (also the Dr.GRPO length constant)", at_least=1)
    temperature: float = _f(1.0, "sampling temperature; 0 = greedy", at_least=0)
    top_k: int = _f(0, "keep the k most likely tokens; 0 = off", at_least=0)
    top_p: float = _f(1.0, "nucleus sampling mass; 1.0 = off", above=0, at_most=1)
    stop_at_eos: bool = _f(True, "stop a completion at the tokenizer's eos token")
    env: str | None = _f(None, "multi-turn episodes: an environment factory 'package.module:Factory' called with each prompt row (docs/howto/agents.md); max_new_tokens is then the budget of one turn; None: one completion per prompt")
    max_turns: int = _f(4, "with env: the most model turns per episode", at_least=1)
    max_total_tokens: int | None = _f(None, "with env: the most ids after the prompt per episode, sampled and environment ids together; None: max_turns * max_new_tokens", at_least=1)
    env_step_timeout_s: float = _f(60.0, "with env: seconds one environment step may take before its episode ends (end reason env_error)", above=0)
    env_max_failed_batches: int = _f(3, "with env: stop with an error quoting the first environment error when every episode ended with one (env_error) in this many consecutive rollout batches; every error is logged to train.log either way; 0: never stop", at_least=0)
    engine: str = _f("native", "what generates the completions: native (rlbolt's jitted sampler), vllm (vLLM in process: the rlbolt[vllm] extra), or a factory 'package.module:make_engine' called as factory(model, EngineSpec) -> RolloutEngine (docs/howto/engines.md)")
    record_routing: bool = _f(False, "mixture-of-experts models, native engine: keep the experts the rollout routed every token to (columns prompt_routing, completion_routing) for algorithm.router_replay; without replay the logps stage recomputes the routing and logs moe/routing_mismatch (one more forward per sample when old logps were the sampler's)")
    val_temperature: float = _f(1.0, "temperature of the pass@k samples in validation (accuracy is always greedy)", at_least=0)
    val_num_samples: int = _f(4, "k of pass@k in validation; 1 = greedy accuracy only", at_least=1)


@dataclass(frozen=True)
class AlgorithmSection:
    """The RL algorithm. Fields left None take the algorithm's own default (its module class's `algorithm_defaults`)."""

    name: str = _f("grpo", "which algorithm (RLModule class) trains: a registered name (`rlbolt fit --list-algorithms`; the ready ones are grpo, dapo, drgrpo, rloo, reinforcepp, gspo, ppo) or the algorithm_name of the class objects.module names")
    lr: float = _f(1e-6, "AdamW learning rate", above=0)
    weight_decay: float = _f(0.0, "AdamW weight decay", at_least=0)
    warmup_steps: int = _f(0, "linear learning-rate warm-up, in optimizer updates", at_least=0)
    max_grad_norm: float = _f(1.0, "clip gradients to this global norm; 0 = off", at_least=0)
    beta: float = _f(0.0, "KL coefficient to a frozen reference copy; > 0 builds the reference model", at_least=0)
    kl_kind: str = _f("k3", "KL estimator (Schulman 2020)", ("k1", "k2", "k3"))
    kl_clamp: float | None = _f(None, "clamp the per-token KL to [-kl_clamp, kl_clamp]; None = off", above=0)
    clip_low: float | None = _f(None, "lower ratio clip epsilon; None: algorithm default (GSPO 3e-4, else 0.2)", at_least=0)
    clip_high: float | None = _f(None, "upper ratio clip epsilon; None: algorithm default (DAPO 0.28, GSPO 4e-4, else 0.2)", at_least=0)
    dual_clip: float | None = _f(None, "dual-clip constant c > 1 bounding the loss for negative advantages; None = off", above=1)
    loss_aggregation: str | None = _f(None, "how per-token losses become one scalar; None: the policy objective's paper aggregation (policy_loss gspo, sapo, gmpo: seq-mean-token-mean; cispo: token-mean), else the algorithm's (grpo, gspo: seq-mean-token-mean; drgrpo: seq-mean-token-sum-norm; rloo: seq-mean-token-sum; dapo, ppo, reinforcepp: token-mean)", LOSS_AGGREGATIONS)
    dynamic_sampling: bool | None = _f(None, "drop groups whose rewards are all equal and refill (DAPO); None: on for dapo only")
    overlong_cache_length: int | None = _f(None, "DAPO soft overlong ramp width L_cache in tokens (0 = off); None: max_new_tokens // 4 for dapo, else 0", at_least=0)
    policy_loss: str | None = _f(None, "the per-token policy objective: ppo (PPO-clip with clip-higher / dual-clip), gspo (sequence ratio), cispo (clipped IS weight, every token keeps its gradient; MiniMax-M1), sapo (soft sigmoid gate), gmpo (geometric mean of token ratios), clip_cov / kl_cov (clip or KL-penalise the tokens of highest log-prob/advantage covariance), or one registered with rlbolt.algorithms.register_objective; None: the algorithm's own (gspo for GSPO, else ppo)", objective_names)
    sapo_tau_pos: float = _f(1.0, "sapo: the gate's temperature for positive advantages", above=0)
    sapo_tau_neg: float = _f(1.05, "sapo: the gate's temperature for negative advantages", above=0)
    cov_select_ratio: float | None = _f(None, "clip_cov / kl_cov: the share of tokens the covariance rule selects; None: 2e-4 for clip_cov, 2e-3 for kl_cov", above=0, at_most=1)
    clip_cov_low: float = _f(1.0, "clip_cov: tokens whose covariance lies in [clip_cov_low, clip_cov_high] may be selected")
    clip_cov_high: float = _f(5.0, "clip_cov: upper end of the covariance band")
    kl_cov_coef: float = _f(1.0, "kl_cov: the coefficient of the |log ratio| penalty on selected tokens", at_least=0)
    distill_teacher: str | None = _f(None, "on-policy distillation: a teacher model (Hugging Face folder, .gguf file or package:NAME/file of a supported family, same tokenizer as the student, else refused) scores the student's sampled tokens; each token's advantage is -distill_kl_coef * (log student - log teacher), plus distill_task_coef * the task advantage; on train's devices or its own (trainer.placement.teacher); logs distill/reverse_kl (docs/howto/distillation.md); None: off")
    distill_kl_coef: float = _f(1.0, "on-policy distillation: the weight of the per-token reverse KL to the teacher", at_least=0)
    distill_task_coef: float = _f(0.0, "on-policy distillation: the weight of the reward's advantage mixed in; 0: distillation alone", at_least=0)
    entropy_coef: float = _f(0.0, "entropy bonus coefficient (subtracted from the loss)", at_least=0)
    importance_cap: float | None = _f(None, "shorthand for rollout_correction: tis with rollout_correction_cap at this value; None = off", above=0)
    rollout_correction: str | None = _f(None, "correct the policy-gradient ratio for rollout logps that are not the trainer's (another engine, bf16 sampling, staleness): tis (truncated IS weights, capped), mis (drop tokens/sequences whose ratio leaves [1/cap, cap]), icepop (drop tokens whose ratio leaves [0.5, 5]), mask (drop without reweighting), none; None: tis when rollout.engine is not native (or importance_cap is set), else none", ("tis", "mis", "icepop", "mask", "none"))
    rollout_correction_level: str = _f("token", "the ratio rollout_correction reads: token, sequence (the product of a sequence's token ratios) or geometric (their geometric mean)", ("token", "sequence", "geometric"))
    rollout_correction_cap: float = _f(2.0, "tis: the weight cap C; mis / mask: keep ratios in [1/C, C]", above=1)
    router_replay: bool = _f(False, "mixture-of-experts models: the training forward (and the old-logps forward) uses the experts the rollout chose for each token (rollout.record_routing must be on) instead of re-routing; the weights stay the router's probabilities at those experts, so the router still trains")
    gamma: float = _f(1.0, "discount for REINFORCE++ returns and PPO GAE", at_least=0, at_most=1)
    lam: float = _f(0.95, "GAE lambda (PPO)", at_least=0, at_most=1)
    value_coef: float = _f(0.5, "value loss coefficient (PPO)", at_least=0)
    value_clip: float = _f(0.2, "value clip range (PPO)", above=0)


@dataclass(frozen=True)
class RewardSection:
    """Reward functions, scored per sample with failure isolation."""

    weights: dict | None = _f(None, "reward term -> weight; terms: answer (GSM8K final answer), format (think/answer tags), digits (fraction of digit characters: a dense signal for tiny-model smoke runs), task (a reasoning_gym task's own scorer on the extracted final answer), env (an episode's environment rewards, summed: with rollout.env); weight 0 drops a term; with an environment the weights must name env (env: 0 scores the transcripts alone); None: {env: 1.0} with rollout.env, else {answer: 1.0, format: 0.0}")
    timeout_s: float = _f(10.0, "seconds one sample's reward may run before it gets the penalty", above=0)
    penalty: float = _f(0.0, "reward of a sample whose reward function failed or timed out")
    max_workers: int = _f(4, "concurrent reward workers", at_least=1)
    executor: str = _f("auto", "where rewards run: process (a worker process per slot: a reward that exits, holds the GIL or hangs costs only its sample), thread (no isolation from those), auto (process, or thread with a warning when the reward cannot be pickled)", ("auto", "process", "thread"))
    max_failed_batches: int = _f(3, "stop with an error naming the reward when every sample's reward failed in this many consecutive batches; 0: never stop", at_least=0)


@dataclass(frozen=True)
class TrainerSection:
    """The fit loop (see rlbolt.trainer.Trainer)."""

    max_steps: int | None = _f(None, "global steps to run; None: until max_epochs", at_least=1)
    max_epochs: int | None = _f(None, "passes over the train rows; None: 1 when max_steps is None", at_least=1)
    seed: int = _f(0, "seeds parameter init and every rollout key")
    data_seed: int | None = _f(None, "seeds the per-epoch shuffle; None: trainer.seed")
    mode: str = _f("sync", "sync: on-policy; async: the producer runs ahead, bounded by max_staleness", ("sync", "async"))
    max_staleness: int | None = _f(None, "async only: most policy versions a trained sample may lag", at_least=1)
    val_every_n_steps: int | None = _f(None, "validate every n steps (and after the last step when there are val rows)", at_least=1)
    val_batch_size: int | None = _f(None, "prompts per validation batch; None: plan.prompts_per_step", at_least=1)
    val_at_start: bool = _f(False, "also validate the starting weights before the first step (step 0; not on a resume): the 'before' of a before/after comparison")
    run_dir: str | None = _f(None, "where metrics and checkpoints go; None: runs/<algorithm>-<time>")
    prefetch_timeout_s: float | None = _f(None, "fail if the producer yields nothing for this long; None: wait (across process groups: each wait for the other group, 1800 s when None)", above=0)
    placement: str | dict = _f("colocated", "colocated: every role on the mesh; or {train: {devices: [start, stop], mesh: {..}}, rollout: {devices: [..], mesh: {..}}, reference: train | {devices: [..], mesh: {..}}, teacher: train | {devices: [..], mesh: {..}}}: rollout on its own devices, weights resharded there after each update; the reference forward, and the distillation teacher's, on train's devices or their own (docs/howto/placement.md)")


@dataclass(frozen=True)
class MeshSection:
    """The device mesh data x fsdp x expert x context x tp (-1: every device the other axes leave; docs/howto/multi-device.md)."""

    data: int = _f(1, "data-parallel replicas (each holds the whole fsdp-sharded model)")
    fsdp: int = _f(-1, "fully-sharded data parallel: params, gradients and optimizer state split over it, and the batch")
    tp: int = _f(1, "tensor parallel: heads, MLP columns and the vocabulary split over it")
    expert: int = _f(1, "expert parallel (mixture-of-experts models): the experts split over it (it must divide num_experts), and the batch too (every other weight is replicated over it, as over data); 1: off")
    context: int = _f(1, "context parallel: each sequence's tokens split over it in the update and the log-prob forwards (ring attention over a ppermute ring, causal chunks load-balanced; lengths padded to a multiple of 2 x context inside); parameters and rows are not split over it; 1: off")


@dataclass(frozen=True)
class DistributedSection:
    """Several processes (hosts) on JAX's distributed runtime (docs/howto/multi-host.md)."""

    mode: str = _f("auto", "auto: start when an address/count is set here or in $JAX_COORDINATOR_ADDRESS / $JAX_NUM_PROCESSES / $JAX_PROCESS_ID, or Slurm runs > 1 task; on: always (JAX detects TPU/Slurm/MPI); off: one process", ("auto", "on", "off"))
    coordinator_address: str | None = _f(None, "host:port of process 0; None: $JAX_COORDINATOR_ADDRESS or detected")
    num_processes: int | None = _f(None, "processes taking part; None: $JAX_NUM_PROCESSES or detected", at_least=1)
    process_id: int | None = _f(None, "this process's index; None: $JAX_PROCESS_ID or detected", at_least=0)
    heartbeat_timeout_s: int = _f(30, "a process silent this long is declared dead and every other process exits with an error", at_least=1)
    initialization_timeout_s: int = _f(300, "how long to wait for every process to connect", at_least=1)


@dataclass(frozen=True)
class CallbacksSection:
    """Built-in callbacks."""

    checkpoint: bool = _f(True, "save checkpoints: the last step at the end and when stopped by SIGINT/SIGTERM, plus every checkpoint_every_n_steps; false: none (the run cannot be resumed or exported)")
    checkpoint_every_n_steps: int | None = _f(None, "also save a checkpoint every n steps; None: only at the end (and when stopped by a signal)", at_least=1)
    keep: int = _f(3, "checkpoints to keep", at_least=1)
    resume: bool = _f(True, "resume from the newest checkpoint in run_dir when there is one")
    metrics: tuple = _f(("console", "jsonl"), f"metric writers, any of {METRIC_WRITERS}")
    log_every_n_steps: int = _f(1, "write metrics every n steps", at_least=1)
    progress: bool = _f(True, "show a progress bar")
    timeline: bool = _f(True, "append every stage's start and end to timeline.jsonl (rlbolt plot draws it)")
    export_hf: bool = _f(False, "write a Hugging Face folder (safetensors + config + tokenizer) at the end")
    nan_guard: bool = _f(True, "stop with a clear error when the loss or grad norm is not finite")
    lr_monitor: bool = _f(True, "log the learning rate of each step's last update as `lr`")
    throughput: bool = _f(True, "log FLOP/s, MFU (where the device's peak is known) and each stage's share of the step")
    offload: bool = _f(False, "keep the optimizer state and the reference model in host memory outside the stages that use them")
    early_stopping_metric: str | None = _f(None, "stop when this metric (e.g. val/accuracy) stops improving; None: off")
    early_stopping_mode: str = _f("max", "whether the early-stopping metric should go up or down", ("max", "min"))
    early_stopping_patience: int = _f(3, "checks without improvement before stopping", at_least=1)
    wandb_project: str | None = _f(None, "Weights & Biases project when metrics include wandb")


@dataclass(frozen=True)
class ObjectsSection:
    """Python objects the run uses instead of building them from the other sections."""

    model: str | None = _f(None, "an nnx Decoder to train, as an importable reference 'package.module:name'; replaces model.path / model.tiny")
    tokenizer: str | None = _f(None, "a tokenizer, as 'package.module:name'; replaces model.tokenizer")
    module: str | None = _f(None, "the RLModule class that trains, as 'package.module:Class' (a class with its own algorithm_name, e.g. a GRPO subclass); importing it registers its name, which becomes algorithm.name")
    reward: str | None = _f(None, "a reward function fn(completion, sample) -> float (or a WeightedReward), as 'package.module:name'; replaces reward.weights. build_run(cfg, reward=fn) records it here")


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    plan: PlanSection = field(default_factory=PlanSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    reward: RewardSection = field(default_factory=RewardSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    callbacks: CallbacksSection = field(default_factory=CallbacksSection)
    mesh: MeshSection = field(default_factory=MeshSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    objects: ObjectsSection = field(default_factory=ObjectsSection)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(RunConfig)}
