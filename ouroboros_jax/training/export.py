"""Export a trained pair to Hugging Face layout, check it, and ship it only if it passes the gates.

    python -m ouroboros_jax.training.export --target runs/target --draft runs/draft

1. writes bf16 `config.json` + `model.safetensors` + tokenizer files of both models to a staging
   directory (`--stage`, default runs/export);
2. checks that transformers' `AutoModelForCausalLM` loads each and matches the JAX logits;
3. runs the pair quality report on the staged (bf16) weights, i.e. on exactly what ships;
4. if every gate passes, copies both into `--out` (default ouroboros_jax/assets/demo) with the
   corpus manifest, the held-out demo prompts, `provenance.json` and `PROVENANCE.md`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from ouroboros_jax.models.llama import causal_mask, forward
from ouroboros_jax.models.loading import load_model, save_hf_checkpoint
from ouroboros_jax.training import corpus, report
from ouroboros_jax.training.tokenizer import load_tokenizer
from ouroboros_jax.training.train import restore_params

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "assets" / "demo"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def stage_member(run_dir: Path, tokenizer_dir: Path, out: Path) -> dict:
    cfg, params, meta = restore_params(run_dir)
    if out.exists():
        shutil.rmtree(out)
    save_hf_checkpoint(str(out), cfg, params, dtype="bfloat16")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    run = json.loads((run_dir / "run.json").read_text())
    cmds = (run_dir / "commands.txt").read_text().splitlines() if (run_dir / "commands.txt").exists() else []
    return {"run": str(run_dir), "invocations": cmds, "step": meta["step"], "train_tokens": meta["tokens"], "wall_s": meta["wall_s"],
            "args": run["args"], "num_params": cfg.num_params(),
            # {"from_step", "steps", "flagged_tokens"} when unlikelihood.py fine-tuned this member
            "unlikelihood": meta.get("unlikelihood")}


def check_transformers(hf_dir: Path, rtol: float = 1e-4) -> float:
    """Max |logits_hf - logits_jax| / max|logits_jax| in fp32 on a fixed 200-token sequence."""
    import torch
    from transformers import AutoModelForCausalLM

    m = load_model(str(hf_dir), "float32")
    ids = np.random.default_rng(0).integers(3, m.config.vocab_size, size=(1, 200)).astype(np.int32)
    import jax.numpy as jnp

    pos = jnp.arange(200, dtype=jnp.int32)[None]
    ours = np.asarray(forward(m.params, m.config, jnp.asarray(ids), pos, causal_mask(1, 200))[0])
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    err = float(np.abs(theirs - ours).max() / np.abs(ours).max())
    if err > rtol:
        raise SystemExit(f"{hf_dir}: transformers and JAX logits differ (relative error {err:.2e})")
    return err


def provenance_md(p: dict) -> str:
    r = p["report"]
    lines = [
        "# Demo pair provenance", "",
        "Trained by `ouroboros_jax.training` on the Python standard library of the machine that built",
        f"it (Python {p['python']}); corpus manifest: `manifest.json`, files hash `{p['manifest_files_hash']}`.",
        "The held-out files (split by a hash of the path) were never trained on; `prompts.json` comes from them.", "",
        "| | target | draft |", "|---|---|---|",
    ]
    t, d = p["target"], p["draft"]
    rows = [
        ("parameters", f"{t['num_params']:,}", f"{d['num_params']:,}"),
        ("training tokens seen", f"{t['train_tokens']:,}", f"{d['train_tokens']:,}"),
        ("training wall time", f"{t['wall_s'] / 3600:.2f} h", f"{d['wall_s'] / 3600:.2f} h"),
        ("held-out loss (nats/token)", f"{r['target']['loss_per_token']:.4f}", f"{r['draft']['loss_per_token']:.4f}"),
        ("held-out bits per byte", f"{r['target']['bits_per_byte']:.4f}", f"{r['draft']['bits_per_byte']:.4f}"),
    ]
    ul = lambda m: (f"{m['unlikelihood']['steps']} updates from step {m['unlikelihood']['from_step']}"
                    if m.get("unlikelihood") else "none")
    rows.append(("unlikelihood fine-tuning (half MLE)", ul(t), ul(d)))
    dd = d.get("distillation")
    if dd:
        rows.append(("distilled from the target (KL + CE)", "–",
                     f"{dd['steps']} updates, {dd['tokens']:,} tokens, {dd['wall_s'] / 3600:.2f} h"))
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    c, sp = r["continuations"], r["speculative"]
    lines += [
        "", f"- draft/target greedy top-1 agreement on held-out code: {r['top1_agreement']:.3f}",
        f"- greedy speculative decoding, gamma = {sp['gamma']}: {sp['mean_accepted_per_round']:.2f} accepted draft tokens per round",
        f"- target greedy {c['new_tokens']}-token continuations of {c['prompts']} held-out prompts: "
        f"{c['mean_repeat8']:.3f} repeated 8-grams on average (max {c['max_repeat8']:.3f}), "
        f"{c['short_loops']} one/two-token loops, {c['restarts']} restarts",
    ]
    g = p.get("distillation_gates")
    if g:
        b, a = g["before"], g["after"]
        lines += [
            "", "## Distilled draft (issue 11)", "",
            f"Measured on {g['prompts']}:", "",
            "| | draft before | distilled draft | gate |", "|---|---:|---:|---|",
            f"| top-1 agreement with the target's greedy continuations (teacher-forced) | "
            f"{b['top1_agreement']:.3f} | {a['top1_agreement']:.3f} | >= 0.75: "
            f"{'met' if g['gates']['agreement>=0.75'] else 'not met'} |",
            f"| greedy SD tokens per target forward, gamma 4 (measured eta) | "
            f"{b['sd_gamma4_measured_eta']:.2f} | {a['sd_gamma4_measured_eta']:.2f} | >= 2.8: "
            f"{'met' if g['gates']['sd_gamma4>=2.8'] else 'not met'} |",
            f"| same, predicted from the agreement | {b['sd_tokens_per_round_gamma4']:.2f} | "
            f"{a['sd_tokens_per_round_gamma4']:.2f} | |",
            "", "Speculative decoding's tokens were identical to vanilla's for both drafts.",
        ]
    lines += [
        "", "## Commands", "", "```",
        *p["commands"], "```", "",
    ]
    return "\n".join(lines)


def command_of(member: dict) -> str:
    a = member["args"]
    skip = {"no_progress", "max_steps", "max_minutes"}
    parts = [f"--{k.replace('_', '-')} {v}" for k, v in a.items() if k not in skip and v is not None and v is not False]
    return "python -m ouroboros_jax.training.train " + " ".join(parts)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="runs/target")
    ap.add_argument("--draft", default="runs/draft")
    ap.add_argument("--manifest", default="runs/corpus/manifest.json")
    ap.add_argument("--tokenizer", default="runs/tokenizer")
    ap.add_argument("--stage", default="runs/export")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--prompts", type=int, default=24)
    a = ap.parse_args(argv)
    stage = Path(a.stage)
    members = {}
    for name in ("target", "draft"):
        members[name] = stage_member(Path(getattr(a, name)), Path(a.tokenizer), stage / name)
        err = check_transformers(stage / name)
        print(f"{name}: staged step {members[name]['step']} in {stage / name}; transformers logits match (rel. err {err:.1e})", flush=True)
    ra = report.parse_args(["--target", str(stage / "target"), "--draft", str(stage / "draft"),
                            "--manifest", a.manifest, "--tokenizer", a.tokenizer, "--prompts", str(a.prompts)])
    r = report.run_report(ra)
    (stage / "report.json").write_text(json.dumps(r, indent=1) + "\n")
    print(report.summary(r), flush=True)
    if not r["passed"]:
        print(f"gates not met: nothing shipped (staged pair and report in {stage})", file=sys.stderr)
        sys.exit(1)

    manifest = corpus.load_manifest(a.manifest)
    out = Path(a.out)
    for name in ("target", "draft"):
        if (out / name).exists():
            shutil.rmtree(out / name)
        shutil.copytree(stage / name, out / name)
    shutil.copy(a.manifest, out / "manifest.json")
    prompts = report.heldout_prompts(manifest, load_tokenizer(a.tokenizer), a.prompts)
    (out / "prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    prov = {
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": manifest["python"], "manifest_files_hash": manifest["files_hash"],
        "target": {k: v for k, v in members["target"].items() if k != "args"},
        "draft": {k: v for k, v in members["draft"].items() if k != "args"},
        "commands": [
            f"python -m ouroboros_jax.training.corpus --out {a.manifest}",
            f"python -m ouroboros_jax.training.tokenizer --manifest {a.manifest} --out {a.tokenizer}",
            *(members["target"]["invocations"] or [command_of(members["target"])]),
            *(members["draft"]["invocations"] or [command_of(members["draft"])]),
            "python -m ouroboros_jax.training.export --target {} --draft {}".format(a.target, a.draft),
        ],
        "report": {k: v for k, v in r.items() if k != "samples"},
    }
    (out / "provenance.json").write_text(json.dumps(prov, indent=1) + "\n")
    (out / "PROVENANCE.md").write_text(provenance_md(prov))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"shipped to {out} ({size / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
