"""Sequence-level unlikelihood fine-tuning: teach a small model not to loop under greedy decoding.

    python -m ouroboros_jax.training.unlikelihood --out runs/target_ul --steps 1500

Small language models trained far from convergence degenerate under greedy decoding: a few
plausible lines, then the same phrase again and again. Training longer fixes this slowly (the
20M demo target repeated 72% of its 8-grams after 7M tokens and 68% after 10.5M); the
sequence-level unlikelihood objective of Welleck et al. (ICLR 2020, arXiv 1908.04319) fixes it
directly, with MLE kept alongside so the model's likelihood barely moves:

- every other update is ordinary next-token MLE on a packed training batch;
- the others take the first `--prefix` tokens of training windows, let the model continue them
  greedily for `--continuation` tokens, flag each continuation token that lies inside an n-gram
  already produced earlier in the same continuation, and each end of file (`negatives`), and minimise
  -log(1 - p(flagged token | its prefix)) over the flagged positions (`unlikelihood_loss`).

Only training-split text is used. Progress is watched on def-with-docstring prompts drawn from
*training* files, so the held-out prompts of the ship gates (`report.py`) stay unseen. The run
resumes from the newest checkpoint in `--out` (copy the MLE checkpoint there first, see the
training README) and keeps train.py's checkpoint layout, so `export.py` takes it unchanged.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.llama import causal_mask, forward
from ouroboros_jax.training import corpus, data, report
from ouroboros_jax.training.tokenizer import BOS_ID, EOS_ID, load_tokenizer
from ouroboros_jax.training.train import (Checkpointer, heldout_loss, make_optimizer, make_steps,
                                          restore_state)


def repeat_mask(cont: np.ndarray, n: int) -> np.ndarray:
    """bool[B, N]: the tokens of each row of int[B, N] that lie inside an n-gram which already
    occurred earlier in the same row (an earlier start). The whole row counts, past an EOS too,
    as in the report's repetition measure."""
    B, N = cont.shape
    out = np.zeros((B, N), bool)
    for b in range(B):
        row = cont[b].tolist()
        seen = set()
        for i in range(N - n + 1):
            g = tuple(row[i : i + n])
            if g in seen:
                out[b, i : i + n] = True
            seen.add(g)
    return out


def negatives(cont: np.ndarray, n: int) -> np.ndarray:
    """bool[B, N]: the rollout tokens to push down: repeated n-grams, and file ends (EOS, BOS).

    Without the second part the objective has an escape: a rollout that ends the file after a
    few lines and starts another one repeats nothing, so the first fine-tune of the demo target
    (repeats only) traded loops for restarts, 7 of 24 held-out continuations ending the file
    within 128 tokens. Prefixes start at random positions, so a 128-token continuation of real
    text reaches its file's end about 3% of the time (files average ~4.8k tokens)."""
    return repeat_mask(cont, n) | (cont == EOS_ID) | (cont == BOS_ID)


def unlikelihood_loss(params, cfg: ModelConfig, tokens, flagged, compute_dtype):
    """Mean over the continuation positions of -log(1 - p(token)) at flagged positions.

    tokens int32[B, P+N] (prefix then continuation); flagged bool[B, P+N-1], aligned with the
    next-token targets tokens[:, 1:] (True only inside the continuation)."""
    p = jax.tree.map(lambda x: x.astype(compute_dtype), params)
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    B, T = inp.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _ = forward(p, cfg, inp, positions, causal_mask(B, T))
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    lp = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    one_minus_p = -jnp.expm1(lp)  # 1 - p without cancellation when p is small
    ul = -jnp.log(jnp.maximum(one_minus_p, 1e-6))
    return jnp.sum(jnp.where(flagged, ul, 0.0)) / B


def make_ul_step(cfg: ModelConfig, tx, compute_dtype):
    """Jitted (params, opt_state, tokens, flagged) -> (params, opt_state, loss); the MLE update
    is train.py's own step."""

    def ul_step(params, opt_state, tokens, flagged):
        loss, grads = jax.value_and_grad(unlikelihood_loss)(params, cfg, tokens, flagged, compute_dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(ul_step, donate_argnums=(0, 1))


def rollouts(params, cfg: ModelConfig, windows: np.ndarray, prefix: int, continuation: int, n: int):
    """(tokens int32[B, P+N], flagged bool[B, P+N-1], share of flagged continuation tokens) for
    greedy continuations of the first `prefix` tokens of each training window."""
    pre = np.ascontiguousarray(windows[:, :prefix]).astype(np.int32)
    lens = jnp.full((pre.shape[0],), prefix, jnp.int32)
    cont = np.asarray(report.greedy_cached(params, cfg, jnp.asarray(pre), lens, continuation))
    rep = negatives(cont, n)
    flagged = np.zeros((pre.shape[0], prefix + continuation - 1), bool)
    flagged[:, prefix - 1 :] = rep  # target index j predicts token j+1
    return np.concatenate([pre, cont.astype(np.int32)], axis=1), flagged, float(rep.mean())


def watch(params, cfg, prompts: list[list[int]], new_tokens: int) -> dict:
    """The report's measures on the watch prompts: mean repeated-8-gram share, short loops, and
    continuations that end the file (EOS or BOS)."""
    conts = report.greedy_continue_cached(params, cfg, prompts, new_tokens)
    return {"watch_repeat8": float(np.mean([report.repeated_ngram_share(c) for c in conts])),
            "watch_short_loops": int(sum(bool(report.short_loop(c)) for c in conts)),
            "watch_restarts": int(sum(EOS_ID in c or BOS_ID in c for c in conts))}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="run directory holding the MLE checkpoint to start from")
    ap.add_argument("--manifest", default="runs/corpus/manifest.json")
    ap.add_argument("--tokenizer", default="runs/tokenizer")
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument("--steps", type=int, default=1500, help="updates in all, MLE and unlikelihood alternating")
    ap.add_argument("--lr", type=float, default=1e-4, help="constant")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256, help="MLE windows")
    ap.add_argument("--prefix", type=int, default=64)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--ngram", type=int, default=4, help="n of the repeated n-grams that are pushed down")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--seed", type=int, default=1, help="data order (differs from the MLE run's)")
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-windows", type=int, default=96)
    ap.add_argument("--watch-prompts", type=int, default=32)
    ap.add_argument("--max-minutes", type=float, default=None)
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    return ap.parse_args(argv)


def finetune(a) -> dict:
    out = Path(a.out)
    run = json.loads((out / "run.json").read_text())
    cfg = ModelConfig(**run["model"])
    ra = run["args"]
    if a.prefix + a.continuation > cfg.max_position_embeddings:
        raise SystemExit(f"--prefix + --continuation = {a.prefix + a.continuation} exceeds the model's "
                         f"{cfg.max_position_embeddings} positions")
    if a.prefix >= a.seq_len:
        raise SystemExit(f"--prefix {a.prefix} must be shorter than --seq-len {a.seq_len}")
    ck = Checkpointer(out / "ckpt")
    if ck.latest() is None:
        raise SystemExit(f"no checkpoint under {out / 'ckpt'}: copy the MLE run's checkpoint there first")
    # the MLE run's optimizer state: its Adam moments continue, at a constant LR
    _, params, opt_state, meta = restore_state(out)
    start = meta.pop("step")
    ul = meta.get("unlikelihood", {"from_step": start, "steps": 0, "flagged_tokens": 0})
    tx, _ = make_optimizer(a.lr, 0, 1, ra["weight_decay"], ra["clip"], schedule="constant")
    # the chained states have the same structure (the schedule keeps its count in the adamw state)
    opt_state = jax.tree.unflatten(jax.tree.structure(tx.init(params)), jax.tree.leaves(opt_state))

    # run.json keeps the MLE run's args (export and restore_params rebuild that optimizer)
    run.setdefault("unlikelihood_args", []).append(vars(a))
    (out / "run.json").write_text(json.dumps(run, indent=1, default=str) + "\n")
    with open(out / "commands.txt", "a") as f:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        f.write(f"{when} from step {start}: python -m ouroboros_jax.training.unlikelihood {' '.join(sys.argv[1:])}\n")

    compute_dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    packed = data.Packed(data.token_stream(a.manifest, a.tokenizer, "train", a.cache_dir), a.seq_len, a.batch, a.seed)
    held = data.Packed(data.token_stream(a.manifest, a.tokenizer, "heldout", a.cache_dir), a.seq_len, a.batch, a.seed)
    tok = load_tokenizer(a.tokenizer)
    manifest = corpus.load_manifest(a.manifest)
    train_files = [f for f in manifest["files"] if f["split"] == "train"]
    every = max(1, len(train_files) // (4 * a.watch_prompts))  # an even spread; scanning all is slow
    wp = report.heldout_prompts(dict(manifest, files=train_files[::every]), tok, n=a.watch_prompts,
                                per_file=1, split="train")
    watch_ids = [[BOS_ID] + tok.encode(p["text"]).ids for p in wp]
    mle_step, eval_step = make_steps(cfg, tx, compute_dtype)
    ul_step = make_ul_step(cfg, tx, compute_dtype)

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    metrics = open(out / "metrics.jsonl", "a")

    def log(rec):
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()
        print(json.dumps(rec), flush=True)

    def evaluate(step):
        rec = {"step": step, "ul_step": ul["steps"], "heldout_loss": heldout_loss(eval_step, params, held, a.eval_windows),
               **watch(params, cfg, watch_ids, 128), "tokens": int(meta["tokens"]), "wall_s": meta["wall_s"]}
        log(rec)
        return rec

    step, first = start, ul["steps"]
    if first == 0:
        evaluate(step)
    t0 = t_ckpt = time.time()
    wall0 = meta["wall_s"]
    acc = {"mle": [], "ul": [], "flag": []}
    while ul["steps"] < a.steps and not stop["flag"]:
        k = ul["steps"]
        windows = packed.batch(k)
        if k % 2 == 0:
            params, opt_state, loss, _ = mle_step(params, opt_state, jnp.asarray(windows))
            acc["mle"].append(float(loss))
            meta["tokens"] = int(meta["tokens"]) + windows[:, 1:].size
        else:
            toks, flagged, share = rollouts(params, cfg, windows, a.prefix, a.continuation, a.ngram)
            params, opt_state, loss = ul_step(params, opt_state, jnp.asarray(toks), jnp.asarray(flagged))
            acc["ul"].append(float(loss))
            acc["flag"].append(share)
            ul["flagged_tokens"] += int(flagged.sum())
            meta["tokens"] = int(meta["tokens"]) + toks[:, 1:].size
        ul["steps"] += 1
        step += 1
        now = time.time()
        meta["wall_s"] = wall0 + (now - t0)
        if ul["steps"] % 20 == 0:
            log({"step": step, "ul_step": ul["steps"], "mle_loss": float(np.mean(acc["mle"] or [0])),
                 "ul_loss": float(np.mean(acc["ul"] or [0])), "rollout_repeat_share": float(np.mean(acc["flag"] or [0])),
                 "lr": a.lr, "tokens": int(meta["tokens"]), "wall_s": meta["wall_s"]})
            acc = {"mle": [], "ul": [], "flag": []}
        if ul["steps"] % a.eval_every == 0:
            evaluate(step)
        if now - t_ckpt > a.ckpt_minutes * 60:
            ck.save(step, params, opt_state, dict(meta, unlikelihood=ul))
            t_ckpt = time.time()
        if a.max_minutes is not None and now - t0 > a.max_minutes * 60:
            break
    ck.save(step, params, opt_state, dict(meta, unlikelihood=ul))
    print(f"saved step {step} ({ul['steps']} fine-tuning updates) to {out / 'ckpt'}", flush=True)
    return {"step": step, "params": params, "config": cfg, "meta": meta}


def main(argv=None):
    finetune(parse_args(argv))


if __name__ == "__main__":
    main()
