"""The GRPO benchmark workload's reward, importable by reward worker processes.

grpo_step.py's reward: the fraction of even token ids in a completion (its text is the ids,
space-separated: IntTokenizer). `completions` makes a step's worth of such texts.
"""

from __future__ import annotations

import random


def even_fraction(completion: str, sample) -> float:
    """Fraction of the completion's ids that are even (0.0 for an empty completion)."""
    ids = completion.split()
    return sum(int(t) % 2 == 0 for t in ids) / max(len(ids), 1)


def completions(count: int, new_tokens: int = 64, vocab: int = 512, seed: int = 0) -> list[str]:
    """`count` completions of `new_tokens` random ids below `vocab`, as the benchmark decodes them."""
    rng = random.Random(seed)
    return [" ".join(str(rng.randrange(vocab)) for _ in range(new_tokens)) for _ in range(count)]
