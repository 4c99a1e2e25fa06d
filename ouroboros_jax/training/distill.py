"""Knowledge distillation of a draft model from its target.

    ouroboros-jax distill --target HF_DIR --out runs/distill --data CODE_DIR [--init HF_DIR]
    python -m ouroboros_jax.training.distill ...            (the same)

A draft is worth exactly as much as it agrees with its target: at top-1 agreement a, greedy
speculative decoding at gamma g commits (1 - a^(g+1)) / (1 - a) tokens per target forward. So
the draft is trained to imitate the *target*, not the data:

- **data**: the target's own continuations (greedy, plus a share sampled at a temperature) of
  prompts cut from the user's text, generated in large batches with `oj.generate`, and plain text
  windows; a chunk of continuations is generated, trained on, and replaced by the next one;
- **loss**: token-level KL(target || draft) at every real position, the target's logits computed
  on the fly by a target forward inside the jitted step (nothing is stored), plus cross-entropy
  on the target's greedy tokens (the exact tokens speculative decoding must reproduce);
- **run**: AdamW (the train.py optimizer and schedule), orbax checkpoints with resume (chunk k's
  prompts and continuations depend only on (seed, k), so a resumed run sees the same data),
  a progress bar, held-out agreement every `--eval-every` steps, and at the end a Hugging Face
  draft directory (`<out>/hf`, with the target's tokenizer) and an agreement report
  (`<out>/report.json`).

Agreement is measured as the gates of issue 11 define it: the target continues each held-out
prompt greedily for 128 tokens; the draft reads prompt + continuation once (teacher forcing) and
its argmax at each continuation position is compared with the target's token. Greedy
speculative decoding's tokens per target forward follow exactly from those matches (the draft
drafts from the committed prefix, which *is* the target's continuation): `sd_tokens_per_round`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import signal
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ouroboros_jax.generate import generate
from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.llama import causal_mask, forward, init_params
from ouroboros_jax.models.loading import Model, load_model, load_tokenizer, save_hf_checkpoint
from ouroboros_jax.training.distill_data import (chunk_prompts, corpus_rows, load_sources,
                                                pack_rows)
from ouroboros_jax.training.report import causal_argmax
from ouroboros_jax.training.train import Checkpointer, make_optimizer, restore_params

EVAL_NEW_TOKENS = 128
# ------------------------------------------------------------------------------------ loss
def distill_loss(draft_params, target_params, dcfg: ModelConfig, tcfg: ModelConfig, rows, kl_mask, ce_mask,
                 kl_weight: float, ce_weight: float):
    """Masked mean KL(target || draft) + ce_weight * masked mean CE on the row's next tokens.

    rows int32[B, T+1]; masks f32[B, T]. Target logits come from a forward here, under
    stop_gradient, in fp32. Returns (loss, (kl, ce, agreement of the argmaxes on kl_mask))."""
    tokens, labels = rows[:, :-1], rows[:, 1:]
    B, T = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    mask = causal_mask(B, T)
    t_logits = jax.lax.stop_gradient(forward(target_params, tcfg, tokens, pos, mask)[0].astype(jnp.float32))
    d_logits = forward(draft_params, dcfg, tokens, pos, mask)[0].astype(jnp.float32)
    t_logp = jax.nn.log_softmax(t_logits, axis=-1)
    d_logp = jax.nn.log_softmax(d_logits, axis=-1)
    kl = jnp.sum(jnp.exp(t_logp) * (t_logp - d_logp), axis=-1)  # [B, T]
    ce = -jnp.take_along_axis(d_logp, labels[..., None], axis=-1)[..., 0]
    n_kl, n_ce = jnp.maximum(kl_mask.sum(), 1.0), jnp.maximum(ce_mask.sum(), 1.0)
    kl_m = jnp.sum(kl * kl_mask) / n_kl
    ce_m = jnp.sum(ce * ce_mask) / n_ce
    agree = jnp.sum((jnp.argmax(d_logits, -1) == jnp.argmax(t_logits, -1)) * kl_mask) / n_kl
    return kl_weight * kl_m + ce_weight * ce_m, (kl_m, ce_m, agree)


def make_step(dcfg: ModelConfig, tcfg: ModelConfig, tx, kl_weight: float, ce_weight: float):
    """The jitted update: (draft params, opt state, target params, rows, kl_mask, ce_mask) ->
    (params, opt state, {loss, kl, ce, agree, grad_norm})."""
    loss_fn = partial(distill_loss, dcfg=dcfg, tcfg=tcfg, kl_weight=kl_weight, ce_weight=ce_weight)

    def step(params, opt_state, target_params, rows, kl_mask, ce_mask):
        (loss, (kl, ce, agree)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, target_params, rows=rows, kl_mask=kl_mask, ce_mask=ce_mask)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {
            "loss": loss, "kl": kl, "ce": ce, "agree": agree, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=(0, 1))


# ------------------------------------------------------------------------------------ agreement
def teacher_forced_matches(params, cfg: ModelConfig, prompts: list[list[int]], conts: list[list[int]],
                           pad: int = 0) -> list[np.ndarray]:
    """Per prompt, bool[len(cont)]: the model's argmax after prompt + cont[:j] equals cont[j]."""
    width = max(len(p) + len(c) for p, c in zip(prompts, conts))
    width = -(-width // 32) * 32
    rows = np.full((len(prompts), width), pad, np.int32)
    for i, (p, c) in enumerate(zip(prompts, conts)):
        rows[i, : len(p) + len(c)] = list(p) + list(c)
    pred = np.asarray(causal_argmax(params, cfg, jnp.asarray(rows)))
    return [pred[i, len(p) - 1 : len(p) - 1 + len(c)] == np.asarray(c, np.int64)
            for i, (p, c) in enumerate(zip(prompts, conts))]


def sd_tokens_per_round(matches: list[np.ndarray], gamma: int) -> float:
    """Greedy speculative decoding's tokens per target forward, from teacher-forced matches: a
    round at position i accepts the run of matches from i (at most gamma) and adds the target's
    own token; the next round starts after it."""
    rounds = tokens = 0
    for m in matches:
        i = 0
        while i < len(m):
            a = 0
            while a < gamma and i + a < len(m) and m[i + a]:
                a += 1
            step = min(a + 1, len(m) - i)
            tokens += step
            rounds += 1
            i += step
    return tokens / max(rounds, 1)


def agreement_report(draft_params, dcfg, prompts, conts, gammas=(4, 8)) -> dict:
    m = teacher_forced_matches(draft_params, dcfg, prompts, conts)
    flat = np.concatenate(m) if m else np.zeros((0,), bool)
    r = {"prompts": len(prompts), "tokens": int(flat.size), "top1_agreement": float(flat.mean()) if flat.size else 0.0}
    for g in gammas:
        r[f"sd_tokens_per_round_gamma{g}"] = sd_tokens_per_round(m, g)
    return r


# ------------------------------------------------------------------------------------ run
def _load(path: str, what: str):
    """A Model from a Hugging Face directory, or from a training run directory (run.json)."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"--{what} {path}: not a directory")
    if (p / "run.json").exists():
        cfg, params, _ = restore_params(p)
        tok_dir = json.loads((p / "run.json").read_text())["args"].get("tokenizer")
        return Model(cfg, params, load_tokenizer(tok_dir) if tok_dir else None, str(p))
    return load_model(str(p), "float32")


def draft_config_from(target_cfg: ModelConfig, spec: str) -> ModelConfig:
    """The target's config with the JSON overrides (e.g. '{"hidden_size": 192, "num_layers": 4}');
    the vocabulary and special tokens stay the target's."""
    try:
        fields = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--draft-config is not valid JSON: {e}") from None
    if not isinstance(fields, dict):
        raise ValueError("--draft-config must be a JSON object of ModelConfig fields")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = sorted(set(fields) - known)
    if bad:
        raise ValueError(f"--draft-config: unknown field(s) {bad}; known: {sorted(known)}")
    if "vocab_size" in fields and fields["vocab_size"] != target_cfg.vocab_size:
        raise ValueError("--draft-config: vocab_size must equal the target's (they share a tokenizer)")
    for k, v in fields.items():
        if k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim") and (
                not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ValueError(f"--draft-config: {k} must be a positive integer, got {v!r}")
    if "head_dim" not in fields and "hidden_size" in fields:
        fields["head_dim"] = fields["hidden_size"] // fields.get("num_heads", target_cfg.num_heads)
    cfg = dataclasses.replace(target_cfg, **fields)
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"--draft-config: num_heads ({cfg.num_heads}) must be a multiple of num_kv_heads ({cfg.num_kv_heads})")
    return cfg


def validate_args(a) -> None:
    if bool(a.init) == bool(a.draft_config):
        raise ValueError("give exactly one of --init (a draft to start from) or --draft-config (a fresh draft's shape)")
    if bool(a.data) == bool(a.manifest):
        raise ValueError("give exactly one of --data (a directory, .jsonl or text file) or --manifest (the demo corpus)")
    for name in ("steps", "batch", "seq_len", "gen_batch", "new_tokens", "prompt_tokens", "eval_every", "eval_count"):
        v = getattr(a, name)
        if v <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {v}")
    if a.prompt_tokens + a.new_tokens > a.seq_len + 1:
        raise ValueError(f"--prompt-tokens ({a.prompt_tokens}) + --new-tokens ({a.new_tokens}) must fit in "
                         f"--seq-len + 1 ({a.seq_len + 1})")
    for name in ("corpus_share", "sample_share"):
        v = getattr(a, name)
        if not 0.0 <= v < 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {v}")
    if a.temperature <= 0:
        raise ValueError(f"--temperature must be > 0 (it is the sampled continuations'), got {a.temperature}")
    if a.lr <= 0:
        raise ValueError(f"--lr must be positive, got {a.lr}")
    if a.kl_weight < 0 or a.ce_weight < 0 or a.kl_weight + a.ce_weight == 0:
        raise ValueError("--kl-weight and --ce-weight must be >= 0 and not both 0")
    if a.max_steps is not None and a.max_steps <= 0:
        raise ValueError(f"--max-steps must be positive, got {a.max_steps}")
    if a.reuse <= 0:
        raise ValueError(f"--reuse must be positive, got {a.reuse}")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise ValueError(f"--out {a.out}: exists and is not a directory (the run directory "
                         "holds checkpoints, metrics and the exported draft)")


class Distiller:
    """State of one distillation run; `run()` trains to `--steps` and returns the final report."""

    def __init__(self, a):
        validate_args(a)
        self.a = a
        self.out = Path(a.out)
        self.target = _load(a.target, "target")
        tcfg = self.target.config
        if a.init:
            init = _load(a.init, "init")
            if init.config.vocab_size != tcfg.vocab_size:
                raise ValueError(f"--init {a.init}: vocabulary {init.config.vocab_size} differs from the "
                                 f"target's {tcfg.vocab_size}")
            self.dcfg, params = init.config, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), init.params)
        else:
            self.dcfg = draft_config_from(tcfg, a.draft_config)
            params = init_params(self.dcfg, jax.random.key(a.seed), jnp.float32)
        if self.dcfg.num_params() > tcfg.num_params():
            print(f"warning: the draft ({self.dcfg.num_params():,} params) is larger than the target "
                  f"({tcfg.num_params():,})", file=sys.stderr)
        self.src = load_sources(a, self.target)
        self.out.mkdir(parents=True, exist_ok=True)  # only once the flags and inputs are accepted
        self.tx, self.schedule = _optimizer(a)
        self.params, self.opt_state = params, self.tx.init(params)
        self.n_gen_rows = max(1, round(a.batch * (1 - a.corpus_share)))
        self.n_corpus_rows = a.batch - self.n_gen_rows
        self.steps_per_chunk = max(1, math.ceil(a.gen_batch * a.reuse / self.n_gen_rows))
        self.step_fn = make_step(self.dcfg, tcfg, self.tx, a.kl_weight, a.ce_weight)
        self._chunk_id, self._chunk = -1, None
        self._eval = None

    # -- data
    def chunk(self, k: int):
        """Chunk k: gen_batch prompts continued by the target (a sample_share of them sampled),
        packed rows and masks; a pure function of (seed, k)."""
        if k == self._chunk_id:
            return self._chunk
        a, pad = self.a, self.target.config.pad_token_id or 0
        prompts = chunk_prompts(self.src, k, a.gen_batch, a.prompt_tokens, a.seed)
        n_sample = int(round(a.gen_batch * a.sample_share))
        greedy = [True] * (a.gen_batch - n_sample) + [False] * n_sample
        conts: list[list[int]] = []
        for lo in range(0, a.gen_batch, a.gen_micro_batch):
            sub = prompts[lo : lo + a.gen_micro_batch]
            g = greedy[lo : lo + a.gen_micro_batch]
            for is_greedy in (True, False):
                idx = [i for i, x in enumerate(g) if x == is_greedy]
                if not idx:
                    continue
                out = generate(self.target, [sub[i] for i in idx], method="vanilla", max_new_tokens=a.new_tokens,
                               temperature=0.0 if is_greedy else a.temperature, top_p=a.top_p,
                               seed=a.seed * 100003 + k)
                for i, t in zip(idx, out.tokens):
                    while len(conts) <= lo + i:
                        conts.append([])
                    conts[lo + i] = t
        rows, kl, ce = pack_rows(prompts, conts, greedy, a.seq_len, pad)
        order = np.random.default_rng([a.seed, k, 2]).permutation(len(rows))
        self._chunk_id, self._chunk = k, (rows[order], kl[order], ce[order])
        return self._chunk

    def batch(self, step: int):
        """(rows int32[B, T+1], kl_mask, ce_mask) of a global step: n_gen_rows generated rows
        of the step's chunk, then n_corpus_rows plain text windows (KL only)."""
        k, j = divmod(step, self.steps_per_chunk)
        rows, kl, ce = self.chunk(k)
        idx = (np.arange(self.n_gen_rows) + j * self.n_gen_rows) % len(rows)
        r, km, cm = rows[idx], kl[idx], ce[idx]
        if self.n_corpus_rows:
            rng = np.random.default_rng([self.a.seed, step, 3])
            c = corpus_rows(self.src.train, self.n_corpus_rows, self.a.seq_len, rng)
            r = np.concatenate([r, c])
            km = np.concatenate([km, np.ones((self.n_corpus_rows, self.a.seq_len), np.float32)])
            cm = np.concatenate([cm, np.zeros((self.n_corpus_rows, self.a.seq_len), np.float32)])
        return jnp.asarray(r), jnp.asarray(km), jnp.asarray(cm)

    # -- evaluation
    def eval_set(self):
        """The target's greedy 128-token continuations of the eval prompts (computed once)."""
        if self._eval is None:
            out = generate(self.target, self.src.eval_prompts, method="vanilla", max_new_tokens=EVAL_NEW_TOKENS)
            keep = [i for i, t in enumerate(out.tokens) if t]
            self._eval = ([self.src.eval_prompts[i] for i in keep], [out.tokens[i] for i in keep])
        return self._eval

    def evaluate(self, params=None) -> dict:
        prompts, conts = self.eval_set()
        return agreement_report(self.params if params is None else params, self.dcfg, prompts, conts)

    # -- loop
    def run(self) -> dict:
        from tqdm import tqdm

        a = self.a
        run = {"target": a.target, "init": a.init, "model": dataclasses.asdict(self.dcfg), "args": vars(a),
               "num_params": self.dcfg.num_params(), "target_num_params": self.target.config.num_params()}
        run_path = self.out / "run.json"
        if run_path.exists():
            old = json.loads(run_path.read_text())
            if old["model"] != run["model"]:
                raise SystemExit(f"{run_path}: the draft config differs from this command's; use a new --out")
        run_path.write_text(json.dumps(run, indent=1, default=str) + "\n")
        ck = Checkpointer(self.out / "ckpt")
        step, meta = 0, {"tokens": 0, "wall_s": 0.0}
        if ck.latest() is not None:
            step = ck.latest()
            self.params, self.opt_state, meta = ck.restore(step, self.params, self.opt_state)
            print(f"resumed {self.out} at step {step}", flush=True)
        with open(self.out / "commands.txt", "a") as f:
            when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            f.write(f"{when} from step {step}: ouroboros-jax distill {' '.join(a.argv)}\n")
        print(f"distill: draft {self.dcfg.num_params():,} params <- target {self.target.config.num_params():,}; "
              f"{a.batch} rows x {a.seq_len} tokens/step ({self.n_gen_rows} target continuations, "
              f"{self.n_corpus_rows} text windows); a chunk of {a.gen_batch} continuations every "
              f"{self.steps_per_chunk} steps; steps {step}->{a.steps}", flush=True)
        metrics = open(self.out / "metrics.jsonl", "a")
        log = lambda rec: (metrics.write(json.dumps(rec) + "\n"), metrics.flush())
        if step == 0:
            rep = self.evaluate()
            log({"step": 0, **rep})
            print(f"step 0: held-out agreement {rep['top1_agreement']:.3f}, SD gamma 4 "
                  f"{rep['sd_tokens_per_round_gamma4']:.2f} tokens/round", flush=True)
        stop = {"flag": False}
        signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
        bar = None if a.no_progress else tqdm(total=a.steps, initial=step, mininterval=10, ncols=110, file=sys.stderr)
        t_start = t_ckpt = time.time()
        wall0, acc = meta["wall_s"], []

        def save():
            ck.save(step, self.params, self.opt_state, {"tokens": int(meta["tokens"]), "wall_s": float(meta["wall_s"])})

        last = a.steps if a.max_steps is None else min(a.steps, a.max_steps)
        while step < last and not stop["flag"]:
            rows, km, cm = self.batch(step)
            self.params, self.opt_state, m = self.step_fn(self.params, self.opt_state, self.target.params, rows, km, cm)
            step += 1
            meta["tokens"] += int(rows.shape[0] * a.seq_len)
            meta["wall_s"] = wall0 + time.time() - t_start
            acc.append(m)
            if step % a.log_every == 0 or step == a.steps:
                avg = {k: float(np.mean([float(x[k]) for x in acc])) for k in acc[0]}
                acc = []
                log({"step": step, **avg, "lr": float(self.schedule(step)), "tokens": meta["tokens"],
                     "wall_s": meta["wall_s"]})
                if bar is not None:
                    bar.set_postfix_str(f"kl {avg['kl']:.3f} ce {avg['ce']:.3f} agree {avg['agree']:.3f}", refresh=False)
                    bar.update(step - bar.n)
            if step % a.eval_every == 0 and step < a.steps:
                rep = self.evaluate()
                log({"step": step, **rep, "wall_s": meta["wall_s"]})
                msg = (f"step {step}: held-out agreement {rep['top1_agreement']:.3f}, SD gamma 4 "
                       f"{rep['sd_tokens_per_round_gamma4']:.2f} tokens/round ({meta['wall_s'] / 60:.1f} min)")
                (bar.write(msg) if bar is not None else print(msg, flush=True))
            if a.max_minutes is not None and time.time() - t_start > a.max_minutes * 60:
                break
            if time.time() - t_ckpt > a.ckpt_minutes * 60:
                save()
                t_ckpt = time.time()
        save()
        if bar is not None:
            bar.close()
        rep = self.finish(step)
        log({"step": step, "final": True, **rep["heldout"]})
        return rep

    def finish(self, step: int) -> dict:
        """Writes `<out>/hf` (the draft, Hugging Face layout, the target's tokenizer) and
        `<out>/report.json`; prints the agreement report."""
        hf = self.out / "hf"
        src = Path(self.target.path or "")
        tok_files = [src / n for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                       "tokenizer.model") if (src / n).is_file()]
        # the target's own tokenizer files, byte for byte (a re-save adds loader-specific keys)
        save_hf_checkpoint(str(hf), self.dcfg, self.params, dtype=self.a.export_dtype,
                           tokenizer=None if tok_files else self.target.tokenizer)
        for f in tok_files:
            shutil.copy(f, hf / f.name)
        rep = {"step": step, "draft_params": self.dcfg.num_params(),
               "target_params": self.target.config.num_params(), "heldout": self.evaluate(), "hf_dir": str(hf)}
        (self.out / "report.json").write_text(json.dumps(rep, indent=1) + "\n")
        h = rep["heldout"]
        print(f"saved step {step}: {hf}\nheld-out agreement with the target's greedy continuations "
              f"({h['prompts']} prompts x {EVAL_NEW_TOKENS} tokens, teacher-forced): {h['top1_agreement']:.3f}; "
              f"greedy SD tokens per target forward: gamma 4 {h['sd_tokens_per_round_gamma4']:.2f}, "
              f"gamma 8 {h['sd_tokens_per_round_gamma8']:.2f}", flush=True)
        return rep


def _optimizer(a):
    return make_optimizer(a.lr, a.warmup, a.steps, a.weight_decay, a.clip, "wsd", a.decay_frac)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="ouroboros-jax distill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--target", dest="target", metavar="PATH", required=True, help="the target: a Hugging Face directory (or a training run)")
    ap.add_argument("--out", required=True, help="run directory (checkpoints, metrics, hf/, report.json)")
    ap.add_argument("--init", help="start from this draft (Hugging Face directory or training run)")
    ap.add_argument("--draft-config", help="or a fresh draft: JSON of config fields over the target's")
    ap.add_argument("--data", help="training text: a directory (files matching --glob), a .jsonl ({'text'}) or a text file")
    ap.add_argument("--glob", default="*.py", help="files of a --data directory (default *.py)")
    ap.add_argument("--manifest", help="or the demo corpus manifest (ouroboros_jax.training.corpus)")
    ap.add_argument("--eval-prompts", help="held-out prompts: JSON list / JSON lines of strings or {'text'}")
    ap.add_argument("--eval-count", type=int, default=24, help="held-out prompts for the agreement report")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16, help="rows per update")
    ap.add_argument("--seq-len", type=int, default=224, help="tokens per row (prompt + continuation)")
    ap.add_argument("--prompt-tokens", type=int, default=96, help="longest prompt")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens the target continues each prompt by")
    ap.add_argument("--gen-batch", type=int, default=96, help="continuations per chunk")
    ap.add_argument("--gen-micro-batch", type=int, default=48, help="rows per generate call")
    ap.add_argument("--reuse", type=int, default=2, help="times each continuation is trained on")
    ap.add_argument("--sample-share", type=float, default=0.25, help="share of continuations sampled, not greedy")
    ap.add_argument("--temperature", type=float, default=0.8, help="of the sampled continuations")
    ap.add_argument("--top-p", type=float, default=0.95, help="of the sampled continuations")
    ap.add_argument("--corpus-share", type=float, default=0.25, help="share of rows that are plain text windows")
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--ce-weight", type=float, default=0.5, help="CE on the target's greedy tokens")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--decay-frac", type=float, default=0.3, help="share of steps in the final linear LR decay")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (with a checkpoint) after this wall time")
    ap.add_argument("--max-steps", type=int, default=None, help="stop (with a checkpoint) at this step; "
                    "the LR schedule still spans --steps")
    ap.add_argument("--export-dtype", choices=["float32", "bfloat16"], default="float32", help="of <out>/hf")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    a.argv = list(sys.argv[1:] if argv is None else argv)
    return a


def main(argv=None) -> dict:
    a = parse_args(argv)
    try:
        d = Distiller(a)
    except ValueError as e:
        raise SystemExit(f"ouroboros-jax distill: {e}") from None
    return d.run()


if __name__ == "__main__":
    main()
