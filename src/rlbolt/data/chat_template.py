"""Chat templates rendered as transformers renders them, without importing transformers.

jinja2's `ImmutableSandboxedEnvironment` configured like transformers' (`trim_blocks`,
`lstrip_blocks`, `loopcontrols`, `raise_exception`, `strftime_now`, a `tojson` that does not
HTML-escape, the `{% generation %}` tag), so the rendered prompt equals
`AutoTokenizer.apply_chat_template`. `HFTokenizer.apply_chat_template` calls it with the folder's
template and special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["render_chat_template"]

Message = Mapping[str, Any]


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the tag only to record assistant-token spans; templates that contain it
    must still compile here, and the rendered text is the same either way.
    """

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's built-in tojson HTML-escapes '<', '>', '&' and "'", which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    template: str,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **template_kwargs: Any,
) -> str:
    """Renders a Hugging Face chat template (Jinja) the way transformers does.

    Args:
        template: the Jinja source (`chat_template` of a tokenizer config).
        messages: the conversation, e.g. `[{"role": "user", "content": "2+2?"}]`. Keys whose
            value is None are dropped first, as transformers does.
        add_generation_prompt: append the header that starts an assistant turn.
        special_tokens: token strings visible to the template (`bos_token`, `eos_token`, ...).
        **template_kwargs: extra variables (e.g. `enable_thinking=False`, `tools=[...]`); they
            override `special_tokens` of the same name.

    Returns:
        The rendered prompt string.
    """
    if not messages:
        raise ValueError("apply_chat_template got an empty conversation; pass at least one message.")
    cleaned = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{index}] must be a dict with 'role' and 'content', got {message!r}.")
        cleaned.append({key: value for key, value in message.items() if value is not None})
    variables: dict[str, Any] = {"tools": None, "documents": None}
    variables.update(special_tokens or {})
    variables.update(template_kwargs)
    return _compile_template(template).render(
        messages=cleaned, add_generation_prompt=add_generation_prompt, **variables
    )
