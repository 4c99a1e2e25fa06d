"""Train one model of the demo pair on the packed Python corpus.

    python -m ouroboros_jax.training.train --model target --out runs/target
    python -m ouroboros_jax.training.train --model draft  --out runs/draft

The same command resumes from the newest orbax checkpoint in `<out>/ckpt` (data order, schedule
and RNG depend only on the step, so a resumed run continues exactly). Compute is bf16 with fp32
master weights and fp32 loss; AdamW with linear warmup, cosine decay to 10% and global-norm
clipping. `<out>/metrics.jsonl` gets one line per log interval and per held-out evaluation;
`<out>/run.json` records the model config and every argument.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

from ouroboros_jax.models.config import ModelConfig
from ouroboros_jax.models.llama import causal_mask, forward, init_params
from ouroboros_jax.training import data
from ouroboros_jax.training.tokenizer import BOS_ID, EOS_ID, PAD_ID

# Both share the tokenizer; the draft's per-token compute (non-embedding matmuls + LM head) is
# under 1/5 of the target's: 2*(4*0.44M + 1.57M) vs 2*(8*1.77M + 3.15M) multiply-adds.
PRESETS = {
    "target": dict(hidden_size=384, intermediate_size=1024, num_layers=8, num_heads=6, num_kv_heads=6, head_dim=64),
    "draft": dict(hidden_size=192, intermediate_size=512, num_layers=4, num_heads=3, num_kv_heads=3, head_dim=64),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16),
}


def model_config(preset: str, vocab_size: int = 8192, max_positions: int = 2048) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=max_positions, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
        pad_token_id=PAD_ID, **PRESETS[preset],
    )


def lr_schedule(lr: float, warmup: int, total_steps: int, kind: str = "wsd", decay_frac: float = 0.2,
                end_frac: float = 0.02):
    """Linear warmup, then either cosine decay over the rest ("cosine") or a constant LR with a
    linear decay over the last `decay_frac` of the steps ("wsd", warmup-stable-decay). With "wsd"
    the run length can be changed on resume while still in the constant phase without any jump,
    which suits a machine whose throughput is not known in advance."""
    if kind == "constant":  # fine-tuning (unlikelihood.py): no warmup, no decay
        return optax.constant_schedule(lr)
    total_steps = max(total_steps, warmup + 1)
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, total_steps, end_value=lr * end_frac)
    decay = max(1, int(round(total_steps * decay_frac)))
    stable = max(0, total_steps - decay - warmup)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr),
         optax.linear_schedule(lr, lr * end_frac, decay)],
        [warmup, warmup + stable],
    )


def make_optimizer(lr: float, warmup: int, total_steps: int, weight_decay: float = 0.1, clip: float = 1.0,
                   schedule: str = "wsd", decay_frac: float = 0.2):
    schedule = lr_schedule(lr, warmup, total_steps, schedule, decay_frac)
    # no weight decay on the norm gains
    decay_mask = lambda p: jax.tree_util.tree_map_with_path(lambda path, x: "norm" not in jax.tree_util.keystr(path), p)
    tx = optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=decay_mask),
    )
    return tx, schedule


def loss_fn(params, cfg: ModelConfig, batch, compute_dtype):
    """Mean next-token cross-entropy (nats) of int32[B, T+1] windows."""
    p = jax.tree.map(lambda x: x.astype(compute_dtype), params)
    tokens, targets = batch[:, :-1], batch[:, 1:]
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    logits, _ = forward(p, cfg, tokens, positions, causal_mask(B, T))
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def make_steps(cfg: ModelConfig, tx, compute_dtype):
    @jax.jit
    def eval_step(params, batch):
        return loss_fn(params, cfg, batch, compute_dtype)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, cfg, batch, compute_dtype)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    return jax.jit(train_step, donate_argnums=(0, 1)), eval_step


def heldout_loss(eval_step, params, packed: data.Packed, max_windows: int) -> float:
    tot, n = 0.0, 0
    for b in packed.eval_batches(max_windows):
        tot += float(eval_step(params, jnp.asarray(b))) * len(b)
        n += len(b)
    return tot / n


class Checkpointer:
    """Orbax manager over {params, opt_state} plus a JSON of counters (tokens, wall time)."""

    def __init__(self, directory: Path, keep: int = 3):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.mgr = ocp.CheckpointManager(directory.absolute(), options=ocp.CheckpointManagerOptions(max_to_keep=keep))

    def latest(self):
        return self.mgr.latest_step()

    def save(self, step: int, params, opt_state, meta: dict):
        ocp = self.ocp
        self.mgr.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
            meta=ocp.args.JsonSave(meta)), force=True)
        self.mgr.wait_until_finished()

    def restore(self, step: int, params, opt_state):
        ocp = self.ocp
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
        r = self.mgr.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return r["state"]["params"], r["state"]["opt_state"], r["meta"]


def restore_state(out_dir: str | Path, step: int | None = None):
    """(ModelConfig, fp32 params, optimizer state, meta) of a run directory's newest (or given)
    checkpoint, the optimizer rebuilt from the run's recorded arguments."""
    out = Path(out_dir)
    run = json.loads((out / "run.json").read_text())
    cfg = ModelConfig(**run["model"])
    ra = run["args"]
    tx, _ = make_optimizer(ra["lr"], ra["warmup"], ra["total_steps"], ra["weight_decay"], ra["clip"],
                           ra.get("schedule", "wsd"), ra.get("decay_frac", 0.2))
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), jnp.float32))
    opt_state = jax.eval_shape(tx.init, params)
    ck = Checkpointer(out / "ckpt")
    step = ck.latest() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint under {out / 'ckpt'}")
    params, opt_state, meta = ck.restore(step, params, opt_state)
    return cfg, params, opt_state, dict(meta, step=step)


def restore_params(out_dir: str | Path, step: int | None = None):
    """(ModelConfig, fp32 params, meta) of a run directory's newest (or given) checkpoint."""
    cfg, params, _, meta = restore_state(out_dir, step)
    return cfg, params, meta


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--manifest", default="runs/corpus/manifest.json")
    ap.add_argument("--tokenizer", default="runs/tokenizer")
    ap.add_argument("--cache-dir", default="runs/cache", help="tokenized streams (.npy)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--total-steps", type=int, default=3000, help="length of the LR schedule")
    ap.add_argument("--schedule", choices=["wsd", "cosine"], default="wsd")
    ap.add_argument("--decay-frac", type=float, default=0.2, help="wsd: share of steps in the final linear decay")
    ap.add_argument("--max-steps", type=int, default=None, help="stop at this step (default: total-steps)")
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (with a checkpoint) after this wall time")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="compute dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-windows", type=int, default=96, help="held-out windows per evaluation")
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def train(a) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    max_steps = a.total_steps if a.max_steps is None else a.max_steps
    train_stream = data.token_stream(a.manifest, a.tokenizer, "train", a.cache_dir)
    held_stream = data.token_stream(a.manifest, a.tokenizer, "heldout", a.cache_dir)
    vocab = int(json.loads((Path(a.tokenizer) / "tokenizer.json").read_text())["model"]["vocab"].__len__())
    cfg = model_config(a.model, vocab_size=vocab)
    packed = data.Packed(train_stream, a.seq_len, a.batch, a.seed)
    held = data.Packed(held_stream, a.seq_len, a.batch, a.seed)

    run = {"model": dataclasses.asdict(cfg), "args": vars(a), "num_params": cfg.num_params(),
           "train_tokens_per_epoch": int(packed.num_windows * a.seq_len)}
    run_path = out / "run.json"
    if run_path.exists():
        old = json.loads(run_path.read_text())
        if old["model"] != run["model"]:
            raise SystemExit(f"{run_path}: model config differs from this command's; use a new --out")
        for k in ("seq_len", "batch", "lr", "warmup", "total_steps", "seed", "manifest", "tokenizer"):
            if old["args"][k] != run["args"][k]:
                print(f"warning: --{k.replace('_', '-')} changed from {old['args'][k]} to {run['args'][k]}", file=sys.stderr)
    run_path.write_text(json.dumps(run, indent=1, default=str) + "\n")

    compute_dtype = jnp.bfloat16 if a.dtype == "bfloat16" else jnp.float32
    tx, schedule = make_optimizer(a.lr, a.warmup, a.total_steps, a.weight_decay, a.clip, a.schedule, a.decay_frac)
    params = init_params(cfg, jax.random.key(a.seed), jnp.float32)
    opt_state = tx.init(params)
    ck = Checkpointer(out / "ckpt")
    step, meta = 0, {"tokens": 0, "wall_s": 0.0}
    if ck.latest() is not None:
        step = ck.latest()
        params, opt_state, meta = ck.restore(step, params, opt_state)
        print(f"resumed {out} at step {step} ({meta['tokens']:,} tokens, {meta['wall_s'] / 60:.1f} min)", flush=True)
    with open(out / "commands.txt", "a") as f:  # every invocation, so resumes stay on record
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        f.write(f"{when} from step {step}: python -m ouroboros_jax.training.train {' '.join(sys.argv[1:])}\n")
    train_step, eval_step = make_steps(cfg, tx, compute_dtype)
    tokens_per_step = a.batch * a.seq_len
    print(f"{a.model}: {cfg.num_params():,} params, {tokens_per_step} tokens/step, "
          f"{run['train_tokens_per_epoch']:,} train tokens/epoch, steps {step}->{max_steps}", flush=True)

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    metrics = open(out / "metrics.jsonl", "a")

    def log(rec):
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()

    def save():
        ck.save(step, params, opt_state, {"tokens": int(meta["tokens"]), "wall_s": float(meta["wall_s"])})

    bar = None
    if not a.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=max_steps, initial=step, mininterval=20, dynamic_ncols=False, ncols=100, file=sys.stderr)
    t_start = t_ckpt = t_log = time.time()
    wall0, loss_acc, n_acc = meta["wall_s"], 0.0, 0
    tokens_at_log = meta["tokens"]
    while step < max_steps and not stop["flag"]:
        batch = jnp.asarray(packed.batch(step))
        params, opt_state, loss, gnorm = train_step(params, opt_state, batch)
        step += 1
        meta["tokens"] += tokens_per_step
        loss_acc += float(loss)
        n_acc += 1
        now = time.time()
        meta["wall_s"] = wall0 + (now - t_start)
        if step % a.log_every == 0 or step == max_steps:
            tps = (meta["tokens"] - tokens_at_log) / max(now - t_log, 1e-9)
            rec = {"step": step, "loss": loss_acc / n_acc, "grad_norm": float(gnorm), "lr": float(schedule(step)),
                   "tokens": meta["tokens"], "tokens_per_s": tps, "wall_s": meta["wall_s"]}
            log(rec)
            if bar is not None:
                bar.set_postfix_str(f"loss {rec['loss']:.3f} tok/s {tps:,.0f}", refresh=False)
                bar.update(step - bar.n)
            else:
                print(json.dumps(rec), flush=True)
            loss_acc, n_acc, t_log, tokens_at_log = 0.0, 0, now, meta["tokens"]
        if step % a.eval_every == 0 or step == max_steps:
            hl = heldout_loss(eval_step, params, held, a.eval_windows)
            log({"step": step, "heldout_loss": hl, "tokens": meta["tokens"], "wall_s": meta["wall_s"]})
            print(f"\nstep {step}: held-out loss {hl:.4f} nats/token ({meta['tokens']:,} tokens, "
                  f"{meta['wall_s'] / 60:.1f} min)", flush=True)
            t_log = time.time()  # evaluation time is not training throughput
        if a.max_minutes is not None and now - t_start > a.max_minutes * 60:
            break
        if now - t_ckpt > a.ckpt_minutes * 60:
            save()
            t_ckpt = time.time()
    save()
    if bar is not None:
        bar.close()
    print(f"saved step {step} to {out / 'ckpt'}", flush=True)
    return {"step": step, "params": params, "config": cfg, "meta": meta}


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    main()
