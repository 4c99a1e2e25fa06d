"""Ship a distilled draft as the demo draft, after checking it.

    python -m ouroboros_jax.training.ship_draft --run runs/distill

1. takes `<run>/hf` (the draft `ouroboros-jax distill` wrote, bf16) and checks that transformers
   loads it with the same logits as JAX;
2. measures, on the shipped held-out prompts (`assets/demo/prompts.json`), the gates of issue 11:
   top-1 agreement with the target's greedy 128-token continuations (teacher-forced) and greedy
   speculative decoding's tokens per target forward at gamma 4, both for the draft shipped now
   and for the new one, and checks the latter against `oj.generate(method="speculative")`;
3. reruns the pair report (issue 3's gates) on the new pair;
4. ships only if the new draft agrees more than the old one and the pair gates pass: copies it
   over `assets/demo/draft` and rewrites `provenance.json` / `PROVENANCE.md` with the
   distillation's commands and figures (issue 11's gates recorded as met or not).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import shutil
import sys
from pathlib import Path

from ouroboros_jax.generate import generate
from ouroboros_jax.training import distill, export, report

GATE_AGREEMENT = 0.75
GATE_SD_GAMMA4 = 2.8


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pair_figures(target, draft_dir: str, prompts: list[list[int]], conts: list[list[int]]) -> dict:
    """Teacher-forced agreement and the SD tokens/forward it implies, plus the measured eta of
    greedy speculative decoding (gamma 4) over the same prompts."""
    import ouroboros_jax as oj

    d = oj.load_model(draft_dir, "float32")
    r = distill.agreement_report(d.params, d.config, prompts, conts)
    out = oj.generate(target, prompts, draft=d, method="speculative", config=oj.SpeculativeConfig(gamma=4),
                      max_new_tokens=distill.EVAL_NEW_TOKENS)
    if out.tokens != conts:
        raise SystemExit("speculative decoding's tokens differ from vanilla's: not shipping")
    r["sd_gamma4_measured_eta"] = out.stats["eta"]
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="the distillation run directory (with hf/)")
    ap.add_argument("--demo", default=str(export.DEFAULT_OUT))
    ap.add_argument("--manifest", default="runs/corpus/manifest.json")
    ap.add_argument("--stage", default="runs/ship_draft")
    a = ap.parse_args(argv)
    import ouroboros_jax as oj
    run, demo, stage = Path(a.run), Path(a.demo), Path(a.stage)
    if not (run / "hf" / "model.safetensors").exists():
        raise SystemExit(f"--run {run}: no hf/model.safetensors (run `ouroboros-jax distill` to the end first)")
    if stage.exists():
        shutil.rmtree(stage)
    shutil.copytree(run / "hf", stage / "draft")
    err = export.check_transformers(stage / "draft")
    print(f"staged {stage / 'draft'}; transformers logits match (rel. err {err:.1e})", flush=True)

    target = oj.load_model(str(demo / "target"), "float32")
    tok = target.tokenizer
    prompts = [[target.config.bos_token_id] + tok(p["text"], add_special_tokens=False)["input_ids"]
               for p in json.loads((demo / "prompts.json").read_text())]
    conts = generate(target, prompts, method="vanilla", max_new_tokens=distill.EVAL_NEW_TOKENS).tokens
    before = pair_figures(target, str(demo / "draft"), prompts, conts)
    after = pair_figures(target, str(stage / "draft"), prompts, conts)
    for name, f in (("shipped draft", before), ("distilled draft", after)):
        print(f"{name}: agreement {f['top1_agreement']:.3f}, SD gamma 4 {f['sd_tokens_per_round_gamma4']:.2f} "
              f"tokens/forward (measured eta {f['sd_gamma4_measured_eta']:.2f})", flush=True)
    gates = {"agreement>=0.75": after["top1_agreement"] >= GATE_AGREEMENT,
             "sd_gamma4>=2.8": after["sd_gamma4_measured_eta"] >= GATE_SD_GAMMA4,
             "identical_to_vanilla": True}

    tok_dir = demo / "target"
    ra = report.parse_args(["--target", str(demo / "target"), "--draft", str(stage / "draft"),
                            "--manifest", a.manifest, "--tokenizer", str(tok_dir)])
    r = report.run_report(ra)
    print(report.summary(r), flush=True)
    if not r["passed"] or after["top1_agreement"] <= before["top1_agreement"]:
        print(f"not shipped: pair gates {'pass' if r['passed'] else 'FAIL'}, agreement "
              f"{before['top1_agreement']:.3f} -> {after['top1_agreement']:.3f}", file=sys.stderr)
        sys.exit(1)

    prov = json.loads((demo / "provenance.json").read_text())
    old_sha = file_sha256(demo / "draft" / "model.safetensors")
    dist_run = json.loads((run / "run.json").read_text())
    dist_rep = json.loads((run / "report.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "kl" in m]
    invocations = (run / "commands.txt").read_text().splitlines()
    prov["draft_before_distillation"] = dict(prov["draft"], model_sha256=old_sha)
    prov["draft"] = dict(prov["draft"], num_params=dist_run["num_params"], distillation={
        "init_model_sha256": old_sha, "steps": dist_rep["step"],
        "tokens": trained[-1]["tokens"] if trained else 0,
        "wall_s": max((m.get("wall_s", 0) for m in metrics), default=0),
        "invocations": invocations, "args": dist_run["args"],
        "heldout_curve": [{"step": m["step"], "top1_agreement": m["top1_agreement"]}
                          for m in metrics if "top1_agreement" in m],
    })
    prov["distillation_gates"] = {"before": before, "after": after, "gates": gates,
                                  "prompts": "assets/demo/prompts.json (held-out), 128 greedy tokens each"}
    prov["commands"] = prov["commands"] + [
        f"# distillation (the --init draft is the one shipped before, sha256 {old_sha[:16]}...)",
        *[line.split(": ", 1)[1] if ": " in line else line for line in invocations],
        f"python -m ouroboros_jax.training.ship_draft --run {a.run}",
    ]
    prov["report"] = {k: v for k, v in r.items() if k != "samples"}
    prov["updated"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    shutil.rmtree(demo / "draft")
    shutil.copytree(stage / "draft", demo / "draft")
    (demo / "provenance.json").write_text(json.dumps(prov, indent=1) + "\n")
    (demo / "PROVENANCE.md").write_text(export.provenance_md(prov))
    print(f"shipped the distilled draft to {demo / 'draft'}; issue 11 gates: "
          + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in gates.items()))


if __name__ == "__main__":
    main()
