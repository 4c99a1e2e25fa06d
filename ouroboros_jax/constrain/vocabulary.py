"""A tokenizer's tokens as the bytes they decode to: the alphabet the automaton reads.

Byte-level BPE (GPT-2's alphabet: SmolLM2, Qwen2.5, Llama 3) spells each byte as a printable
character ('Ġ' for a space); SentencePiece-style vocabularies spell a space '▁' and keep
unprintable bytes as '<0xNN>' tokens; word-level and character vocabularies spell text as it is.
Each is mapped back to its bytes here, so a token's column in the automaton is what it adds to
the output text. Special and added tokens (chat markers, EOS) are left out: the automaton never
allows them, except the EOS ids, which `table.py` allows in accepting states.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def byte_decoder() -> dict:
    """GPT-2's printable character -> the byte it spells (the inverse of bytes_to_unicode)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer spells tokens in GPT-2's byte alphabet (its decoder is ByteLevel)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    dec = getattr(backend, "decoder", None)
    return dec is not None and "ByteLevel" in type(dec).__name__ + repr(dec)[:200]


def special_ids(tokenizer) -> set:
    """Ids of special and added tokens (never text in the output)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i in added)
    return ids


def token_bytes(tokenizer, vocab_size: int) -> list[Optional[bytes]]:
    """[V]: each id's bytes, or None for ids that are not text (special, added, past the
    tokenizer's vocabulary, empty)."""
    skip = special_ids(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    byte_level = is_byte_level(tokenizer)
    dec = byte_decoder()
    out: list[Optional[bytes]] = [None] * vocab_size
    for i, piece in enumerate(pieces):
        if i in skip or not piece:
            continue
        if byte_level:
            try:
                b = bytes(dec[c] for c in piece)
            except KeyError:  # not in the byte alphabet: a plain string token
                b = piece.encode("utf-8")
        else:
            m = _BYTE_TOKEN.match(piece)
            b = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        out[i] = b or None
    return out


def vocabulary_map(tokenizer, vocab_size: int) -> dict:
    """{token bytes: [ids]} of every text token: outlines-core's `Vocabulary` map."""
    vocab: dict = {}
    for i, b in enumerate(token_bytes(tokenizer, vocab_size)):
        if b is not None:
            vocab.setdefault(b, []).append(i)
    return vocab
