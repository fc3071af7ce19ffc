"""Test helpers: a chat tokenizer with a template that is NOT append-only, and a scripted engine."""

from __future__ import annotations

import numpy as np

from rlbolt.data.chat_template import render_chat_template
from rlbolt.rollout.engine import RolloutOutput

SPECIALS = ("<pad>", "<|im_end|>", "<|im_start|>", "\ufffd")  # the last: any character outside CHARS
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))

# Qwen3-like: an assistant message that is not the last message loses its <think>...</think>
# part when the conversation is rendered again, so rendering is not append-only.
DROP_THINK_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set c = m.content -%}"
    "{%- if not loop.last and '</think>' in c -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
    "{{ '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


class ChatTokenizer:
    """Specials as single ids (pad 0, eos <|im_end|> 1, <|im_start|> 2, unknown 3), then one id per character."""

    pad_id, eos_id, bos_id = 0, 1, None

    def __init__(self, template: str = DROP_THINK_TEMPLATE):
        self.template = template
        self.vocab_size = len(SPECIALS) + len(CHARS)
        self.template_calls = []

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            for k, special in enumerate(SPECIALS[1:3], start=1):
                if text.startswith(special, i):
                    ids.append(k)
                    i += len(special)
                    break
            else:
                ids.append(len(SPECIALS) + CHARS.index(text[i]) if text[i] in CHARS else 3)
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for t in (int(i) for i in ids):
            if t < len(SPECIALS):
                if not skip_special_tokens or t == 3:
                    out.append(SPECIALS[t])
            else:
                out.append(CHARS[t - len(SPECIALS)])
        return "".join(out)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        self.template_calls.append(kwargs)
        return render_chat_template(self.template, messages, add_generation_prompt=add_generation_prompt, **kwargs)


class ScriptedEngine:
    """A RolloutEngine whose turn is `script(history_text, key) -> text`; the eos id is appended.

    Each sampled id gets logp -(0.01 * position + 0.001 * row_of_call), so misplaced logps show.
    Records every call's row count.
    """

    def __init__(self, tokenizer, script, append_eos: bool = True):
        self.tokenizer, self.script, self.append_eos = tokenizer, script, append_eos
        self.calls: list[int] = []

    def generate(self, prompt_ids, rng_keys, max_new_tokens: int, temperature: float | None = None) -> RolloutOutput:
        n = len(prompt_ids)
        self.calls.append(n)
        ids = np.full((n, max_new_tokens), self.tokenizer.pad_id, np.int32)
        mask = np.zeros((n, max_new_tokens), bool)
        logps = np.zeros((n, max_new_tokens), np.float32)
        for r, (prompt, key) in enumerate(zip(prompt_ids, np.asarray(rng_keys))):
            text = self.script(self.tokenizer.decode(prompt, skip_special_tokens=False), tuple(int(k) for k in key))
            toks = self.tokenizer.encode(text) + ([self.tokenizer.eos_id] if self.append_eos else [])
            toks = toks[:max_new_tokens]
            ids[r, :len(toks)], mask[r, :len(toks)] = toks, True
            logps[r, :len(toks)] = -(0.01 * np.arange(1, len(toks) + 1))
        width = max(len(p) for p in prompt_ids)
        pids = np.zeros((n, width), np.int32)
        return RolloutOutput(pids, np.ones((n, width), bool), ids, mask, logps)
