"""A GGUF file's tokenizer, built from its `tokenizer.*` metadata with the `tokenizers` library.

Why not `AutoTokenizer.from_pretrained(dir, gguf_file=...)`: transformers reads the metadata with
a reader that imports torch, so a `pip install ".[gguf]"` venv (no torch: a plain torch
requirement pulls a multi-GB CUDA build) could not tokenize, and its config read walks the
150k-token vocabulary element by element (~15 CPU-seconds for Qwen2.5). Here the metadata comes
from our own reader (`gguf_read.GGUFFile`, strings decoded once) and the backend is assembled
piece by piece as transformers assembles it, so the two give the same tokenizer:
`tests/test_gguf_tokenizer.py` compares the backends' serializations, the encodings and the
decodings with AutoTokenizer's on SmolLM2's GGUF and on written files of each kind below.

The kinds (`tokenizer.ggml.model`):
- "gpt2": byte-level BPE (SmolLM2, Llama 3, Qwen2/2.5/3). The file spells tokens in GPT-2's byte
  alphabet and lists the merges; `tokenizer.ggml.pre` names the split regex the merges were
  learned with (`PRE_TOKENIZER_SPLITS`; others keep GPT-2's own).
- "llama": SentencePiece-style BPE with byte fallback (Llama 2, TinyLlama, Phi-3, Gemma 2/3). The
  file lists each token's score; without merges they are rebuilt from the vocabulary, best score
  first. Phi-3 and Gemma spell spaces their own way (`_phi3_backend`, `_gemma_backend`).
Any other kind is refused by name.

One difference from transformers, on purpose: its byte-level builder (GPT2Tokenizer) adds GPT-2's
`<|endoftext|>` as a special token, appended past the vocabulary when the file lacks it (Llama 3):
an id with no embedding row. Here the file's vocabulary is the whole vocabulary, and that text
is split into vocabulary tokens, as llama.cpp splits it.
"""

from __future__ import annotations

import copy
import threading
import weakref
from typing import Any, Callable, NamedTuple, Optional

# GGUF architecture -> the transformers model type whose tokenizer class AutoTokenizer picks for
# the file (checked against AutoTokenizer in tests/test_gguf_tokenizer.py)
TOKENIZER_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
                         "gemma2": "gemma2", "gemma3": "gemma3"}

# llama.cpp's token types (tokenizer.ggml.token_type)
CONTROL, USER_DEFINED = 3, 4

# tokenizer.ggml.pre -> the split regex its merges were learned with, as transformers maps them
# (integrations/gguf/gguf_tokenizer_mapping.py, compared in tests/test_gguf_tokenizer.py); a name
# not here keeps GPT-2's regex
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral",
                     "midm-2.0", "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

# special-token role -> the metadata key of its id
SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


# digest of a file's tokenizer metadata but its chat template -> the tokenizer built from it,
# while a model holds it: a draft and its target usually carry the same vocabulary and merges
# (the real Qwen pair's 151,936 tokens; their chat templates differ by two bytes), and building
# the second costs ~1.5 s of a CLI call on this CPU.
_BUILT: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
CHAT_TEMPLATE = "tokenizer.chat_template"
_BUILDING = threading.Lock()


def load_gguf_tokenizer(reader, path: str):
    """The file's tokenizer as a transformers fast tokenizer (chat template included), or None
    when the file carries no tokenizer. Needs `tokenizers` and `transformers`, not torch.
    ValueError naming the file and the key when the metadata does not describe one.

    Files whose tokenizer metadata (every `tokenizer.*` entry and the architecture) is byte
    for byte the same but for the chat template share one built tokenizer: the second gets a
    shallow copy (the same vocabulary and backend) carrying its own file's chat template."""
    if not hasattr(reader, "digest"):
        return _build_tokenizer(reader, path)
    keys = {k for k in reader.fields if k.startswith("tokenizer.") and k != CHAT_TEMPLATE}
    digest = reader.digest(keys | {"general.architecture"})
    with _BUILDING:  # a target and its draft load at once (`loading.load_both`): one builds
        built = _BUILT.get(digest)
        if built is None:
            tok = _build_tokenizer(reader, path)
            if tok is not None:
                _BUILT[digest] = tok
            return tok
    tok = copy.copy(built)
    field = reader.fields.get(CHAT_TEMPLATE)
    tok.chat_template = None if field is None else field.contents()
    return tok


def _build_tokenizer(reader, path: str):
    meta = tokenizer_metadata(reader)
    if "tokenizer.ggml.model" not in meta:
        return None
    arch = _string(reader, "general.architecture")
    try:
        backend = build_backend(meta, arch, path)
        kwargs = wrapper_kwargs(meta, path)
        backend.post_processor = _bos_eos_template(kwargs, backend)
        cls = _tokenizer_class(arch)
        return cls(tokenizer_object=backend, **kwargs)
    except Exception as e:  # tokenizers/transformers raise many types, none naming the file
        if isinstance(e, ValueError) and str(e).startswith(f"{path}: "):
            raise  # ours, naming the key
        raise ValueError(f"{path}: the GGUF tokenizer could not be built "
                         f"({type(e).__name__}: {e})") from None


def tokenizer_metadata(reader) -> dict[str, Any]:
    """Every `tokenizer.*` key of the file -> its value (lists for arrays)."""
    return {key: field.contents() for key, field in reader.fields.items()
            if key.startswith("tokenizer.")}


def _string(reader, key: str) -> Optional[str]:
    field = reader.get_field(key)
    return None if field is None else field.contents()


def build_backend(meta: dict, arch: Optional[str], path: str):
    """The `tokenizers.Tokenizer` the metadata describes: model, splitting and decoding by
    `tokenizer.ggml.model`, then the file's control and user-defined tokens added whole."""
    kind = _kind(meta, path)
    tokens = _tokens(meta, path)
    backend = kind.build(meta, tokens, path, arch)
    _add_file_special_tokens(backend, meta, tokens, byte_level=kind.byte_level)
    return backend


def _kind(meta: dict, path: str) -> TokenizerKind:
    name = meta["tokenizer.ggml.model"]
    if name not in TOKENIZER_KINDS:
        raise ValueError(f"{path}: tokenizer.ggml.model {name!r} is not supported (supported: "
                         + ", ".join(f"{k!r} {v.what}" for k, v in TOKENIZER_KINDS.items()) + ")")
    return TOKENIZER_KINDS[name]


def _tokens(meta: dict, path: str) -> list[str]:
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path}: GGUF metadata lacks 'tokenizer.ggml.tokens' (the vocabulary)")
    return tokens


def _merges(meta: dict, path: str) -> Optional[list[tuple[str, str]]]:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        return None
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs) if len(p) != 2), None)
    if bad is not None:
        raise ValueError(f"{path}: tokenizer.ggml.merges holds {bad!r}, not two tokens "
                         "separated by one space")
    return pairs


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves,
    the other 68 bytes for the characters from U+0100 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(table.items()))


def _byte_level_backend(meta: dict, tokens: list[str], path: str, arch: Optional[str] = None):
    """Byte-level BPE. A token written outside the byte alphabet (a converter's slip, seen on
    some control tokens) is respelled byte by byte, as transformers does."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    merges = _merges(meta, path)
    if merges is None:
        raise ValueError(f"{path}: GGUF metadata lacks 'tokenizer.ggml.merges' (a 'gpt2' "
                         "tokenizer needs its merges)")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # split as the merges were learned, then map bytes to the alphabet
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a token into two vocabulary
    tokens, ordered by the token's score (best first), ties by the shorter left piece then the
    shorter right piece; splits of one token in the vocabulary order of their pieces. This is
    transformers' `generate_merges`, whose order the reference tokenizer's merges have."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _spm_merges(meta: dict, tokens: list[str], vocab: dict[str, int], path: str,
                scores: Optional[dict] = None) -> list[tuple[str, str]]:
    merges = _merges(meta, path)
    if merges is not None:
        return merges
    if scores is None:
        file_scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(file_scores, list) or len(file_scores) != len(tokens):
            raise ValueError(f"{path}: a 'llama' tokenizer without tokenizer.ggml.merges needs "
                             "tokenizer.ggml.scores, one per token")
        scores = dict(zip(tokens, file_scores))
    return generate_merges(vocab, scores)


def _sentencepiece_backend(meta: dict, tokens: list[str], path: str, arch: Optional[str]):
    """SentencePiece BPE, spelled as the architecture's files spell it (`SENTENCEPIECE_VARIANTS`,
    else Llama's)."""
    return SENTENCEPIECE_VARIANTS.get(arch, _spm_backend)(meta, tokens, path)


def _spm_backend(meta: dict, tokens: list[str], path: str):
    """SentencePiece BPE as transformers' LlamaTokenizer builds it: byte fallback, '▁' for a space
    and one prepended to the text's start, stripped again when decoding."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _spm_merges(meta, tokens, vocab, path)
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                            dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                     split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return backend


def _phi3_backend(meta: dict, tokens: list[str], path: str):
    """Phi-3: SentencePiece, but '▁' prepended and spaces replaced by a normalizer, with no
    pre-tokenizer (Phi-3's tokenizer.json; it differs from Metaspace on text starting with a
    space)."""
    from tokenizers import normalizers

    backend = _spm_backend(meta, tokens, path)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(prepend="▁"),
                                               normalizers.Replace(pattern=" ", content="▁")])
    backend.pre_tokenizer = None
    return backend


def _gemma_backend(meta: dict, tokens: list[str], path: str):
    """Gemma: tokens of two or more spaces are stored as spaces and looked up as '▁'s; the file
    lists no merges, and Gemma's scores do not follow its merge order, the vocabulary order does.
    Spaces become '▁' in a normalizer, nothing is prepended, the text splits after each space."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    spelled = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    order = {t: -i for i, t in enumerate(spelled)}
    merges = _spm_merges(meta, spelled, vocab, path, scores=order)
    unk = _unk_token(meta, tokens) or "<unk>"
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk,
                            dropout=None, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous",
                                                 invert=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
    backend.normalizer = normalizers.Replace(" ", "▁")
    return backend


class TokenizerKind(NamedTuple):
    """One value of tokenizer.ggml.model: how its backend is built, whether its vocabulary is
    spelled in GPT-2's byte alphabet, whether llama.cpp adds BOS when the file does not say."""

    what: str
    build: Callable
    byte_level: bool
    adds_bos: bool


# tokenizer.ggml.model -> its kind. The names are llama.cpp's: "llama" is its SentencePiece
# vocabulary, whatever the model (Phi-3's and Gemma's files say "llama" too).
TOKENIZER_KINDS = {
    "gpt2": TokenizerKind("byte-level BPE", _byte_level_backend, byte_level=True,
                          adds_bos=False),
    "llama": TokenizerKind("SentencePiece BPE", _sentencepiece_backend, byte_level=False,
                           adds_bos=True),
}

# GGUF architecture -> its files' SentencePiece spelling, where not Llama's (transformers keys
# these by architecture too: nothing in a file says which a model wants)
SENTENCEPIECE_VARIANTS = {"phi3": _phi3_backend, "gemma2": _gemma_backend,
                          "gemma3": _gemma_backend}


def _unk_token(meta: dict, tokens: list[str]) -> Optional[str]:
    i = meta.get("tokenizer.ggml.unknown_token_id")
    return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None


def _add_file_special_tokens(backend, meta: dict, tokens: list[str], byte_level: bool) -> None:
    """The tokens the file marks CONTROL (like <|im_end|>) become special added tokens and the
    USER_DEFINED ones (like <think>) plain added tokens, so that both are matched whole in text,
    as llama.cpp matches them. In a byte-level vocabulary a CONTROL token written outside the
    byte alphabet is a converter's mislabel; adding it would grow the vocabulary, so it is
    skipped (as transformers skips it)."""
    from tokenizers import AddedToken

    types = meta.get("tokenizer.ggml.token_type") or []
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, types)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab]
    if user:
        backend.add_tokens(user)


def wrapper_kwargs(meta: dict, path: str) -> dict:
    """The transformers tokenizer's arguments the metadata gives: the special tokens by id, the
    chat template, and whether to add BOS/EOS (a SentencePiece vocabulary adds BOS unless the
    file says otherwise, as llama.cpp does)."""
    tokens = meta["tokenizer.ggml.tokens"]
    kwargs: dict[str, Any] = {"clean_up_tokenization_spaces": False}
    if "tokenizer.chat_template" in meta:
        kwargs["chat_template"] = meta["tokenizer.chat_template"]
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in meta:
            kwargs[flag] = bool(meta[f"tokenizer.ggml.{flag}"])
    if _kind(meta, path).adds_bos:
        kwargs.setdefault("add_bos_token", True)
    for role, key in SPECIAL_TOKEN_KEYS.items():
        i = meta.get(key)
        if i is not None and not (isinstance(i, int) and 0 <= i < len(tokens)):
            raise ValueError(f"{path}: GGUF key {key!r} must be a token id below the vocabulary "
                             f"size {len(tokens)}, got {i!r}")
        kwargs[role] = None if i is None else tokens[i]
    return kwargs


def _bos_eos_template(kwargs: dict, backend):
    """The post-processor adding BOS and/or EOS around a sequence as the flags ask (set here so
    that every transformers version gets it, not only those that read add_bos_token)."""
    from tokenizers import processors

    bos, eos = kwargs.get("bos_token"), kwargs.get("eos_token")
    add_bos = bool(kwargs.get("add_bos_token")) and bos is not None
    add_eos = bool(kwargs.get("add_eos_token")) and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    second = f"{bos + ':1 ' if add_bos else ''}$B:1{' ' + eos + ':1' if add_eos else ''}"
    pair = f"{single} {second}"
    used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[
        (t, backend.token_to_id(t)) for t in dict.fromkeys(used)])


# model type -> (module, class) AutoTokenizer gives it in transformers 5 (`auto_tokenizer_class`,
# compared in tests/test_gguf_tokenizer.py): importing that one module takes ~0.3 s, where
# transformers' tokenizer mapping imports every tokenizer module it names (~1.3 s a process)
TOKENIZER_CLASSES = {
    "llama": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "qwen2": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
    "qwen3": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
    "phi3": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "gemma2": ("transformers.models.gemma.tokenization_gemma", "GemmaTokenizer"),
    "gemma3": ("transformers.models.gemma.tokenization_gemma", "GemmaTokenizer"),
}


def _tokenizer_class(arch: Optional[str]):
    """The class AutoTokenizer gives a file of this architecture (`TOKENIZER_CLASSES`, else
    `auto_tokenizer_class`), else transformers' PreTrainedTokenizerFast. Chosen from the
    architecture alone: asking AutoTokenizer would read the file again, with a reader that
    imports torch."""
    import importlib

    model_type = TOKENIZER_MODEL_TYPES.get(arch)
    if model_type in TOKENIZER_CLASSES:
        module, name = TOKENIZER_CLASSES[model_type]
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # another transformers: ask its mapping
            pass
    return auto_tokenizer_class(model_type)


def auto_tokenizer_class(model_type: Optional[str]):
    """transformers' own answer (5: `TOKENIZER_MAPPING.get(config class, TokenizersBackend)`
    for a config with no tokenizer class; 4, or no model type: PreTrainedTokenizerFast)."""
    from transformers import PreTrainedTokenizerFast

    if model_type is None:
        return PreTrainedTokenizerFast
    try:
        from transformers import AutoConfig, TokenizersBackend
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    except ImportError:  # transformers 4
        return PreTrainedTokenizerFast
    return TOKENIZER_MAPPING.get(type(AutoConfig.for_model(model_type)), TokenizersBackend)
