"""Prompt sources, built-in tasks and tokenizers."""

from rlbolt.data.tokenizers import CharTokenizer, HFTokenizer, IntTokenizer, Tokenizer, render_chat_template
