"""rlbolt.data.tokenizers against transformers.AutoTokenizer on a tiny tokenizer built in the test."""

import json

import pytest
import transformers
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from rlbolt.data.tokenizers import CharTokenizer, HFTokenizer, IntTokenizer, Tokenizer

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

# Exercises what real templates use: namespace, loop.last, tojson (with characters jinja would
# HTML-escape), raise_exception, trim/lstrip of block lines, bos_token, and a generation block.
CHATML = """{{ bos_token }}
{% set ns = namespace(system=false) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' %}{% set ns.system = true %}{% endif %}
    {% if message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] }}{% endgeneration %}<|im_end|>
    {% else %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {% endif %}
    {% if loop.last and message.get('meta') %}{{ message['meta'] | tojson }}{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}
{% if not ns.system %}[no system]{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "Answer briefly & show <work>."},
        {"role": "user", "content": "Add 17 and 25.\nThen halve it."},
        {"role": "assistant", "content": "42, then 21."},
        {"role": "user", "content": "Why?", "meta": {"tag": "<x> & 'y'", "n": 3}},
    ],
]


def _build_backend() -> RustTokenizer:
    backend = RustTokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["What is two plus two? Add numbers and answer briefly.", "assistant user system 0123456789"] * 4
    backend.train_from_iterator(corpus, trainer=trainer)
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return backend


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    _build_backend().save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
        "pad_token": "<pad>",
        "chat_template": CHATML,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def ours(folder):
    return HFTokenizer.from_folder(folder)


@pytest.fixture(scope="module")
def theirs(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


TEXTS = ["What is 2 + 2?", "  leading spaces\nand newline", "<|im_start|>user\nhi<|im_end|>", "émoji 🙂 ok"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, theirs, text):
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    with_bos = ours.encode(text, add_special_tokens=True)
    assert with_bos == theirs.encode(text, add_special_tokens=True)
    assert with_bos[0] == ours.bos_id  # the post-processor really ran


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_transformers(ours, theirs, text):
    ids = ours.encode(text, add_special_tokens=True)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_special_ids_match_transformers(ours, theirs):
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id)
    assert ours.vocab_size == len(theirs)
    assert isinstance(ours, Tokenizer)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, theirs, conversation, add_generation_prompt):
    expected = theirs.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    rendered = ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert ('"<x> & \'y\'"' in rendered) == (len(conversation) > 1)  # tojson did not HTML-escape
    assert ours.encode(rendered) == theirs.apply_chat_template(
        conversation, tokenize=True, return_dict=False, add_generation_prompt=add_generation_prompt
    )


def test_chat_template_raise_exception(ours):
    with pytest.raises(Exception, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_jinja_file_overrides_config(folder, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ strftime_now('%Y') | length }}]{% endfor %}"
    )
    conversation = CONVERSATIONS[1][:3]
    rendered = HFTokenizer.from_folder(tmp_path).apply_chat_template(conversation)
    expected = transformers.AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected
    assert rendered.startswith("[system|Answer briefly & show <work>.|4]")


def test_missing_tokenizer_json_names_folder_and_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError) as error:
        HFTokenizer.from_folder(tmp_path)
    assert str(tmp_path) in str(error.value) and "tokenizer.json" in str(error.value)


def test_missing_chat_template_is_a_clear_error(folder, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tokenizer = HFTokenizer.from_folder(tmp_path)
    assert tokenizer.pad_id == tokenizer.eos_id == 2 and tokenizer.bos_id is None  # pad falls back to eos
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_char_tokenizer_round_trip():
    tokenizer = CharTokenizer("0123456789+= ")
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id, tokenizer.vocab_size) == (0, 1, 2, 16)
    assert tokenizer.encode("12+3") == [4, 5, 13, 6]
    assert tokenizer.decode([2, 4, 5, 13, 6, 1, 0]) == "12+3"
    assert tokenizer.decode([2, 4, 1], skip_special_tokens=False) == "<bos>1<eos>"
    with pytest.raises(ValueError, match="'x'"):
        tokenizer.encode("1x")
    with pytest.raises(ValueError, match="repeats"):
        CharTokenizer("aba")
    assert tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}]) == "1+1=\n"
    assert isinstance(tokenizer, Tokenizer)


def test_int_tokenizer_round_trip():
    tokenizer = IntTokenizer(512)
    assert (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id, tokenizer.vocab_size) == (0, 1, None, 512)
    assert tokenizer.encode(" 5 17\n511 ") == [5, 17, 511]
    assert tokenizer.decode([5, 17, 1, 0]) == "5 17"
    assert tokenizer.decode([5, 1], skip_special_tokens=False) == "5 1"
    with pytest.raises(ValueError, match="outside"):
        tokenizer.encode("512")
    with pytest.raises(ValueError, match="'a'"):
        tokenizer.encode("3 a")
    assert isinstance(tokenizer, Tokenizer)
