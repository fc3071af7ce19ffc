"""A `CharTokenizer` written as Hugging Face tokenizer files, so a model trained with one (the demo's)
can be exported as a folder any `HFTokenizer` (or transformers' `AutoTokenizer`) reads back with
the same ids.

    save_char_tokenizer(CharTokenizer("0123456789="), folder)   tokenizer.json + tokenizer_config.json
    HFTokenizer.from_folder(folder).encode("31=") == CharTokenizer("0123456789=").encode("31=")

The vocabulary is the CharTokenizer's: `<pad>` 0, `<eos>` 1, `<bos>` 2 (special tokens), then
the alphabet in order. The model is a byte-pair model with no merges, so every character is its
own token, and no normaliser or pre-tokeniser changes the text (spaces included). One difference:
text that spells a special token ("<eos>") encodes as that token here, as five characters in the
CharTokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlbolt.data.tokenizers import CharTokenizer

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>")  # ids 0, 1, 2, as CharTokenizer numbers them


def save_char_tokenizer(tokenizer: CharTokenizer, folder: str | Path) -> Path:
    """Writes `tokenizer.json` and `tokenizer_config.json` for `tokenizer` into `folder`.

    Args:
        tokenizer: the character tokenizer.
        folder: created if missing; existing tokenizer files are replaced.

    Returns:
        The folder.

    Raises:
        TypeError: `tokenizer` is not a CharTokenizer.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    if not isinstance(tokenizer, CharTokenizer):
        raise TypeError(f"save_char_tokenizer(tokenizer=...) takes a CharTokenizer, got {type(tokenizer).__name__}")
    # Specials are several characters and alphabet entries one, so the names never collide.
    vocab = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    vocab.update({char: len(SPECIAL_TOKENS) + i for i, char in enumerate(tokenizer.alphabet)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "<eos>",
              "bos_token": "<bos>", "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder
