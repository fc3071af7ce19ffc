"""Per-sample cost of each reward executor on the GRPO benchmark workload's reward.

Workload (grpo_step.py): 8 prompts x 4 generations = 32 samples a step, each a 64-token
completion scored by the fraction of even ids (benchmarks/workload_reward.py). For each executor
(`thread`, and `process`, the default) a `RewardRunner` with the config's default 4 workers
scores the step's 32 samples `--steps` times; reported: the median seconds per call divided by
32 (the per-sample cost), the same for calling the reward directly in a loop (what any executor
must pay), their difference (the executor's overhead per sample), and the first call, which
starts the workers.

    python benchmarks/reward_executors.py            # 300 calls per executor
    python benchmarks/reward_executors.py --quick    # 5 calls (CI keeps it from rotting)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model  # noqa: E402
from workload_reward import completions, even_fraction  # noqa: E402

SAMPLES = 32



def _median_call_s(call, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    steps = 5 if args.quick else args.steps

    from rlbolt.rewards import RewardRunner

    texts = completions(SAMPLES)
    rows = [{"prompt_index": i // 4} for i in range(SAMPLES)]
    direct_s = _median_call_s(lambda: [even_fraction(t, r) for t, r in zip(texts, rows)], steps)
    result = {"system": "rlbolt-reward-executors", "cpu": cpu_model(), "samples_per_call": SAMPLES, "steps": steps,
              "direct_us_per_sample": 1e6 * direct_s / SAMPLES}
    for executor in ("thread", "process"):
        with RewardRunner(even_fraction, executor=executor) as runner:
            start = time.perf_counter()
            first = runner.score(texts, rows)
            result[f"{executor}_first_call_s"] = time.perf_counter() - start
            assert first.metrics["reward/failures"] == 0.0
            call_s = _median_call_s(lambda: runner.score(texts, rows), steps)
        result[f"{executor}_us_per_sample"] = 1e6 * call_s / SAMPLES
        result[f"{executor}_overhead_us_per_sample"] = result[f"{executor}_us_per_sample"] - result["direct_us_per_sample"]

    print(f"reward executors on the benchmark reward, {SAMPLES} samples a call, median of {steps} calls ({result['cpu']})")
    print(f"{'executor':<10}{'us/sample':>12}{'overhead us':>14}{'first call s':>14}")
    print(f"{'direct':<10}{result['direct_us_per_sample']:>12.1f}{0.0:>14.1f}{'':>14}")
    for executor in ("thread", "process"):
        print(f"{executor:<10}{result[f'{executor}_us_per_sample']:>12.1f}"
              f"{result[f'{executor}_overhead_us_per_sample']:>14.1f}{result[f'{executor}_first_call_s']:>14.3f}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
