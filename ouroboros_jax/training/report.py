"""Pair quality report: the figures that decide whether a target/draft pair may ship.

    python -m ouroboros_jax.training.report --target runs/target --draft runs/draft --out runs/report.json

`--target/--draft` take a training run directory (newest orbax checkpoint) or a Hugging Face
directory (e.g. the shipped `ouroboros_jax/assets/demo/target`). Everything runs on held-out files
of the corpus manifest, with plain uncached forwards (a reference, independent of the decoders):

- loss per token (nats) and bits per byte on the packed held-out stream (its first
  `--eval-windows` windows, 384 x 256 tokens by default, 0 for all); bytes are counted
  exactly from the byte-level tokens, special tokens count 0 bytes (their loss still counts);
- per-token greedy top-1 agreement between draft and target on the same windows;
- greedy 128-token continuations (KV-cached decoding, checked against one uncached forward over
  the result: `cache_check_mismatches`) of held-out prompts (a `def` line and its docstring, with the
  lines above it as context): share of repeated 8-grams (an 8-gram that already occurred earlier
  in the same continuation), one/two-token loops at the tail, and continuations that emit EOS
  (i.e. end the file and restart another);
- plain greedy speculative decoding at gamma = 8: the draft proposes 8 tokens greedily, the target
  keeps the longest prefix that matches its own greedy choice plus one token of its own. Because
  greedy verification reproduces the target's greedy continuation, the accepted length of each
  round is computed against that continuation.

Gates (issue 3): target loss <= draft loss - 0.25; mean repeated-8-gram share <= 0.20; no
continuation in a one- or two-token loop; at most 10% of continuations restart a file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.kv_cache import commit_prefix, init_cache
from ouroboros_jax.models.llama import causal_mask, forward
from ouroboros_jax.models.loading import load_model
from ouroboros_jax.training import corpus, data
from ouroboros_jax.training.tokenizer import BOS_ID, EOS_ID, PAD_ID, load_tokenizer
from ouroboros_jax.training.train import restore_params

GAMMA = 8
NGRAM = 8
GATE_LOSS_MARGIN = 0.25
GATE_REPEAT = 0.20
GATE_RESTART_SHARE = 0.10


# ------------------------------------------------------------------------------------ models
def load_member(path: str | Path):
    """(config, fp32 params, info) from a run directory or a Hugging Face directory."""
    path = Path(path)
    if (path / "run.json").exists():
        cfg, params, meta = restore_params(path)
        return cfg, params, {"source": f"{path} step {meta['step']}", "step": meta["step"],
                             "train_tokens": meta["tokens"], "wall_s": meta["wall_s"]}
    m = load_model(str(path), "float32")
    return m.config, m.params, {"source": str(path)}


@partial(jax.jit, static_argnums=(1,))
def causal_logits(params, cfg: ModelConfig, tokens):
    """Logits [B,T,V] of one uncached causal forward over tokens int32[B,T] (positions 0..T-1)."""
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    return forward(params, cfg, tokens, pos, causal_mask(B, T))[0]


@partial(jax.jit, static_argnums=(1,))
def causal_argmax(params, cfg: ModelConfig, tokens):
    """int32[B,T]: the greedy next token after each position (the logits never leave the jit)."""
    return jnp.argmax(causal_logits(params, cfg, tokens), axis=-1)


@partial(jax.jit, static_argnums=(1,))
def _window_stats(params, cfg: ModelConfig, windows):
    """Per-position (nats of the target token, argmax) for int32[B, T+1] windows."""
    logits = causal_logits(params, cfg, windows[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, windows[:, 1:, None], axis=-1)[..., 0]
    return nll, jnp.argmax(logits, axis=-1)


@partial(jax.jit, static_argnums=(1,))
def _next_token(params, cfg: ModelConfig, tokens, last):
    """Greedy next token after position last[b] of right-padded rows tokens[B, T]."""
    logits = causal_logits(params, cfg, tokens)
    return jnp.argmax(jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], axis=-1)


def _bucket(n: int, b: int = 32) -> int:
    return -(-n // b) * b


def greedy_next(params, cfg, rows: list[list[int]]) -> np.ndarray:
    """Greedy next token of each row; shapes bucketed (T to 32, B to a power of 2) so that few
    distinct shapes compile."""
    T = _bucket(max(len(r) for r in rows))
    B = 1 << (len(rows) - 1).bit_length()
    toks = np.full((B, T), PAD_ID, np.int32)
    last = np.zeros((B,), np.int32)
    for i, r in enumerate(rows):
        toks[i, : len(r)] = r
        last[i] = len(r) - 1
    return np.asarray(_next_token(params, cfg, jnp.asarray(toks), jnp.asarray(last)))[: len(rows)]


def greedy_continue(params, cfg, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    rows = [list(p) for p in prompts]
    for _ in range(n_new):
        for r, t in zip(rows, greedy_next(params, cfg, rows)):
            r.append(int(t))
    return [r[len(p):] for r, p in zip(rows, prompts)]


@partial(jax.jit, static_argnums=(1, 4))
def greedy_cached(params, cfg: ModelConfig, toks, lens, n_new: int):
    """Greedy continuation with the KV cache: prefill the right-padded prompts toks[B, P] (true
    lengths lens[B]), then n_new single-token steps in one scan. Returns int32[B, n_new]."""
    B, P = toks.shape
    cache = init_cache(cfg, B, P + n_new, params["embed"].dtype)
    pos = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
    # no cache in the prefill: attention over an all-zero constant cache is constant-folded by XLA
    # (seconds of compile time for nothing)
    logits, new = forward(params, cfg, toks, pos, causal_mask(B, P))
    cache = commit_prefix(cache, new, lens)
    first = jnp.argmax(jnp.take_along_axis(logits, (lens - 1)[:, None, None], axis=1)[:, 0], axis=-1)
    ones = jnp.ones((B,), jnp.int32)

    def step(carry, _):
        cache, tok = carry
        logits, new = forward(params, cfg, tok[:, None].astype(jnp.int32), cache.lengths[:, None],
                              jnp.ones((B, 1, 1), bool), cache)
        return (commit_prefix(cache, new, ones), jnp.argmax(logits[:, 0], axis=-1)), tok

    _, out = jax.lax.scan(step, (cache, first), None, length=n_new)
    return out.T


def greedy_continue_cached(params, cfg, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    P = _bucket(max(len(p) for p in prompts))
    toks = np.full((len(prompts), P), PAD_ID, np.int32)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    return np.asarray(greedy_cached(params, cfg, jnp.asarray(toks), lens, n_new)).tolist()


def teacher_forced_mismatches(params, cfg, prompts, conts) -> int:
    """Positions where one uncached forward over prompt + continuation disagrees with the greedy
    token produced: 0 unless the cached decoding is wrong (or an exact near-tie flips)."""
    rows = [list(p) + list(c) for p, c in zip(prompts, conts)]
    T = _bucket(max(len(r) for r in rows))
    toks = np.full((len(rows), T), PAD_ID, np.int32)
    for i, r in enumerate(rows):
        toks[i, : len(r)] = r
    pred = np.asarray(causal_argmax(params, cfg, jnp.asarray(toks)))
    bad = 0
    for i, (p, c) in enumerate(zip(prompts, conts)):
        bad += int(np.sum(pred[i, len(p) - 1 : len(p) - 1 + len(c)] != np.asarray(c)))
    return bad


def speculative_acceptance(draft, draft_cfg, prompts, target_conts, gamma: int = GAMMA) -> list[list[int]]:
    """Accepted draft tokens of every round of greedy speculative decoding, per prompt."""
    done = [0] * len(prompts)  # tokens of the target continuation committed so far
    accepted: list[list[int]] = [[] for _ in prompts]
    n_new = len(target_conts[0])
    while True:
        active = [i for i in range(len(prompts)) if done[i] < n_new]
        if not active:
            return accepted
        ctx = {i: list(prompts[i]) + target_conts[i][: done[i]] for i in active}
        acc = {i: 0 for i in active}
        alive = list(active)  # rows whose drafts have matched so far this round
        for k in range(gamma):
            if not alive:
                break
            nxt = greedy_next(draft, draft_cfg, [ctx[i] for i in alive])
            still = []
            for i, t in zip(alive, nxt):
                j = done[i] + k
                if j < n_new and int(t) == target_conts[i][j]:
                    acc[i] += 1
                    ctx[i].append(int(t))
                    still.append(i)
            alive = still
        for i in active:
            accepted[i].append(acc[i])
            done[i] = min(n_new, done[i] + acc[i] + 1)  # accepted draft tokens + the target's own token


# ------------------------------------------------------------------------------------ measures
def repeated_ngram_share(tokens: list[int], n: int = NGRAM) -> float:
    seen, rep, total = set(), 0, 0
    for i in range(len(tokens) - n + 1):
        g = tuple(tokens[i : i + n])
        rep += g in seen
        seen.add(g)
        total += 1
    return rep / total if total else 0.0


def short_loop(tokens: list[int], tail: int = 24) -> int:
    """1 or 2 when the last `tail` tokens repeat with that period, else 0."""
    t = tokens[-tail:]
    for p in (1, 2):
        if len(t) > p and all(t[i] == t[i - p] for i in range(p, len(t))):
            return p
    return 0


# A def whose next line opens a docstring. Parentheses are matched (one level of nesting) rather
# than with a lazy `.*?` under re.S, which backtracked over whole files (52 s for the held-out
# split) and let a def without a docstring swallow the next def.
_DEF = re.compile(r'^(?P<ind>[ \t]*)def \w+\((?:[^()]|\([^()]*\))*\)[^\n]{0,200}?:[ \t]*\n(?P=ind)[ \t]+(?:[rRuU]?""")', re.M)


def heldout_prompts(manifest: dict, tok, n: int = 24, max_tokens: int = 96, per_file: int = 3,
                    split: str = "heldout") -> list[dict]:
    """Prompts ending right after the docstring of a `def` in held-out files (or in another
    `split`: unlikelihood fine-tuning watches training-split prompts, so the gate's prompts stay
    unseen), with preceding lines as context, at most `max_tokens` tokens (BOS included).
    Deterministic: manifest order, and up to `per_file` candidates evenly spread over each file.

    A prompt ends at the closing quotes, before the newline: the byte-level BPE merges a newline
    with the next line's indentation ("\n   " + " return"), so a bare "\n" token occurs in
    training only before column-0 text. A prompt ending in one tells the model the function is
    over, and it continues with top-level comments and imports instead of the body (measured on
    the stable-phase target at step 3208: 77% repeated 8-grams, 15 of 24 continuations looping)."""
    files = [f for f in manifest["files"] if f["split"] == split]
    per = []
    for f, text in zip(files, corpus.read_texts(manifest, split)):
        cands = []
        for m in _DEF.finditer(text):
            q = m.end()
            close = text.find('"""', q)
            end = text.find("\n", close) if close >= 0 else -1
            if end < 0 or close - q > 600:
                continue
            body = text[m.start() : end]
            if len(tok.encode(body).ids) + 1 > max_tokens:
                continue
            lines = text[: m.start()].splitlines(keepends=True)
            while lines and len(tok.encode(lines[-1] + body).ids) + 1 <= max_tokens:
                body = lines.pop() + body
            cands.append({"file": f["path"], "text": body})
        if cands:
            k = min(per_file, len(cands))
            per.append([cands[(i * len(cands)) // k] for i in range(k)])
    out = []  # round-robin over files so a few long files do not supply every prompt
    for i in range(per_file):
        out += [c[i] for c in per if i < len(c)]
    return out[:n]


def heldout_eval(tp, tc, dp, dc, held: data.Packed, byte_len: np.ndarray, max_windows: int | None):
    s = {"t_nats": 0.0, "d_nats": 0.0, "tokens": 0, "bytes": 0, "agree": 0}
    for b in held.eval_batches(max_windows):
        bj = jnp.asarray(b)
        t_nll, t_arg = _window_stats(tp, tc, bj)
        d_nll, d_arg = _window_stats(dp, dc, bj)
        s["t_nats"] += float(jnp.sum(t_nll))
        s["d_nats"] += float(jnp.sum(d_nll))
        s["agree"] += int(jnp.sum(t_arg == d_arg))
        s["tokens"] += b[:, 1:].size
        s["bytes"] += int(byte_len[b[:, 1:]].sum())
    return s


def token_byte_lengths(tok) -> np.ndarray:
    """Bytes each token stands for: byte-level BPE maps every byte to one character."""
    out = np.zeros(tok.get_vocab_size(), np.int64)
    for s, i in tok.get_vocab().items():
        out[i] = 0 if i in (PAD_ID, BOS_ID, EOS_ID) else len(s)
    return out


# ------------------------------------------------------------------------------------ report
def run_report(a) -> dict:
    t0 = time.time()
    manifest = corpus.load_manifest(a.manifest)
    tok = load_tokenizer(a.tokenizer)
    tc, tp, tinfo = load_member(a.target)
    dc, dp, dinfo = load_member(a.draft)
    held = data.Packed(data.token_stream(a.manifest, a.tokenizer, "heldout", a.cache_dir), a.seq_len, a.batch)
    s = heldout_eval(tp, tc, dp, dc, held, token_byte_lengths(tok), a.eval_windows or None)
    r = {"manifest_files_hash": manifest["files_hash"], "heldout_tokens": s["tokens"], "heldout_bytes": s["bytes"]}
    for name, c, info, nats in (("target", tc, tinfo, s["t_nats"]), ("draft", dc, dinfo, s["d_nats"])):
        r[name] = dict(info, num_params=c.num_params(), loss_per_token=nats / s["tokens"],
                       bits_per_byte=nats / math.log(2) / s["bytes"])
    r["top1_agreement"] = s["agree"] / s["tokens"]

    prompts = heldout_prompts(manifest, tok, a.prompts, a.prompt_tokens)
    p_ids = [[BOS_ID] + tok.encode(p["text"]).ids for p in prompts]
    if a.no_cache:
        t_conts = greedy_continue(tp, tc, p_ids, a.new_tokens)
    else:
        t_conts = greedy_continue_cached(tp, tc, p_ids, a.new_tokens)
    r["cache_check_mismatches"] = teacher_forced_mismatches(tp, tc, p_ids, t_conts)
    acc = speculative_acceptance(dp, dc, p_ids, t_conts, GAMMA)
    rounds = [x for row in acc for x in row]
    samples = []
    for p, c in zip(prompts, t_conts):
        samples.append({"file": p["file"], "prompt": p["text"], "continuation": tok.decode(c),
                        "repeat8": repeated_ngram_share(c), "loop": short_loop(c), "eos": EOS_ID in c or BOS_ID in c})
    r["continuations"] = {
        "prompts": len(prompts), "new_tokens": a.new_tokens,
        "mean_repeat8": float(np.mean([x["repeat8"] for x in samples])),
        "max_repeat8": float(np.max([x["repeat8"] for x in samples])),
        "short_loops": sum(bool(x["loop"]) for x in samples),
        "restarts": sum(x["eos"] for x in samples),
    }
    if a.draft_continuations:
        d_conts = (greedy_continue if a.no_cache else greedy_continue_cached)(dp, dc, p_ids, a.new_tokens)
        r["continuations"]["draft_mean_repeat8"] = float(np.mean([repeated_ngram_share(c) for c in d_conts]))
    r["speculative"] = {"gamma": GAMMA, "rounds": len(rounds),
                        "mean_accepted_per_round": float(np.mean(rounds)),
                        "mean_tokens_per_round": float(np.mean(rounds)) + 1.0}
    c = r["continuations"]
    r["gates"] = {
        "loss_margin": r["draft"]["loss_per_token"] - r["target"]["loss_per_token"] >= GATE_LOSS_MARGIN,
        "repeat8": c["mean_repeat8"] <= GATE_REPEAT,
        "no_short_loops": c["short_loops"] == 0,
        "continues_prompt": c["restarts"] <= GATE_RESTART_SHARE * c["prompts"],
    }
    r["passed"] = all(r["gates"].values())
    r["samples"] = samples
    r["report_wall_s"] = time.time() - t0
    return r


def summary(r: dict) -> str:
    t, d, c, sp = r["target"], r["draft"], r["continuations"], r["speculative"]
    lines = [
        f"target {t['num_params'] / 1e6:.2f}M params ({t['source']}): {t['loss_per_token']:.4f} nats/token, {t['bits_per_byte']:.4f} bits/byte",
        f"draft  {d['num_params'] / 1e6:.2f}M params ({d['source']}): {d['loss_per_token']:.4f} nats/token, {d['bits_per_byte']:.4f} bits/byte",
        f"held-out tokens {r['heldout_tokens']:,}; top-1 agreement {r['top1_agreement']:.3f}",
        f"target greedy continuations ({c['prompts']} prompts x {c['new_tokens']} tokens): repeated 8-grams "
        f"{c['mean_repeat8']:.3f} mean / {c['max_repeat8']:.3f} max, short loops {c['short_loops']}, restarts {c['restarts']}",
        f"speculative gamma={sp['gamma']}: {sp['mean_accepted_per_round']:.2f} accepted draft tokens/round "
        f"({sp['mean_tokens_per_round']:.2f} tokens/round over {sp['rounds']} rounds)",
        "gates: " + ", ".join(f"{k} {'ok' if v else 'FAIL'}" for k, v in r["gates"].items())
        + f" -> {'PASS' if r['passed'] else 'FAIL'}",
    ]
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--manifest", default="runs/corpus/manifest.json")
    ap.add_argument("--tokenizer", default="runs/tokenizer")
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--eval-windows", type=int, default=384, help="held-out windows of seq-len tokens (0: all)")
    ap.add_argument("--no-cache", action="store_true", help="greedy continuations by uncached forwards only")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--draft-continuations", action="store_true", help="also measure the draft's repetition")
    ap.add_argument("--show", type=int, default=3, help="print this many samples")
    ap.add_argument("--out", default=None, help="write the full report (JSON) here")
    return ap.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    r = run_report(a)
    for s in r["samples"][: a.show]:
        print(f"--- {s['file']} (repeat8 {s['repeat8']:.2f})\n{s['prompt']}\033[1m{s['continuation']}\033[0m")
    print(summary(r))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
