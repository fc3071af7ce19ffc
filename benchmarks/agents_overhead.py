"""Multi-turn overhead: episodes (`rlbolt.agents.run_episodes`) against one completion per sample
with the same number of sampled tokens, on the same model and engine.

8 prompts x G=4 = 32 episodes of 4 turns, 16 sampled tokens a turn at most, a short tool reply
after each turn ("12"), against 32 single-turn completions of 64 tokens. The model is the
benchmark workload's trunk (hidden 256, 4 layers, GQA 4/2, float32) over the agent demo's
character vocabulary; random weights, temperature 1, no stop token (every turn samples all of its
16 tokens, so both sides sample exactly 32 x 64 tokens). The episodes run two ways on the same
engine: "session" keeps each episode's KV cache across turns (the native engine's session: a
later turn prefills only the tool reply), "history" passes each live episode's whole history to
`generate` every turn (what an engine without sessions gets). The three are timed interleaved in
each round; medians are reported.

Prints a table and a final JSON line: seconds and sampled tokens of each, seconds per sampled
token, each path's overhead ratio against single-turn, episodes per second, turns per episode,
the share of time in the environment and the machine's load. `--quick`: 1 round instead of 5.

    python benchmarks/agents_overhead.py [--quick] [--slack 448]
"""

from __future__ import annotations

import argparse
import json
import os
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
    parser.add_argument("--slack", type=int, default=64,
                        help="max_total_tokens = the 64 sampled ids + this (a larger budget: larger caches)")
    args = parser.parse_args(argv)
    from rlbolt.utils.xla_flags import configure_xla_flags

    configure_xla_flags()
    import jax
    import numpy as np
    from flax import nnx

    from machine import cpu_model
    from rlbolt.agents import run_episodes
    from rlbolt.demo.agent_tasks import demo_tokenizer
    from rlbolt.models import Decoder, tiny_config
    from rlbolt.rollout.engines import EngineSpec, build_engine

    prompts, group, turns, turn_tokens = 8, 4, 4, 16
    n, total = prompts * group, turns * turn_tokens
    tokenizer = demo_tokenizer()
    config = tiny_config(vocab_size=tokenizer.vocab_size, hidden_size=256, intermediate_size=768, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=64,
                         max_position_embeddings=max(512, 2 * (total + args.slack)))
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
    def episodes(engine):
        envs = [EchoEnv(r) for r in rows]
        return run_episodes(engine, envs, keys, tokenizer=tokenizer, max_turns=turns,
                            max_total_tokens=total + args.slack, max_turn_tokens=turn_tokens, stop_token_ids=stop)

    calls = {"session": lambda: episodes(episodic),  # the engine's session: KV caches kept across turns
             "history": lambda: episodes(episodic.generate),  # a bare generate: whole histories every turn
             "single": lambda: single.generate(prompt_ids, keys)}
    last = {name: call() for name, call in calls.items()}  # compile
    rounds = 1 if args.quick else 5
    seconds = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():  # interleaved: a slow phase of the machine hits all three
            t0 = time.perf_counter()
            last[name] = call()
            seconds[name].append(time.perf_counter() - t0)
    ep = last["session"]
    if not (ep.completion_ids == last["history"].completion_ids).all():
        raise RuntimeError("the session and history paths sampled different tokens")
    sampled = {name: int(out.completion_mask.sum()) for name, out in last.items()}
    median = {k: statistics.median(v) for k, v in seconds.items()}
    per_token = {k: median[k] / max(sampled[k], 1) for k in median}
    result = {
        "benchmark": "agents_overhead", "cpu": cpu_model(), "load_1min": os.getloadavg()[0], "rounds": rounds,
        "episodes": n, "turns": turns, "turn_tokens": turn_tokens,
        "max_total_tokens": total + args.slack, "seconds": median, "sampled_tokens": sampled,
        "seconds_per_sampled_token": per_token,
        "overhead_per_token": {k: per_token[k] / per_token["single"] for k in ("session", "history")},
        "episodes_per_s": {k: n / median[k] for k in ("session", "history")},
        "turns_per_episode": float(ep.turns.mean()),
        "env_tokens_per_episode": float((ep.sequence_mask.sum() - ep.completion_mask.sum()) / n),
        "tool_time_share": float(ep.tool_time_s.sum()) / median["session"],
    }
    print(f"{'':10s} {'seconds':>8s} {'sampled':>8s} {'ms/token':>9s}")
    for k in calls:
        print(f"{k:10s} {median[k]:8.2f} {sampled[k]:8d} {1e3 * per_token[k]:9.2f}")
    print(f"multi-turn overhead per sampled token: {result['overhead_per_token']['session']:.2f}x with the session, "
          f"{result['overhead_per_token']['history']:.2f}x with whole histories; "
          f"{result['episodes_per_s']['session']:.1f} episodes/s, {result['turns_per_episode']:.1f} turns per episode")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
