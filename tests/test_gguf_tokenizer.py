"""The GGUF tokenizer (models/gguf_tokenizer.py), built from a file's tokenizer.* metadata without
torch, is the one transformers builds from the same file (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`, which needs torch: the reference here): the same backend serialization (model,
merges, splitting, decoding, added tokens), class, special tokens and chat template, and the same
encodings and decodings of varied text. Checked on SmolLM2's GGUF and on files written here with
each tokenizer kind the loaded architectures use: byte-level BPE under the split regexes
'smollm' (GPT-2's), 'llama-bpe' (Llama 3) and 'qwen2', and SentencePiece BPE for Llama 2, Phi-3
and Gemma."""

import json
import os

import pytest

from ouroboros_jax.models.gguf import open_gguf
from ouroboros_jax.models.gguf_tokenizer import bytes_to_unicode, load_gguf_tokenizer

gguf = pytest.importorskip("gguf")

# text covering what splits differently: words, contractions, digit runs, code, whitespace runs
# (leading, trailing, tabs, newlines), non-ASCII letters, CJK, emoji (byte fallback), and the
# special tokens of each vocabulary written inline
TEXTS = [
    "Hello world", "the theme of the thesis", "don't I'll we've THEY'RE",
    "12345 67.89 1e10 3,141,592", "def f(x):\n    return x**2  # square\n",
    "  leading spaces\n\n\ttabs   and runs    ", "trailing space ", " ", "\n", "",
    "ünïcödé naïve café", "世界 こんにちは", "emoji 🌍🚀 done", "a\r\nb",
    "<|im_start|>user\nhi<|im_end|>\n", "<s> </s> <unk> <|begin_of_text|> <bos> <eos>",
    "<think>reason</think>", "the<|endoftext|>the",
]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "def f(self): return  the   import"}]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _reference(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                         local_files_only=True)


def assert_same_tokenizer(ours, ref, texts=TEXTS, ref_appended=()):
    """ref_appended: tokens transformers appends past the file's vocabulary (left out here, see
    test_no_token_is_added_past_the_vocabulary); texts naming them are not compared."""
    assert type(ours) is type(ref)
    mine, theirs = (json.loads(t.backend_tokenizer.to_str()) for t in (ours, ref))
    extra = [t for t in theirs["added_tokens"] if t["content"] in ref_appended]
    assert [t["content"] for t in extra] == list(ref_appended)
    theirs["added_tokens"] = [t for t in theirs["added_tokens"] if t not in extra]
    assert mine == theirs
    texts = [t for t in texts if not any(a in t for a in ref_appended)]
    assert ours.special_tokens_map == ref.special_tokens_map
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "clean_up_tokenization_spaces", "add_bos_token", "add_eos_token"):
        assert getattr(ours, attr, None) == getattr(ref, attr, None), attr
    assert ours.chat_template == ref.chat_template
    if ref.chat_template:
        texts = [*texts, ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)]
        assert (ours.apply_chat_template(CHAT, add_generation_prompt=True)
                == ref.apply_chat_template(CHAT, add_generation_prompt=True))
    for text in texts:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text,
                                                                        add_special_tokens=False)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip), (text, skip)


def test_smollm2_gguf(smollm2_gguf_path):
    """SmolLM2-135M-Instruct's own file: 49,152 byte-level tokens, 48,900 merges, 'smollm'."""
    ours = load_gguf_tokenizer(open_gguf(smollm2_gguf_path), smollm2_gguf_path)
    ref = _reference(smollm2_gguf_path)
    assert_same_tokenizer(ours, ref)
    assert ours.chat_template and "<|im_start|>" in ours.chat_template
    hi = ours("Hello world")["input_ids"]
    assert len(hi) == 2 and ours.decode(hi) == "Hello world"  # merges used, round trip


# --------------------------------------------------------------------------- written files

WORDS = ("the theme thesis def return import self print while for not and hello world don "
         "they are café naïve 12 345").split()


def _write(path, arch, keys):
    """A GGUF holding only metadata: the architecture and the tokenizer.* keys given."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, (kind, value) in keys.items():
        getattr(w, "add_" + kind)(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def byte_level_keys(pre, specials, user=(), misspelled=(), add_bos=None):
    """A byte-level BPE vocabulary as llama.cpp writes a 'gpt2' tokenizer: the 256 byte symbols,
    merges building WORDS (then each after a space, in one more merge), then CONTROL `specials`,
    USER_DEFINED `user` tokens and CONTROL tokens spelled outside the byte alphabet."""
    space = bytes_to_unicode()[ord(" ")]
    tokens = list(bytes_to_unicode().values())
    merges = []
    for word in WORDS:
        spelled = "".join(bytes_to_unicode()[b] for b in word.encode())
        cur = spelled[0]
        for ch in spelled[1:]:
            if cur + ch not in tokens:
                merges.append(f"{cur} {ch}")
                tokens.append(cur + ch)
            cur += ch
        if space + spelled not in tokens:  # the word after a space: one more merge
            merges.append(f"{space} {spelled}")
            tokens.append(space + spelled)
    n = len(tokens)
    tokens += [*specials, *user, *misspelled]
    types = ([1] * n + [3] * len(specials) + [4] * len(user) + [3] * len(misspelled))
    keys = {
        "tokenizer.ggml.model": ("string", "gpt2"),
        "tokenizer.ggml.pre": ("string", pre),
        "tokenizer.ggml.tokens": ("array", tokens),
        "tokenizer.ggml.token_type": ("array", types),
        "tokenizer.ggml.merges": ("array", merges),
        "tokenizer.ggml.bos_token_id": ("uint32", n),
        "tokenizer.ggml.eos_token_id": ("uint32", n + 1),
        "tokenizer.ggml.padding_token_id": ("uint32", n + len(specials) - 1),
        "tokenizer.chat_template": ("string", TEMPLATE),
    }
    if add_bos is not None:
        keys["tokenizer.ggml.add_bos_token"] = ("bool", add_bos)
    return keys


def spm_keys(spaces_as_spaces=False, with_merges=False):
    """A SentencePiece vocabulary as llama.cpp writes a 'llama' tokenizer: <unk> <s> </s> and the
    other controls Gemma's class names (<mask> among them, as Gemma's vocabulary has it), the 256
    byte tokens <0xNN>, '▁' and the characters of WORDS, then the pieces of WORDS ('▁'-prefixed
    and not) with falling scores; Gemma-style files write runs of spaces as spaces."""
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<bos>", "<eos>", "<mask>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    types = [2] + [3] * (len(specials) - 1) + [6] * 256
    pieces = ["▁", *sorted(set("".join(WORDS)))]
    for word in WORDS:
        for w in ("▁" + word, word):
            pieces += [w[:i] for i in range(1, len(w) + 1)]
    pieces += ["▁▁", "▁▁▁", "▁▁▁▁"]
    for p in dict.fromkeys(pieces):
        if p not in tokens:
            tokens.append(p)
            types.append(1)
    tokens += ["<think>", "</think>"]
    types += [4, 4]
    if spaces_as_spaces:
        tokens = [" " * len(t) if set(t) == {"▁"} and len(t) > 1 else t for t in tokens]
    scores = [0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in
                                                    range(len(tokens) - len(specials) - 256)]
    keys = {
        "tokenizer.ggml.model": ("string", "llama"),
        "tokenizer.ggml.tokens": ("array", tokens),
        "tokenizer.ggml.scores": ("array", scores),
        "tokenizer.ggml.token_type": ("array", types),
        "tokenizer.ggml.unknown_token_id": ("uint32", 0),
        "tokenizer.ggml.bos_token_id": ("uint32", 1),
        "tokenizer.ggml.eos_token_id": ("uint32", 2),
        "tokenizer.ggml.padding_token_id": ("uint32", 3),
        "tokenizer.chat_template": ("string", TEMPLATE),
    }
    if with_merges:
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [f"{t[:i]} {t[i:]}" for t in tokens[len(specials) + 256:]
                  for i in range(1, len(t)) if t[:i] in vocab and t[i:] in vocab]
        keys["tokenizer.ggml.merges"] = ("array", merges)
    return keys


BYTE_LEVEL = {
    # SmolLM2-like: GPT-2's regex, ChatML controls
    "llama-smollm": ("llama", lambda: byte_level_keys(
        "smollm", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), ()),
    # Llama 3: its own regex, BOS added, no <|endoftext|> in the vocabulary, a user-defined
    # token, and a control token spelled outside the byte alphabet (left out by transformers);
    # transformers appends GPT-2's <|endoftext|> past the vocabulary, we do not
    "llama-llama-bpe": ("llama", lambda: byte_level_keys(
        "llama-bpe", ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], user=["<think>"],
        misspelled=["<｜fim▁hole｜>"], add_bos=True), ("<|endoftext|>",)),
    # Qwen2/2.5 (Qwen2Tokenizer class)
    "qwen2-qwen2": ("qwen2", lambda: byte_level_keys(
        "qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], user=["<think>", "</think>"]),
        ()),
    # Qwen3 (the same vocabulary kind, its own architecture)
    "qwen3-qwen2": ("qwen3", lambda: byte_level_keys(
        "qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], user=["<think>", "</think>"]),
        ()),
    # a pre-tokenizer name without its own regex keeps GPT-2's
    "qwen2-default": ("qwen2", lambda: byte_level_keys(
        "default", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]), ()),
}


@pytest.mark.parametrize("name", list(BYTE_LEVEL))
def test_byte_level_file(tmp_path, name):
    arch, keys, appended = BYTE_LEVEL[name]
    path = _write(tmp_path / "tok.gguf", arch, keys())
    ours = load_gguf_tokenizer(open_gguf(path), path)
    assert_same_tokenizer(ours, _reference(path), ref_appended=appended)
    text = " the theme thesis"
    assert len(ours(text, add_special_tokens=False)["input_ids"]) < len(text) / 2  # merges used


SPM = {
    "llama": ("llama", lambda: spm_keys()),
    "llama-merges": ("llama", lambda: spm_keys(with_merges=True)),
    "phi3": ("phi3", lambda: spm_keys()),
    "gemma2": ("gemma2", lambda: spm_keys(spaces_as_spaces=True)),
    "gemma3": ("gemma3", lambda: spm_keys(spaces_as_spaces=True)),
}


@pytest.mark.parametrize("name", list(SPM))
def test_sentencepiece_file(tmp_path, name):
    arch, keys = SPM[name]
    path = _write(tmp_path / "tok.gguf", arch, keys())
    ours = load_gguf_tokenizer(open_gguf(path), path)
    assert_same_tokenizer(ours, _reference(path))
    assert ours.add_bos_token and ours("the")["input_ids"][0] == ours.bos_token_id
    assert len(ours("the theme", add_special_tokens=False)["input_ids"]) == 2  # pieces used


def test_no_token_is_added_past_the_vocabulary(tmp_path):
    """Where transformers' builder appends a default special token the file lacks (GPT-2's
    <|endoftext|> on a Llama 3 vocabulary: an id past the model's embedding rows), ours keeps the
    file's vocabulary: the text is split into vocabulary tokens, as llama.cpp splits it."""
    arch, keys, _ = BYTE_LEVEL["llama-llama-bpe"]
    meta = keys()
    path = _write(tmp_path / "tok.gguf", arch, meta)
    n = len(meta["tokenizer.ggml.tokens"][1])
    ours, ref = load_gguf_tokenizer(open_gguf(path), path), _reference(path)
    assert len(ours) == n and len(ref) == n + 1
    text = "the<|endoftext|>the"
    assert ref(text)["input_ids"][2] == n  # the appended id
    ids = ours(text)["input_ids"]
    assert max(ids) < n and ours.decode(ids, skip_special_tokens=True) == text


def test_split_regexes_are_transformers():
    """Every tokenizer.ggml.pre name transformers gives a split regex has the same one here (the
    table lives in transformers 5's GGUF integration; skipped where it does not)."""
    from ouroboros_jax.models.gguf_tokenizer import PRE_TOKENIZER_SPLITS

    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    assert PRE_TOKENIZER_SPLITS == mapping.GGUF_PRE_TOKENIZER_SPLITS


def test_file_without_tokenizer_gives_none(tmp_path):
    path = _write(tmp_path / "none.gguf", "llama", {})
    assert load_gguf_tokenizer(open_gguf(path), path) is None


def test_unsupported_tokenizer_model_is_named(tmp_path):
    keys = spm_keys()
    keys["tokenizer.ggml.model"] = ("string", "bert")
    path = _write(tmp_path / "bert.gguf", "llama", keys)
    with pytest.raises(ValueError, match=r"bert\.gguf.*tokenizer\.ggml\.model 'bert'"):
        load_gguf_tokenizer(open_gguf(path), path)


def test_gpt2_without_merges_is_named(tmp_path):
    keys = byte_level_keys("qwen2", ["<|endoftext|>", "<|im_start|>"])
    del keys["tokenizer.ggml.merges"]
    path = _write(tmp_path / "nomerges.gguf", "qwen2", keys)
    with pytest.raises(ValueError, match=r"nomerges\.gguf.*tokenizer\.ggml\.merges"):
        load_gguf_tokenizer(open_gguf(path), path)


def test_a_merge_of_unknown_tokens_is_refused_naming_the_file(tmp_path):
    keys = byte_level_keys("qwen2", ["<|endoftext|>", "<|im_start|>"])
    keys["tokenizer.ggml.merges"] = ("array", [*keys["tokenizer.ggml.merges"][1], "zz qq"])
    path = _write(tmp_path / "badmerge.gguf", "qwen2", keys)
    with pytest.raises(ValueError, match=r"badmerge\.gguf: the GGUF tokenizer could not be built"):
        load_gguf_tokenizer(open_gguf(path), path)


def test_special_token_id_out_of_range_is_named(tmp_path):
    keys = byte_level_keys("qwen2", ["<|endoftext|>", "<|im_start|>"])
    keys["tokenizer.ggml.eos_token_id"] = ("uint32", 10 ** 6)
    path = _write(tmp_path / "eos.gguf", "qwen2", keys)
    with pytest.raises(ValueError, match=r"eos\.gguf.*tokenizer\.ggml\.eos_token_id.*1000000"):
        load_gguf_tokenizer(open_gguf(path), path)


def test_tokenizer_imports_no_torch(smollm2_gguf_path):
    """What a `.[gguf]` venv runs: building the tokenizer imports no torch (run in a child
    process where torch cannot be imported)."""
    import subprocess
    import sys

    code = (  # a None entry makes `import torch` fail and find_spec("torch") report it absent
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from ouroboros_jax.models.gguf import open_gguf\n"
        "from ouroboros_jax.models.gguf_tokenizer import load_gguf_tokenizer\n"
        f"p = {smollm2_gguf_path!r}\n"
        "t = load_gguf_tokenizer(open_gguf(p), p)\n"
        "print(t('Hello world')['input_ids'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[-2] == "[19556, 905]"


def test_files_with_one_vocabulary_share_its_build_not_their_templates(tmp_path):
    """A draft and its target usually carry the same vocabulary, often with chat templates
    that differ (the real Qwen pair's by two bytes): the second file's tokenizer reuses the
    first's build (same backend) and carries its own template; the first keeps its own; a
    file whose vocabulary differs gets a build of its own."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    keys = byte_level_keys("qwen2", specials)
    a = _write(tmp_path / "a.gguf", "qwen2", keys)
    other = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    b = _write(tmp_path / "b.gguf", "qwen2", {**keys, "tokenizer.chat_template": ("string", other)})
    ta = load_gguf_tokenizer(open_gguf(a), a)
    tb = load_gguf_tokenizer(open_gguf(b), b)
    assert tb is not ta and tb.backend_tokenizer is ta.backend_tokenizer
    assert ta.chat_template == TEMPLATE and tb.chat_template == other
    assert tb.apply_chat_template(CHAT, tokenize=False) == "".join(m["content"] + "|" for m in CHAT)
    assert_same_tokenizer(tb, _reference(b))
    text = " the theme thesis"
    assert tb(text)["input_ids"] == ta(text)["input_ids"]
    c = _write(tmp_path / "c.gguf", "qwen2", byte_level_keys("qwen2", specials[:2]))
    tc = load_gguf_tokenizer(open_gguf(c), c)
    assert tc.backend_tokenizer is not ta.backend_tokenizer
    assert tc.convert_tokens_to_ids("<|im_end|>") != ta.convert_tokens_to_ids("<|im_end|>")


def test_the_tokenizer_class_table_is_transformers_mapping():
    """`TOKENIZER_CLASSES` (one module imported, not transformers' whole tokenizer mapping)
    names, for every model type we load, the class transformers' own mapping gives."""
    from ouroboros_jax.models.gguf_tokenizer import (TOKENIZER_CLASSES, TOKENIZER_MODEL_TYPES,
                                                     _tokenizer_class, auto_tokenizer_class)

    assert set(TOKENIZER_CLASSES) == set(TOKENIZER_MODEL_TYPES.values())
    for arch, model_type in TOKENIZER_MODEL_TYPES.items():
        assert _tokenizer_class(arch) is auto_tokenizer_class(model_type), arch
