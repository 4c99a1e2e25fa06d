"""Byte-level BPE: exact round trip on Python text, special ids, transformers loading."""

import pytest

from ouroboros_jax.training import tokenizer as T

TEXTS = [
    'def add(a, b):\n    """Return a + b."""\n    return a + b\n',
    "class Foo:\n\tdef __init__(self):\n\t\tself.x = {'k': [1, 2, 3]}  # tabs\n",
    "import os\n\nfor i in range(10):\n    print(f'{i:>4d}', os.sep)\n" * 3,
    "s = 'naïve café'  # comment with ünïcödé\nπ = 3.14159\n",
]
SAMPLES = [
    'def héllo(wörld="日本語"):\n    """Docstring with emoji 🐍 and ∑ symbols."""\n    return wörld * 2\n',
    "\r\n\t  trailing spaces   \n\n\n",
    "x = '\\u00e9'  # escaped, and a real é\n",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = T.train_tokenizer(TEXTS * 4, vocab_size=300)
    T.save_hf_tokenizer(tok, d)
    return d


def test_special_token_ids(tok_dir):
    tok = T.load_tokenizer(tok_dir)
    assert [tok.token_to_id(t) for t in (T.PAD, T.BOS, T.EOS)] == [0, 1, 2]
    assert tok.encode("x = 1").ids[0] == T.BOS_ID
    assert tok.encode("x = 1", add_special_tokens=False).ids[0] != T.BOS_ID


@pytest.mark.parametrize("text", SAMPLES + TEXTS)
def test_round_trip_raw(tok_dir, text):
    tok = T.load_tokenizer(tok_dir)
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


def test_transformers_auto_tokenizer(tok_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    raw = T.load_tokenizer(tok_dir)
    for text in SAMPLES + TEXTS:
        ids = hf(text)["input_ids"]
        assert ids == raw.encode(text).ids
        assert hf.decode(ids, skip_special_tokens=True) == text
