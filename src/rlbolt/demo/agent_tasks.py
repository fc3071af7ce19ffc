"""Two multi-turn tasks a tiny random-init model learns from scratch on a CPU, with their
environments (registered in `rlbolt.demo.tasks`).

Both use `demo_tokenizer()`, a character tokenizer over `DEMO_ALPHABET` (digits, `?`, `!`, `<`,
`>`, newline); the built-in "chat template" joins message contents with newlines, so a turn's
environment delta is "\\n" + reply + "\\n".

"tool" (`lookup_rows`, `lookup_env`): the prompt is a key digit k; the value is
`row["table"][k]`, a digit drawn per row, which only the `lookup` tool returns. The model must
call it (`?k`, read by `CompactToolParser`), read the reply and answer with the value:

    prompt "3\\n"  model "?3"  env "\\n5\\n"  model "5<eos>"  -> reward 1

Reward: 1.0 for the right answer (its first character is read) after looking up the right key;
0.3 for looking up the right key then answering wrong; 0.1 for any well-formed lookup (so a
random policy finds the tool at all: a few percent of its turns are calls). A right answer
without the lookup earns nothing. A random model scores about 0.01.

"guess" (`guess_rows`, `guess_env`): guess a secret in [0, num_values) in at most `max_turns`
turns; each wrong guess is answered "<" (the secret is lower) or ">" (higher), a malformed turn
(anything but one digit in range, then the stop token) "!". Later turns must depend on the
replies: with 6 values and 4 turns a fixed guessing order finds the secret 4 times in 6 (0.67),
binary search always. Reward: 1.0 when found, else 0.1 x the fraction of well-formed guesses
(a random model scores a few hundredths).

Both tasks decode a turn with `DemoTokenizer`, which drops only the stop token: a pad or bos
the model samples inside a turn makes the turn malformed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from rlbolt.agents.environment import StepResult, ToolEnvironment
from rlbolt.agents.parsers import CompactToolParser
from rlbolt.agents.tools import ToolRunner
from rlbolt.data.tokenizers import CharTokenizer

__all__ = ["DEMO_ALPHABET", "demo_tokenizer", "lookup_rows", "lookup_env", "guess_rows", "guess_env",
           "GuessEnvironment", "DemoTokenizer"]

DEMO_ALPHABET = "0123456789?!<>\n"
_DIGITS = "0123456789"


class DemoTokenizer(CharTokenizer):
    """`CharTokenizer` over DEMO_ALPHABET whose text keeps a sampled pad or bos visible.

    A turn's text is decoded without the stop token (eos), as usual; a pad or bos the model
    sampled inside a turn stays in the text ("<pad>"), so "<pad>4" is a malformed turn, not "4".
    """

    def __init__(self):
        super().__init__(DEMO_ALPHABET)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Ids -> text; with `skip_special_tokens` only eos is dropped."""
        if skip_special_tokens:
            ids = [i for i in ids if int(i) != self.eos_id]
        return super().decode(ids, skip_special_tokens=False)


def demo_tokenizer() -> DemoTokenizer:
    """The tokenizer both demo tasks use (pad 0, eos 1, bos 2, then DEMO_ALPHABET)."""
    return DemoTokenizer()


def lookup_rows(num_rows: int, seed: int = 0) -> list[dict]:
    """Rows `{"prompt": "3", "key": "3", "table": "5827104963"}`: a key and a random table per row."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(num_rows):
        key = str(int(rng.integers(10)))
        table = "".join(_DIGITS[d] for d in rng.integers(0, 10, size=10))
        rows.append({"prompt": key, "key": key, "table": table})
    return rows


class _LookupTable:
    """The row's table, and which keys the episode looked up."""

    def __init__(self, table: str):
        self.table = table
        self.looked_up: list[str] = []

    def lookup(self, key: str) -> str:
        """Returns the value stored under a key.

        Args:
            key: one digit.
        """
        if len(key) != 1 or key not in _DIGITS:
            raise KeyError(f"no key {key!r}")
        self.looked_up.append(key)
        return self.table[int(key)]


_SHARED_RUNNER = ToolRunner(timeout_s=5.0, max_result_chars=16)  # stateless; shared by every episode


def lookup_env(row: Mapping) -> ToolEnvironment:
    """The "tool" task's environment for one row (a `Factory(row) -> Environment`)."""
    table = _LookupTable(str(row["table"]))
    key = str(row["key"])
    value = table.table[int(key)]

    def score(answer: str) -> float:
        if key in table.looked_up:
            return 1.0 if answer[:1] == value else 0.3
        return 0.1 if table.looked_up else 0.0

    return ToolEnvironment([{"role": "user", "content": str(row["prompt"])}], [table.lookup], score,
                           CompactToolParser({"?": ("lookup", "key")}), runner=_SHARED_RUNNER,
                           format_error=lambda text: "!")


def guess_rows(num_rows: int, seed: int = 0, num_values: int = 6) -> list[dict]:
    """Rows `{"prompt": "?", "secret": 5, "num_values": 6}`."""
    if not 2 <= num_values <= 10:
        raise ValueError(f"guess_rows: num_values={num_values} must be in [2, 10] (one digit per guess)")
    rng = np.random.default_rng(seed)
    return [{"prompt": "?", "secret": int(s), "num_values": num_values} for s in rng.integers(0, num_values, num_rows)]


class GuessEnvironment:
    """Guess-the-number with "<" / ">" feedback (the environment protocol written out by hand).

    Args:
        secret: the number to find.
        num_values: guesses are digits in [0, num_values).
        max_turns: the episode's turn limit (the format bonus is per turn of it).
    """

    def __init__(self, secret: int, num_values: int, max_turns: int = 4):
        self.secret, self.num_values, self.max_turns = int(secret), int(num_values), max_turns
        self.well_formed = 0

    def reset(self) -> list[dict]:
        """One user message "?"."""
        return [{"role": "user", "content": "?"}]

    def step(self, turn_text: str) -> StepResult:
        """"<" / ">" for a wrong guess, "!" for a malformed turn; reward 1 and done when found."""
        if len(turn_text) != 1 or turn_text not in _DIGITS[:self.num_values]:
            return StepResult(messages=[{"role": "user", "content": "!"}], reward=0.0)
        self.well_formed += 1
        guess = int(turn_text)
        if guess == self.secret:
            return StepResult(reward=1.0 - 0.1 * (self.well_formed - 1) / self.max_turns, done=True)
        bonus = 0.1 / self.max_turns
        return StepResult(messages=[{"role": "user", "content": "<" if self.secret < guess else ">"}], reward=bonus)


def guess_env(row: Mapping) -> GuessEnvironment:
    """The "guess" task's environment for one row."""
    return GuessEnvironment(int(row["secret"]), int(row.get("num_values", 6)), int(row.get("max_turns", 4)))
