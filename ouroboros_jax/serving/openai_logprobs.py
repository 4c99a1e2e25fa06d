"""OpenAI's logprob objects from the engine's per-token logprobs (`Delta.logprobs`,
`RequestResult.logprobs`: per token (logprob, [(token id, logprob), ...the top ones])).

- chat: `choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs":
  [{"token", "logprob", "bytes"}]}], "refusal": None}`;
- completions: `choices[i].logprobs = {"tokens", "token_logprobs", "top_logprobs": [{token:
  logprob}], "text_offset"}`, text_offset counting the characters of the tokens before each
  one (streamed: continuing from the chunks before, `CompletionOffsets`).

A token's string is its own decoded text (`tokenizer.decode([id])`; "token_id:ID" without a
tokenizer); `bytes` its UTF-8 bytes. The values are the engine's: the processed distribution of a
sampled request, the temperature-1 softmax of a greedy one (`decoding/logprobs.py`). A top token
outside a sampled request's top-k / top-p set has probability 0; JSON has no -inf, so it is
reported as -9999.0, as OpenAI's API and vLLM do.
"""

from __future__ import annotations

import math
from typing import Optional

FLOOR = -9999.0  # what a log-probability of -inf is reported as


def token_text(tokenizer, token_id: int) -> str:
    """One token's string as logprob objects name it."""
    if tokenizer is None:
        return f"token_id:{int(token_id)}"
    return tokenizer.decode([int(token_id)])


def value(lp: float) -> float:
    """A log-probability as JSON can carry it (-inf -> FLOOR)."""
    return lp if math.isfinite(lp) else FLOOR


def _entry(tokenizer, token_id: int, lp: float) -> dict:
    tok = token_text(tokenizer, token_id)
    return {"token": tok, "logprob": value(lp), "bytes": list(tok.encode("utf-8"))}


def chat_logprobs(tokenizer, ids: list, lps: Optional[list]) -> Optional[dict]:
    """A chat choice's (or chunk's) logprobs object for tokens ids; None without lps."""
    if lps is None:
        return None
    content = [dict(_entry(tokenizer, t, lp), top_logprobs=[_entry(tokenizer, i, v)
                                                            for i, v in top])
               for t, (lp, top) in zip(ids, lps)]
    return {"content": content, "refusal": None}


class CompletionOffsets:
    """A completions choice's logprobs objects, chunk by chunk: text_offset goes on from the
    characters of the tokens before."""

    def __init__(self, tokenizer):
        self.tokenizer, self.offset = tokenizer, 0

    def logprobs(self, ids: list, lps: Optional[list]) -> Optional[dict]:
        """The logprobs object of the next tokens ids; None without lps."""
        if lps is None:
            return None
        toks = [token_text(self.tokenizer, t) for t in ids]
        offsets = []
        for tok in toks:
            offsets.append(self.offset)
            self.offset += len(tok)
        tops = [{token_text(self.tokenizer, i): value(v) for i, v in top} for _, top in lps]
        return {"tokens": toks, "token_logprobs": [value(lp) for lp, _ in lps],
                "top_logprobs": tops, "text_offset": offsets}


def logprobs_of(tokenizer, chat: bool, ids: list, lps: Optional[list]) -> Optional[dict]:
    """The logprobs object of a whole choice (non-streamed)."""
    if chat:
        return chat_logprobs(tokenizer, ids, lps)
    return CompletionOffsets(tokenizer).logprobs(ids, lps)
