"""run_episodes through an `HFTokenizer` (a real `tokenizers` backend with special and added tokens)
and a Qwen-style template that renders `tools=` and groups consecutive tool results."""

import json

import numpy as np
from agents_helpers import ScriptedEngine
from tokenizers import Tokenizer, decoders, models

from rlbolt.agents import HermesToolParser, ToolEnvironment, run_episodes
from rlbolt.data.tokenizers import HFTokenizer

TEMPLATE = (
    "{%- if tools -%}{{ '<|im_start|>system\\nTools:' }}{%- for t in tools -%}{{ '\\n' + (t | tojson) }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


def _tokenizer() -> HFTokenizer:
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    backend.add_tokens(["<tool_call>", "</tool_call>"])
    return HFTokenizer(backend, special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"},
                       chat_template=TEMPLATE)


def weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city.
    """
    return {"Oslo": "rain", "Rome": "sun"}[city]


CALLS = ('<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
         '<tool_call>{"name": "weather", "arguments": {"city": "Rome"}}</tool_call>')


def test_tool_episode_with_a_hugging_face_tokenizer():
    tok = _tokenizer()
    env = ToolEnvironment([{"role": "user", "content": "Weather?"}], [weather], lambda a: float(a == "rain, sun"),
                          HermesToolParser())
    engine = ScriptedEngine(tok, lambda history, key: CALLS if "tool_response" not in history else "rain, sun")
    out = run_episodes(engine, [env], np.zeros((1, 2), np.uint32), tokenizer=tok, max_turns=3, max_total_tokens=600,
                       max_turn_tokens=200)
    assert out.end_reason[0] == "done" and out.env_reward[0] == 1.0 and out.tool_calls[0] == 2
    schema = json.dumps(env.tools[0].schema, ensure_ascii=False)
    assert tok.decode(out.prompt_ids[0], skip_special_tokens=False) == (
        f"<|im_start|>system\nTools:\n{schema}<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n")
    sampled_1 = tok.encode(CALLS) + [tok.eos_id]
    delta = tok.encode("\n<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n"
                       "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    sampled_2 = tok.encode("rain, sun") + [tok.eos_id]
    want = sampled_1 + delta + sampled_2
    np.testing.assert_array_equal(out.completion_ids[0, :len(want)], want)
    np.testing.assert_array_equal(out.completion_mask[0, :len(want)],
                                  [True] * len(sampled_1) + [False] * len(delta) + [True] * len(sampled_2))
    assert tok.encode("<tool_call>") == [tok.vocab_size - 2]  # added tokens stay single ids
