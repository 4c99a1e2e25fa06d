"""Distillation (training/distill.py) on tiny random models with a real byte-level tokenizer:
the KL to the target falls, held-out agreement rises, a resumed run continues the same run,
the agreement measure predicts greedy speculative decoding's eta, and bad flags are refused."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.training import distill
from ouroboros_jax.training.tokenizer import save_hf_tokenizer, train_tokenizer

from conftest import make_hf_model

# Text with structure (Python source of the standard library), enough for a 300-token BPE.
_SRC = [Path(json.__file__).parent / n for n in ("encoder.py", "decoder.py", "scanner.py", "__init__.py")]


@pytest.fixture(scope="session")
def distill_setup(tmp_path_factory):
    """(target dir, draft dir, data dir) over one trained 300-token byte-level tokenizer.

    The target's next token depends mostly on the current one (large random embeddings and LM
    head, layers at their small HF init): a function a 1-layer draft can learn in a few dozen
    updates, whereas a random transformer's next-token map is too chaotic to learn in a test.
    The draft starts from its own random init (agreement near chance)."""
    import torch

    root = tmp_path_factory.mktemp("distill")
    data = root / "data"
    data.mkdir()
    texts = [p.read_text() for p in _SRC]
    for i, t in enumerate(texts * 3):  # 12 documents; the held-out split is by name hash
        (data / f"doc{i}.py").write_text(t)
    tok = train_tokenizer(texts, vocab_size=300)
    V = tok.get_vocab_size()
    target, draft = root / "target", root / "draft"
    m = make_hf_model(target, vocab=V, hidden=64, layers=2, heads=4, kv_heads=2, inter=128, seed=11, scale=0.0)
    torch.manual_seed(5)
    with torch.no_grad():
        m.model.embed_tokens.weight.normal_(0, 1.0)
        m.lm_head.weight.normal_(0, 0.5)
    m.save_pretrained(target)
    make_hf_model(draft, vocab=V, hidden=32, layers=1, heads=2, kv_heads=1, inter=64, seed=12, scale=0.0)
    for d in (target, draft):
        save_hf_tokenizer(tok, d)
    return str(target), str(draft), str(data)


def _args(setup, out, *extra):
    target, draft, data = setup
    return ["--target", target, "--init", draft, "--data", data, "--out", str(out), "--batch", "8",
            "--seq-len", "64", "--prompt-tokens", "16", "--new-tokens", "32", "--gen-batch", "16",
            "--gen-micro-batch", "16", "--eval-count", "8", "--lr", "1e-2", "--warmup", "2",
            "--log-every", "1", "--no-progress", *extra]


def _metrics(out):
    return [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_kl_falls_and_heldout_agreement_rises(distill_setup, tmp_path):
    rep = distill.main(_args(distill_setup, tmp_path, "--steps", "30", "--eval-every", "1000"))
    m = _metrics(tmp_path)
    train = [r for r in m if "kl" in r]
    evals = [r for r in m if "top1_agreement" in r]
    assert len(train) == 30
    first = np.mean([r["kl"] for r in train[:5]])
    last = np.mean([r["kl"] for r in train[-5:]])
    assert last < 0.5 * first, (first, last)
    assert evals[0]["step"] == 0 and evals[-1].get("final")
    assert evals[0]["top1_agreement"] < 0.2 and evals[-1]["top1_agreement"] > 0.6, evals
    # the exported draft loads, with the target's tokenizer, and reproduces the final figure
    hf = rep["hf_dir"]
    d = oj.load_model(hf)
    assert d.tokenizer is not None and d.tokenizer.get_vocab() == oj.load_model(distill_setup[0]).tokenizer.get_vocab()
    run = distill.Distiller(distill.parse_args(_args(distill_setup, tmp_path / "x", "--steps", "1")))
    again = distill.agreement_report(d.params, d.config, *run.eval_set())
    assert again["top1_agreement"] == pytest.approx(rep["heldout"]["top1_agreement"], abs=1e-9)


def test_resume_continues_the_same_run(distill_setup, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    distill.main(_args(distill_setup, straight, "--steps", "6"))
    distill.main(_args(distill_setup, split, "--steps", "6", "--max-steps", "3"))
    assert max(r["step"] for r in _metrics(split)) == 3
    distill.main(_args(distill_setup, split, "--steps", "6"))
    a, b = oj.load_model(straight / "hf"), oj.load_model(split / "hf")
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    la = [r["loss"] for r in _metrics(straight) if "loss" in r]
    lb = [r["loss"] for r in _metrics(split) if "loss" in r]
    np.testing.assert_allclose(la, lb, rtol=1e-4)
    assert "from step 3" in (split / "commands.txt").read_text()


def test_sd_tokens_per_round_walk():
    m = [np.array([1, 1, 0, 1, 1, 1, 1, 1, 0], bool)]
    # rounds: 2 accepted + 1 (pos 0-2), 4 accepted + 1 (3-7), 0 + 1 (8)
    assert distill.sd_tokens_per_round(m, 4) == pytest.approx(9 / 3)
    # gamma 8: 2+1, then 5 accepted run into the end's mismatch at 8: 5+1
    assert distill.sd_tokens_per_round(m, 8) == pytest.approx(9 / 2)
    assert distill.sd_tokens_per_round([np.zeros(5, bool)], 4) == 1.0
    assert distill.sd_tokens_per_round([np.ones(10, bool)], 4) == pytest.approx(10 / 2)


def test_agreement_predicts_speculative_eta(tiny_pair, random_prompts):
    """Teacher-forced matches of the draft on the target's greedy continuation give exactly the
    tokens per round of greedy speculative decoding (the draft drafts from committed target
    tokens), so the report's figure is what `generate` will measure."""
    target, draft, _ = tiny_pair
    prompts = random_prompts[:4]
    n, gamma = 40, 3
    ref = oj.generate(target, prompts, method="vanilla", max_new_tokens=n)
    m = distill.teacher_forced_matches(draft.params, draft.config, prompts, ref.tokens)
    for p, toks, mm in zip(prompts, ref.tokens, m):
        out = oj.generate(target, [p], draft=draft, method="speculative", max_new_tokens=n,
                          config=oj.SpeculativeConfig(gamma=gamma))
        assert out.tokens[0] == toks
        assert out.stats["eta"] == pytest.approx(distill.sd_tokens_per_round([mm], gamma))


@pytest.mark.parametrize("extra, message", [
    (["--steps", "0"], "--steps must be positive"),
    (["--draft-config", '{"num_layers": 1}'], "exactly one of --init"),
    (["--corpus-share", "1.5"], "--corpus-share"),
    (["--prompt-tokens", "60", "--new-tokens", "32"], "--prompt-tokens"),
    (["--temperature", "0"], "--temperature"),
])
def test_bad_flags_are_refused_by_name(distill_setup, tmp_path, extra, message):
    with pytest.raises(SystemExit, match=message):
        distill.main(_args(distill_setup, tmp_path, *extra))
    assert not (tmp_path / "ckpt").exists()  # nothing written before the refusal


def test_draft_config_is_checked(tiny_target):
    c = tiny_target.config
    cfg = distill.draft_config_from(c, '{"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}')
    assert (cfg.hidden_size, cfg.num_layers, cfg.head_dim, cfg.vocab_size) == (32, 1, 16, c.vocab_size)
    with pytest.raises(ValueError, match="unknown field"):
        distill.draft_config_from(c, '{"hiden_size": 32}')
    with pytest.raises(ValueError, match="vocab_size"):
        distill.draft_config_from(c, f'{{"vocab_size": {c.vocab_size + 1}}}')
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        distill.draft_config_from(c, '{"num_layers": 0}')
