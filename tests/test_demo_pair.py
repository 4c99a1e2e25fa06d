"""The shipped demo pair (`ouroboros_jax/assets/demo`): its files agree with their provenance,
both members load in JAX and in transformers with the same logits, and Ouroboros on it does what
the stats claim (issue 5's demo-pair checks)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ouroboros_jax as oj
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.models.llama import causal_mask, forward
from ouroboros_jax.training import corpus
from ouroboros_jax.demo_assets import DEMO_DIR, demo_prompts, demo_provenance
from ouroboros_jax.training.tokenizer import BOS_ID


@pytest.fixture(scope="module")
def pair():
    return oj.demo_pair()


def test_manifest_matches_provenance():
    manifest = corpus.load_manifest(DEMO_DIR / "manifest.json")  # re-hashes its file list
    prov = demo_provenance()
    assert prov["manifest_files_hash"] == manifest["files_hash"]
    assert prov["python"] == manifest["python"]
    held = {f["path"] for f in manifest["files"] if f["split"] == "heldout"}
    train = {f["path"] for f in manifest["files"] if f["split"] == "train"}
    assert held and train and not held & train
    # the demo prompts come from held-out files only, never from training text
    prompts = demo_prompts()
    assert prompts and all(p["file"] in held for p in prompts)
    # the figures in provenance are the ones the gates were checked on
    r = prov["report"]
    assert r["passed"]
    assert r["target"]["loss_per_token"] <= r["draft"]["loss_per_token"] - 0.25
    assert r["continuations"]["mean_repeat8"] <= 0.20
    assert r["continuations"]["short_loops"] == 0
    md = (DEMO_DIR / "PROVENANCE.md").read_text()
    assert manifest["files_hash"] in md


def test_pair_sizes_and_budget():
    prov = demo_provenance()
    t, d = prov["target"]["num_params"], prov["draft"]["num_params"]
    assert 20e6 <= t <= 40e6 and d <= t / 4
    size = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert size <= 80e6


@pytest.mark.parametrize("member", ["target", "draft"])
def test_jax_and_transformers_logits_match(pair, member):
    m = pair[0] if member == "target" else pair[1]
    ids = np.random.default_rng(1).integers(3, m.config.vocab_size, size=(2, 96)).astype(np.int32)
    pos = jnp.broadcast_to(jnp.arange(96, dtype=jnp.int32)[None], (2, 96))
    ours = np.asarray(forward(m.params, m.config, jnp.asarray(ids), pos, causal_mask(2, 96))[0])
    hf = AutoModelForCausalLM.from_pretrained(str(DEMO_DIR / member), dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.from_numpy(ids.astype(np.int64))).logits.numpy()
    assert np.abs(theirs - ours).max() / np.abs(ours).max() <= 1e-4


def test_tokenizer_loads_in_transformers_and_round_trips():
    tok = AutoTokenizer.from_pretrained(str(DEMO_DIR / "target"))
    text = 'def f(x):\n    """Rückgabe: x² — «ok» 🙂"""\n\treturn x ** 2\n'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.bos_token_id == BOS_ID


def test_ouroboros_stats_on_the_demo_pair(pair):
    """On real code with a trained pair: the tokens are vanilla's; new tokens are the sum of
    tokens accepted per round; phrase drafting gives c > 1 (more than one draft token per draft
    forward) and lengthening gets pool suffix tokens accepted."""
    target, draft = pair
    prompts = [p["text"] for p in demo_prompts()[:2]]
    kw = dict(max_new_tokens=64, eos_token_id=-1)
    ref = oj.generate(target, prompts, **kw)
    cfg = OuroborosConfig(gamma=6, window=6, ngram=4, guesses=6, suffixes=3)
    out = oj.generate(target, prompts, draft=draft, method="ouroboros", config=cfg, **kw)
    assert out.tokens == ref.tokens
    s = out.stats
    hist = s["acceptance_histogram"]
    assert s["new_tokens"] == 2 * 64 == sum(k * c for k, c in enumerate(hist))
    assert s["c"] > 1.0
    assert s["suffix_tokens_accepted"] > 0
    assert s["eta"] > 1.5  # a trained pair on code: the target accepts several tokens a call
    # lengthening off: no suffix can be accepted, the same tokens come out
    off = oj.generate(target, prompts, draft=draft, method="ouroboros",
                      config=OuroborosConfig(gamma=6, window=6, ngram=4, guesses=6, suffixes=3,
                                             lengthening=False), **kw)
    assert off.tokens == ref.tokens and off.stats["suffix_tokens_accepted"] == 0
    json.dumps(s)  # stats are plain JSON-ready values


def test_distilled_draft_figures_reproduce(pair):
    """The shipped draft was distilled from the target (issue 11): its provenance records the
    agreement and speculative figures before and after, and they reproduce here on the shipped
    held-out prompts: teacher-forced agreement with the target's greedy continuations, and
    greedy speculative decoding at gamma 4 (tokens identical to vanilla's, eta as predicted
    by the agreement)."""
    from ouroboros_jax.training import distill

    prov = demo_provenance()
    g = prov["distillation_gates"]
    before, after = g["before"], g["after"]
    assert after["top1_agreement"] > before["top1_agreement"] + 0.1
    assert after["sd_gamma4_measured_eta"] > before["sd_gamma4_measured_eta"]
    d = prov["draft"]["distillation"]
    assert d["init_model_sha256"] == prov["draft_before_distillation"]["model_sha256"]
    assert d["steps"] > 0 and d["tokens"] > 0
    target, draft = pair
    prompts = [[BOS_ID] + target.tokenizer(p["text"], add_special_tokens=False)["input_ids"]
               for p in demo_prompts()]
    conts = oj.generate(target, prompts, max_new_tokens=distill.EVAL_NEW_TOKENS).tokens
    r = distill.agreement_report(draft.params, draft.config, prompts, conts)
    assert r["top1_agreement"] == pytest.approx(after["top1_agreement"], abs=0.01)
    sd = oj.generate(target, prompts[:6], draft=draft, method="speculative",
                     config=oj.SpeculativeConfig(gamma=4), max_new_tokens=distill.EVAL_NEW_TOKENS)
    assert sd.tokens == conts[:6]
    m = distill.teacher_forced_matches(draft.params, draft.config, prompts[:6], conts[:6])
    assert sd.stats["eta"] == pytest.approx(distill.sd_tokens_per_round(m, 4), rel=0.02)
