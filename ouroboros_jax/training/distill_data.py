"""The distiller's data (`ouroboros-jax distill`, training/distill.py): the user's texts read and
split into training and held-out files, encoded into one token stream; prompts cut from it in
chunks that depend only on (seed, chunk), so a resumed run sees the same data; the rows a step
trains on (prompt + the target's continuation, and plain corpus windows)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from ouroboros_jax.training import corpus
from ouroboros_jax.training.report import heldout_prompts

HELDOUT_SHARE = 0.02


# ------------------------------------------------------------------------------------ data
def read_texts(data: str | Path, glob: str) -> tuple[list[str], list[str]]:
    """(train texts, held-out texts) of a directory (files matching `glob`, recursively), a .jsonl
    file (one {"text": ...} per line) or a plain text file (one document). About 2% of documents
    are held out, chosen by a hash of their name (path or line number), so the split is stable."""
    p = Path(data)
    if p.is_dir():
        items = [(str(f.relative_to(p)), f.read_text(errors="replace"))
                 for f in sorted(p.rglob(glob)) if f.is_file()]
    elif p.is_file() and p.suffix == ".jsonl":
        items = []
        for i, line in enumerate(p.read_text().splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                items.append((f"line{i}", rec["text"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--data {p}: line {i + 1} is not a JSON object with a 'text' field") from None
    elif p.is_file():
        items = [(p.name, p.read_text(errors="replace"))]
    else:
        raise ValueError(f"--data {p}: no such file or directory")
    items = [(n, t) for n, t in items if t.strip()]
    if not items:
        raise ValueError(f"--data {p}: no non-empty documents (glob {glob!r})")
    held = [t for n, t in items if _held_out(n)]
    train = [t for n, t in items if not _held_out(n)]
    if not train:
        train, held = held, []
    return train, held


def _held_out(name: str) -> bool:
    h = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < HELDOUT_SHARE


def encode_documents(tokenizer, texts: list[str], bos: int | None, eos: int | None) -> np.ndarray:
    """One int32 stream of `[bos] tokens [eos]` per document, in order."""
    parts = []
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    for row in ids:
        parts.append(np.asarray(([bos] if bos is not None else []) + list(row) + ([eos] if eos is not None else []),
                                np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


@dataclasses.dataclass
class Sources:
    """Token streams of the training and held-out text, and prompts for the held-out report."""

    train: np.ndarray  # int32[N]
    heldout: np.ndarray  # int32[M]
    eval_prompts: list[list[int]]  # token ids (prompt lengths vary)
    def_prompts: list[list[int]]  # training-split prompts ending after a docstring (may be empty)


def load_sources(a, target) -> Sources:
    """Streams from `--manifest` (the demo corpus: train/held-out split by path hash) or `--data`;
    eval prompts from `--eval-prompts`, else the held-out def-with-docstring prompts of the
    manifest (the demo pair's shipped prompts), else 64-token windows of held-out text."""
    tok = target.tokenizer
    if tok is None:
        raise ValueError(f"--target {a.target}: no tokenizer files; distillation needs the target's tokenizer")
    bos, eos = target.config.bos_token_id, target.config.eos_token_id
    enc = lambda t: ([bos] if bos is not None else []) + list(tok(t, add_special_tokens=False)["input_ids"])
    def_prompts: list[list[int]] = []
    eval_prompts: list[list[int]] = []
    if a.manifest:
        m = corpus.load_manifest(a.manifest)
        train_t, held_t = corpus.read_texts(m, "train"), corpus.read_texts(m, "heldout")

        class _Tok:  # heldout_prompts counts tokens with a `tokenizers`-style encode
            def encode(self, s):
                return type("E", (), {"ids": tok(s, add_special_tokens=False)["input_ids"]})()

        def_prompts = [enc(p["text"]) for p in heldout_prompts(m, _Tok(), n=100000, max_tokens=a.prompt_tokens,
                                                               per_file=8, split="train")]
        if not a.eval_prompts:
            eval_prompts = [enc(p["text"]) for p in heldout_prompts(m, _Tok(), n=a.eval_count, max_tokens=96)]
    else:
        train_t, held_t = read_texts(a.data, a.glob)
    recs = _read_prompt_file(a.eval_prompts) if a.eval_prompts else None  # refused before writing
    cache = Path(a.out) / "cache"
    streams, unsaved = [], []
    for name, texts in (("train", train_t), ("heldout", held_t)):
        key = hashlib.sha256(("\0".join(texts) + str(getattr(tok, "name_or_path", ""))).encode()).hexdigest()[:16]
        f = cache / f"{name}-{key}.npy"
        if f.is_file():
            streams.append(np.load(f))
        else:
            s = encode_documents(tok, texts, bos, eos)
            unsaved.append((f, s))
            streams.append(s)
    train, held = streams
    if len(train) < a.seq_len + 2:
        raise ValueError(f"--data: the training text has {len(train)} tokens, fewer than --seq-len {a.seq_len}")
    for f, s in unsaved:  # written only once every flag and input has been accepted
        cache.mkdir(parents=True, exist_ok=True)
        np.save(f, s)
    if recs is not None:
        eval_prompts = [enc(r) for r in recs][: a.eval_count]
    if not eval_prompts:
        src = held if len(held) > 2 * a.prompt_tokens else train
        rng = np.random.default_rng([a.seed, 999])
        starts = rng.integers(0, max(1, len(src) - a.prompt_tokens), a.eval_count)
        eval_prompts = [src[s : s + a.prompt_tokens].tolist() for s in starts]
    return Sources(train, held, eval_prompts, def_prompts)


def _read_prompt_file(path: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--eval-prompts {p}: no such file")
    text = p.read_text()
    try:
        recs = json.loads(text)
    except json.JSONDecodeError:
        recs = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = [r["text"] if isinstance(r, dict) else r for r in recs]
    if not out or not all(isinstance(t, str) and t for t in out):
        raise ValueError(f"--eval-prompts {p}: expected a JSON list (or JSON lines) of strings or {{'text': ...}}")
    return out


def chunk_prompts(src: Sources, chunk: int, n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """Prompts of chunk `chunk`, a pure function of (seed, chunk): half def-with-docstring prompts
    of the training split (when the source has them), the rest windows of the training stream
    cut at a random point, 1/2 to 1 times `prompt_tokens` long."""
    rng = np.random.default_rng([seed, chunk, 1])
    n_def = n // 2 if src.def_prompts else 0
    out = [src.def_prompts[i] for i in rng.integers(0, len(src.def_prompts), n_def)] if n_def else []
    lens = rng.integers(max(1, prompt_tokens // 2), prompt_tokens + 1, n - n_def)
    starts = rng.integers(0, len(src.train) - prompt_tokens - 1, n - n_def)
    out += [src.train[s : s + k].tolist() for s, k in zip(starts, lens)]
    return out


def pack_rows(prompts: list[list[int]], conts: list[list[int]], greedy: list[bool], width: int, pad: int):
    """int32[R, width+1] rows of prompt + continuation (right-padded), with
    kl_mask f32[R, width] (positions whose input token is real and whose next token exists) and
    ce_mask f32[R, width] (positions predicting a token of a greedy continuation)."""
    R = len(prompts)
    rows = np.full((R, width + 1), pad, np.int32)
    kl = np.zeros((R, width), np.float32)
    ce = np.zeros((R, width), np.float32)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        seq = (list(p) + list(c))[: width + 1]
        rows[i, : len(seq)] = seq
        kl[i, : len(seq) - 1] = 1.0
        if greedy[i]:
            ce[i, max(0, len(p) - 1) : len(seq) - 1] = 1.0
    return rows, kl, ce


def corpus_rows(stream: np.ndarray, n: int, width: int, rng) -> np.ndarray:
    starts = rng.integers(0, len(stream) - width - 1, n)
    return np.stack([stream[s : s + width + 1] for s in starts]).astype(np.int32)
