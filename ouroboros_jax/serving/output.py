"""A request's text as its tokens arrive: incremental detokenization and stop strings.

Each step gives a request a few new tokens. Decoding its whole token list again to find the
new text costs O(n) per step, O(n^2) per request; here a step decodes only a short window (the
tokens since the last text was emitted, plus the ones before them as context), so the work per
step is proportional to the new tokens (vLLM's `v1/engine/detokenizer.py` does the same).

Why a window and not the new tokens alone: a token's text can depend on its left neighbour
(SentencePiece drops the leading space of a sequence's first word; byte-level BPE splits one
UTF-8 character over several tokens), so the new text is decode(context + new) minus
decode(context). Text that ends in an unfinished UTF-8 character ("\\ufffd") is held back until
the character completes.

Stop strings are matched on that text as it streams: what could still become the start of a
stop string (its length - 1 characters) is held back, so the search over each step's text is
proportional to that text, and the output is cut before the earliest match.
"""

from __future__ import annotations

from typing import Optional, Sequence

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not (yet) a whole character


def decoder(tokenizer):
    """ids -> text, as tokenizer.decode(ids, skip_special_tokens=True) gives it. For a fast
    tokenizer that cleans up no spaces, its Rust backend's decode, called directly: the same
    text without transformers' per-call conversions (measured: 6x less host time per decode,
    the larger part of a busy engine's host work per step)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """A token stream -> its text, piece by piece: the pieces joined equal
    tokenizer.decode(all tokens, skip_special_tokens=True) (tests/test_serving_units.py)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._decode = decoder(tokenizer)
        self.ids: list = []
        self.prefix = 0  # ids[prefix:read]: context already emitted, decoded for its effect
        self.read = 0  # ids[read:]: tokens whose text has not been emitted yet

    def _pending(self) -> tuple[str, str]:
        """(text of the context window, text of the window and the pending tokens)."""
        return self._decode(self.ids[self.prefix:self.read]), self._decode(self.ids[self.prefix:])

    def push(self, new: Sequence[int]) -> str:
        """The text new tokens complete ("" while a character is unfinished)."""
        self.ids.extend(new)
        before, after = self._pending()
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """At the end: the text still held back (an unfinished character decodes as a full
        decode shows it)."""
        before, after = self._pending()
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


class StopMatcher:
    """Text pieces -> the same text, cut before the earliest stop string. `feed` returns what
    may be sent now; what could still be the start of a stop string is held back."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.hold = max((len(s) - 1 for s in self.stops), default=0)
        self.held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """The text to send for this piece; sets `stopped` at a match (nothing after it)."""
        if self.stopped:
            return ""
        buf = self.held + piece
        hits = [j for j in (buf.find(s) for s in self.stops) if j >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buf[:min(hits)]
        keep = min(self.hold, len(buf))
        self.held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end (no stop string came): the text held back."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out


class TextStream:
    """One request's output text: tokens in, (text to send, stop string hit) out; `text` is
    everything sent. Without a tokenizer there is no text (every piece is "")."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.detok = None if tokenizer is None else Detokenizer(tokenizer)
        self.stop = StopMatcher(stops)
        self.parts: list = []
        self.closed = False

    def push(self, new: Sequence[int]) -> tuple[str, bool]:
        """-> (text for these tokens, whether a stop string ended the output)."""
        if self.detok is None:
            return "", False
        piece = self.stop.feed(self.detok.push(new))
        self.parts.append(piece)
        return piece, self.stop.stopped

    def close(self) -> tuple[str, bool]:
        """At the end: (the text held back, whether a stop string ended the output)."""
        self.closed = True
        if self.detok is None:
            return "", False
        piece = self.stop.feed(self.detok.flush())
        if not self.stop.stopped:
            piece += self.stop.flush()
        self.parts.append(piece)
        return piece, self.stop.stopped

    @property
    def text(self) -> Optional[str]:
        return None if self.detok is None else "".join(self.parts)
