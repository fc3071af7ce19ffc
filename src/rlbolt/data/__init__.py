"""Prompt sources, built-in tasks and tokenizers."""

from rlbolt.data.tokenizers import CharTokenizer, HFTokenizer, IntTokenizer, Tokenizer, render_chat_template
from rlbolt.data.loaders import DataFileError, load_rows
from rlbolt.data.tasks import gsm8k_style_rows
from rlbolt.data.source import PromptSource
