"""A CharTokenizer written as Hugging Face files reads back (ours and transformers') with the same ids."""

from __future__ import annotations

import pytest

from rlbolt.data import CharTokenizer, HFTokenizer
from rlbolt.data.char_tokenizer_files import save_char_tokenizer
from rlbolt.modules.prompts import BUILTIN_ALPHABET


@pytest.mark.parametrize("alphabet, text", [("0123456789=", "3141=0"), (BUILTIN_ALPHABET, "Hi <there>\n 12+3 = ?")])
def test_the_files_encode_and_decode_as_the_char_tokenizer(tmp_path, alphabet, text):
    char = CharTokenizer(alphabet)
    hf = HFTokenizer.from_folder(save_char_tokenizer(char, tmp_path))
    assert (hf.vocab_size, hf.pad_id, hf.eos_id, hf.bos_id) == (char.vocab_size, 0, 1, 2)
    assert hf.encode(text) == char.encode(text)
    ids = char.encode(text) + [char.eos_id]
    assert hf.decode(ids) == char.decode(ids) == text
    assert hf.decode([char.bos_id, *ids], skip_special_tokens=False) == "<bos>" + text + "<eos>"


def test_transformers_reads_the_same_ids(tmp_path):
    from transformers import AutoTokenizer

    char = CharTokenizer("0123456789=")
    auto = AutoTokenizer.from_pretrained(save_char_tokenizer(char, tmp_path))
    assert auto("2718=", add_special_tokens=False).input_ids == char.encode("2718=") == [5, 10, 4, 11, 13]
    assert (auto.eos_token_id, auto.pad_token_id, len(auto)) == (1, 0, 14)


def test_only_a_char_tokenizer_is_written(tmp_path):
    with pytest.raises(TypeError, match="takes a CharTokenizer, got str"):
        save_char_tokenizer("0123", tmp_path)
