"""gguf_tokenizer: the tokenizer rebuilt from a GGUF file's metadata encodes as the original does.

Each test trains a tiny byte-level BPE with the `tokenizers` library using a family's own
pre-tokenizer (as that family's tokenizer.json spells it), writes its tokens, merges, token
types, special ids and chat template into a GGUF file the way llama.cpp's converter does, and
compares the rebuilt tokenizer with the original on hostile text; transformers' own GGUF
tokenizer loader is a second reference where it knows the pre-tokenizer.
"""

import json

import numpy as np
import pytest
import transformers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

gguf = pytest.importorskip("gguf")

from float_tolerance import decoder_tolerance  # noqa: E402
from rlbolt.data.gguf_tokenizer import gguf_tokenizer, save_gguf_tokenizer  # noqa: E402
from rlbolt.data.tokenizers import HFTokenizer  # noqa: E402

# The split patterns as the Llama 3 and Qwen2 tokenizer.json files hold them.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
FAMILIES = {  # pre name -> (pre-tokenizer, ignore_merges)
    "llama-bpe": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3), "isolated"),
                                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), True),
    "qwen2": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2), "isolated"),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), False),
    "smollm": (lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)]), False),
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 12345 o'clock; we'll see 2024-11-25!",
    "def add(a, b):\n    return a + b  # numbers 3.14159 and 1,000,000\n",
    "Ünïcödé text, emoji 🙂🚀, 中文字符 and العربية — dashes… quotes “like this”.",
    "I'M SHOUTING, YOU'RE NOT. don't won't they've I'd\r\nline\ttab   spaces",
] * 20
HOSTILE = [
    "", " ", "   leading and trailing   ", "\n\n\r\n\t", "12345678901", "x=1+2*3/4", "I'LL don't WE'VE",
    "brown fox jumps over 🙂🚀 中文", "<|im_start|>user\nhi<|im_end|>\n", "<think>step</think> answer 42",
    "word<|im_end|>word", "unseen: zebra quokka ÆØÅ ĳ ﬁ", "\u00a0non-breaking\u2009thin",
]


def train_reference(pre: str, tmp_path) -> Tokenizer:
    """A tiny byte-level BPE with the family's pre-tokenizer, control tokens and a user-defined <think>."""
    make_pre, ignore_merges = FAMILIES[pre]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = make_pre()
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.add_tokens([AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)])
    data = json.loads(tokenizer.to_str())
    data["model"]["ignore_merges"] = ignore_merges  # as the family's tokenizer.json sets it
    return Tokenizer.from_str(json.dumps(data))


def add_tokenizer_metadata(writer, reference: Tokenizer, pre: str, *, model="gpt2", eos=True, add_bos=False):
    """The reference tokenizer as GGUF metadata (llama.cpp's converter layout); returns its tokens."""
    data = json.loads(reference.to_str())
    vocab = reference.get_vocab(with_added_tokens=True)
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [3 if t in SPECIALS else 4 if t in ("<think>", "</think>") else 1 for t in tokens]
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(vocab["<|im_start|>"])
    if eos:
        writer.add_eos_token_id(vocab["<|im_end|>"])
    writer.add_pad_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(TEMPLATE)
    return tokens


def write_tokenizer_gguf(path, reference: Tokenizer, pre: str, *, arch="llama", with_weights=False, **options):
    """A GGUF file holding the reference tokenizer (and, with_weights, a model stub transformers needs)."""
    writer = gguf.GGUFWriter(str(path), arch)
    tokens = add_tokenizer_metadata(writer, reference, pre, **options)
    if with_weights:  # transformers' loader reads the model's hyper-parameters too
        writer.add_block_count(1)
        writer.add_context_length(64)
        writer.add_embedding_length(32)
        writer.add_feed_forward_length(32)
        writer.add_head_count(2)
        writer.add_head_count_kv(2)
        writer.add_rope_freq_base(10000.0)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tokens


@pytest.mark.parametrize("pre", sorted(FAMILIES))
def test_rebuilt_tokenizer_encodes_as_the_original(tmp_path, pre):
    reference = train_reference(pre, tmp_path)
    tokens = write_tokenizer_gguf(tmp_path / "t.gguf", reference, pre)
    ours = gguf_tokenizer(tmp_path / "t.gguf")
    assert ours.vocab_size == len(tokens) == reference.get_vocab_size(with_added_tokens=True)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (1, 2, 0)
    for text in HOSTILE + CORPUS[:4]:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == expected, text
        assert ours.decode(expected, skip_special_tokens=False) == text
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ours.decode(ids) == "user\nhi"  # control tokens whole, dropped on decode
    assert len(ours.encode("<think>")) == 1 and ours.decode(ours.encode("<think>")) == "<think>"  # user-defined: kept


def test_pre_tokenizer_matters(tmp_path):
    """The digits split is what tells the families apart: a wrong pre name would encode 2024 otherwise."""
    reference = train_reference("smollm", tmp_path)
    write_tokenizer_gguf(tmp_path / "t.gguf", reference, "smollm")
    assert len(gguf_tokenizer(tmp_path / "t.gguf").encode("2024")) == 4
    reference = train_reference("llama-bpe", tmp_path)
    write_tokenizer_gguf(tmp_path / "l.gguf", reference, "llama-bpe")
    assert len(gguf_tokenizer(tmp_path / "l.gguf").encode("2024")) < 4  # {1,3} digit groups, merged


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_same_ids_as_transformers_gguf_tokenizer(tmp_path, pre):
    reference = train_reference(pre, tmp_path)
    write_tokenizer_gguf(tmp_path / "t.gguf", reference, pre, arch="qwen2" if pre == "qwen2" else "llama",
                         with_weights=True)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    ours = gguf_tokenizer(tmp_path / "t.gguf")
    for text in HOSTILE:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text


def test_chat_template_bos_and_saved_folder(tmp_path):
    reference = train_reference("qwen2", tmp_path)
    write_tokenizer_gguf(tmp_path / "t.gguf", reference, "qwen2", add_bos=True)
    ours = gguf_tokenizer(tmp_path / "t.gguf")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    prompt = ours.apply_chat_template(messages)
    assert prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert ours.encode("hi", add_special_tokens=True)[0] == ours.bos_id
    assert ours.encode("hi", add_special_tokens=True)[1:] == ours.encode("hi")
    folder = save_gguf_tokenizer(tmp_path / "t.gguf", tmp_path / "export")
    again = HFTokenizer.from_folder(folder)
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    assert again.apply_chat_template(messages) == prompt
    assert auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    for text in HOSTILE:
        assert again.encode(text) == ours.encode(text) == auto.encode(text, add_special_tokens=False), text
    assert (again.eos_id, again.pad_id, again.bos_id) == (ours.eos_id, ours.pad_id, ours.bos_id)


def test_tokenizers_it_cannot_rebuild_are_refused(tmp_path):
    reference = train_reference("qwen2", tmp_path)
    write_tokenizer_gguf(tmp_path / "sp.gguf", reference, "qwen2", model="llama")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model='llama' is not supported.*model.tokenizer"):
        gguf_tokenizer(tmp_path / "sp.gguf")
    write_tokenizer_gguf(tmp_path / "pre.gguf", reference, "mystery-pre")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='mystery-pre' is not a pre-tokenizer rlbolt knows"):
        gguf_tokenizer(tmp_path / "pre.gguf")
    write_tokenizer_gguf(tmp_path / "eos.gguf", reference, "qwen2", eos=False)
    with pytest.raises(ValueError, match="eos_token_id is missing"):
        gguf_tokenizer(tmp_path / "eos.gguf")


def test_load_gguf_then_export_writes_a_normal_hf_folder(tmp_path):
    """load_gguf gives (model, tokenizer); what `rlbolt export` would write from them (save_hf with
    the tokenizer folder of save_gguf_tokenizer) loads in transformers with the same logits and ids."""
    import torch
    from models.test_gguf import build_family_model, write_gguf

    from rlbolt.models.gguf_io import load_gguf
    from rlbolt.models.hf_io import save_hf

    reference = train_reference("qwen2", tmp_path)
    vocab = reference.get_vocab_size(with_added_tokens=True)
    hf_model = build_family_model("qwen2_bias", vocab_size=vocab)
    write_gguf(tmp_path / "m.gguf", "qwen2_bias", hf_model, gguf.GGMLQuantizationType.Q8_0,
               add_tokenizer=lambda writer: add_tokenizer_metadata(writer, reference, "qwen2"))
    model, tokenizer = load_gguf(tmp_path / "m.gguf")
    assert tokenizer.vocab_size == model.config.vocab_size == vocab
    save_hf(model, model.config, tmp_path / "export",
            tokenizer_folder=save_gguf_tokenizer(tmp_path / "m.gguf", tmp_path / "tokenizer"))

    auto_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    auto_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is 2+3? Answer in <think>one</think> line."}]
    prompt = tokenizer.apply_chat_template(messages)
    assert auto_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
    ids = tokenizer.encode(prompt)
    assert auto_tokenizer.encode(prompt, add_special_tokens=False) == ids
    with torch.no_grad():
        theirs = auto_model(input_ids=torch.tensor([ids])).logits.float().numpy()
    ours, _ = model(np.asarray([ids], np.int32), np.arange(len(ids), dtype=np.int32)[None],
                    attention_mask=np.ones((1, len(ids)), bool))
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=decoder_tolerance(theirs, model.config, len(ids)), rtol=0)
