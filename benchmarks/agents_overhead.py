"""Multi-turn overhead: episodes (`rlbolt.agents.run_episodes`) against one completion per sample
with the same number of sampled tokens, on the same model and engine.

8 prompts x G=4 = 32 episodes of 4 turns, 16 sampled tokens a turn at most, a short tool reply
after each turn ("12"), against 32 single-turn completions of 64 tokens. The model is the
benchmark workload's trunk (hidden 256, 4 layers, GQA 4/2, float32) over the agent demo's
character vocabulary; random weights, temperature 1, no stop token (every turn samples all of its
16 tokens, so both sides sample exactly 32 x 64 tokens). Each turn re-prefills the
episode's whole history (the KV cache is not kept across turns), which is most of the overhead.

Prints a table and a final JSON line: seconds and sampled tokens of each, seconds per sampled
token, the overhead ratio, episodes per second, turns per episode, the share of time in the
environment. `--quick`: 1 round instead of 5.

    python benchmarks/agents_overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


class EchoEnv:
    """Replies with a two-digit tool result to every turn; the episode runs its max_turns."""

    tools = ()

    def __init__(self, row):
        self.row = row

    def reset(self):
        return [{"role": "user", "content": self.row["prompt"]}]

    def step(self, turn_text: str):
        from rlbolt.agents import StepResult

        return StepResult(messages=[{"role": "tool", "content": "12"}], reward=0.0, done=False, tool_calls=1)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 timed round")
    args = parser.parse_args(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    import jax
    import numpy as np
    from flax import nnx

    from machine import cpu_model
    from rlbolt.agents import run_episodes
    from rlbolt.agents.tasks import demo_tokenizer
    from rlbolt.models import Decoder, tiny_config
    from rlbolt.rollout.engines import EngineSpec, build_engine

    prompts, group, turns, turn_tokens = 8, 4, 4, 16
    n, total = prompts * group, turns * turn_tokens
    tokenizer = demo_tokenizer()
    config = tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=256, intermediate_size=768, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=512)
    model = Decoder(config, rngs=nnx.Rngs(0))
    rows = [{"prompt": str(i % 10)} for i in range(prompts) for _ in range(group)]
    keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(1), n)), np.uint32)
    prompt_width = 16
    stop = ()  # every turn runs to its budget: the same sampled tokens on both sides
    episodic = build_engine("native", model, EngineSpec(max_new_tokens=turn_tokens, stop_token_ids=stop,
                                                         pad_id=tokenizer.pad_id, prompt_width=prompt_width + total))
    single = build_engine("native", model, EngineSpec(max_new_tokens=total, stop_token_ids=stop,
                                                       pad_id=tokenizer.pad_id, prompt_width=prompt_width))
    prompt_ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}]))
                  for r in rows]
    def episodes():
        envs = [EchoEnv(r) for r in rows]
        batch = run_episodes(episodic, envs, keys, tokenizer=tokenizer, max_turns=turns, max_total_tokens=total + 64,
                             max_turn_tokens=turn_tokens, stop_token_ids=stop)
        return batch

    def one_turn():
        return single.generate(prompt_ids, keys)

    first = {"episodes": episodes(), "single": one_turn()}  # compile
    rounds = 1 if args.quick else 5
    seconds = {"episodes": [], "single": []}
    for _ in range(rounds):
        for name, call in (("episodes", episodes), ("single", one_turn)):
            t0 = time.perf_counter()
            out = call()
            seconds[name].append(time.perf_counter() - t0)
            first[name] = out
    ep, single_out = first["episodes"], first["single"]
    sampled = {"episodes": int(ep.completion_mask.sum()), "single": int(single_out.completion_mask.sum())}
    median = {k: statistics.median(v) for k, v in seconds.items()}
    per_token = {k: median[k] / max(sampled[k], 1) for k in median}
    result = {
        "benchmark": "agents_overhead", "cpu": cpu_model(), "rounds": rounds, "episodes": n, "turns": turns,
        "turn_tokens": turn_tokens, "seconds": median, "sampled_tokens": sampled,
        "seconds_per_sampled_token": per_token,
        "overhead_per_token": per_token["episodes"] / per_token["single"],
        "episodes_per_s": n / median["episodes"], "turns_per_episode": float(ep.turns.mean()),
        "env_tokens_per_episode": float((ep.sequence_mask.sum() - ep.completion_mask.sum()) / n),
        "tool_time_share": float(ep.tool_time_s.sum()) / median["episodes"],
    }
    print(f"{'':10s} {'seconds':>8s} {'sampled':>8s} {'ms/token':>9s}")
    for k in ("episodes", "single"):
        print(f"{k:10s} {median[k]:8.2f} {sampled[k]:8d} {1e3 * per_token[k]:9.2f}")
    print(f"multi-turn overhead per sampled token: {result['overhead_per_token']:.2f}x; "
          f"{result['episodes_per_s']:.1f} episodes/s, {result['turns_per_episode']:.1f} turns per episode")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
