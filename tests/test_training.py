"""Training pipeline: manifest determinism, packing, a few steps lower the loss, checkpoint
resume, report measures, and (once shipped) the demo pair against its provenance."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax.training import corpus, data, report
from ouroboros_jax.training.train import Checkpointer, make_optimizer, make_steps, model_config
from ouroboros_jax.models.llama import init_params



def test_manifest_deterministic(tmp_path):
    a, b = corpus.build_manifest(), corpus.build_manifest()
    assert a["files_hash"] == b["files_hash"] and a["files"] == b["files"]
    paths = [f["path"] for f in a["files"]]
    assert paths == sorted(paths) and len(paths) > 500
    assert not any("site-packages" in p or "__pycache__" in p for p in paths)
    held = sum(f["split"] == "heldout" for f in a["files"]) / len(paths)
    assert 0.005 < held < 0.05
    corpus.save_manifest(a, tmp_path / "m.json")
    assert corpus.load_manifest(tmp_path / "m.json")["files_hash"] == a["files_hash"]
    m = json.loads((tmp_path / "m.json").read_text())
    m["files"][0]["sha256"] = "0" * 64
    (tmp_path / "m.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="files_hash"):
        corpus.load_manifest(tmp_path / "m.json")


def test_split_is_by_path():
    assert corpus.split_of("stdlib", "os.py") == corpus.split_of("stdlib", "os.py")
    splits = {corpus.split_of("stdlib", f"m{i}.py") for i in range(2000)}
    assert splits == {"train", "heldout"}


def test_packing_deterministic_and_resumable():
    stream = np.arange(1000, dtype=np.uint16)
    p = data.Packed(stream, seq_len=16, batch_size=4, seed=3)
    b = p.batch(5)
    assert b.shape == (4, 17) and b.dtype == np.int32
    assert np.all(np.diff(b, axis=1) == 1)  # contiguous windows of the stream
    q = data.Packed(stream, seq_len=16, batch_size=4, seed=3)
    assert np.array_equal(q.batch(5), b)  # batch k depends only on (seed, k)
    epoch0 = np.concatenate([p.batch(k)[:, 0] for k in range(p.batches_per_epoch)])
    assert len(set(epoch0.tolist())) == len(epoch0)  # no window twice within an epoch


def test_encode_stream_wraps_documents():
    class Tok:
        def encode_batch(self, texts, add_special_tokens):
            return [type("E", (), {"ids": [10 + len(t)]})() for t in texts]

    s = data.encode_stream(["a", "bb"], Tok())
    assert s.tolist() == [1, 11, 2, 1, 12, 2]


def _tiny_setup(vocab=64):
    cfg = model_config("tiny", vocab_size=vocab, max_positions=64)
    tx, _ = make_optimizer(1e-2, warmup=2, total_steps=40)
    params = init_params(cfg, jax.random.key(0))
    return cfg, tx, params, tx.init(params)


def test_few_steps_lower_the_loss():
    cfg, tx, params, opt = _tiny_setup()
    rng = np.random.default_rng(0)
    pattern = rng.integers(3, 64, size=24)
    stream = np.tile(pattern, 60).astype(np.uint16)  # a learnable periodic "document"
    p = data.Packed(stream, seq_len=32, batch_size=4)
    train_step, eval_step = make_steps(cfg, tx, jnp.bfloat16)
    first = float(eval_step(params, jnp.asarray(p.batch(0))))
    for k in range(25):
        params, opt, loss, gnorm = train_step(params, opt, jnp.asarray(p.batch(k)))
        assert np.isfinite(float(loss)) and np.isfinite(float(gnorm))
    last = float(eval_step(params, jnp.asarray(p.batch(0))))
    assert params["embed"].dtype == jnp.float32  # fp32 master weights under bf16 compute
    assert last < first - 1.0, (first, last)


def test_checkpoint_round_trip(tmp_path):
    cfg, tx, params, opt = _tiny_setup()
    ck = Checkpointer(tmp_path / "ckpt")
    ck.save(7, params, opt, {"tokens": 123, "wall_s": 4.5})
    assert ck.latest() == 7
    zeros = jax.tree.map(jnp.zeros_like, params)
    p2, o2, meta = Checkpointer(tmp_path / "ckpt").restore(7, zeros, tx.init(zeros))
    assert meta == {"tokens": 123, "wall_s": 4.5}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_repetition_measures():
    assert report.repeated_ngram_share(list(range(40))) == 0.0
    assert report.repeated_ngram_share([5] * 40) == pytest.approx(32 / 33)
    assert report.short_loop([1, 2, 3] + [7, 8] * 20) == 2
    assert report.short_loop([1, 2, 3] + [9] * 30) == 1
    assert report.short_loop(list(range(50))) == 0


def test_cached_greedy_matches_uncached_reference():
    cfg, _, params, _ = _tiny_setup()
    prompts = [[1, 5, 6, 7, 8, 9], [1, 9, 10], [1, 3]]
    ref = report.greedy_continue(params, cfg, prompts, 12)
    assert report.greedy_continue_cached(params, cfg, prompts, 12) == ref
    assert report.teacher_forced_mismatches(params, cfg, prompts, ref) == 0


def test_speculative_reference_loop_accepts_everything_for_identical_models():
    cfg, _, params, _ = _tiny_setup()
    prompts = [[1, 5, 6, 7], [1, 9, 10]]
    conts = report.greedy_continue(params, cfg, prompts, 20)
    assert all(len(c) == 20 for c in conts)
    acc = report.speculative_acceptance(params, cfg, prompts, conts, gamma=8)
    # 20 tokens = 8 accepted + 1, 8 + 1, then 2 left: the last round accepts what remains
    for row in acc:
        assert row[:2] == [8, 8] and sum(a + 1 for a in row) >= 20


def test_bf16_export_loads_in_transformers_with_matching_logits(tmp_path):
    """The export path the demo pair ships through: bf16 HF directory, loaded by transformers
    and by load_model in fp32, logits agreeing to 1e-4. (Tests of the shipped files themselves
    belong here once the pair passes its gates and ships.)"""
    from ouroboros_jax.models.loading import save_hf_checkpoint
    from ouroboros_jax.training.export import check_transformers

    cfg, _, params, _ = _tiny_setup()
    save_hf_checkpoint(str(tmp_path), cfg, params, dtype="bfloat16")
    assert check_transformers(tmp_path, rtol=1e-4) <= 1e-4


def test_repeat_mask_flags_tokens_inside_repeated_ngrams():
    from ouroboros_jax.training.tokenizer import EOS_ID
    from ouroboros_jax.training.unlikelihood import repeat_mask

    # 3-grams: (7,8,9) occurs at 0 and again at 4 -> tokens 4..6 flagged; nothing else repeats
    row = [7, 8, 9, 5, 7, 8, 9, 6, 10, 11]
    m = repeat_mask(np.asarray([row]), 3)
    assert m[0].tolist() == [False] * 4 + [True] * 3 + [False] * 3
    # a one-token loop: everything from the second 3-gram on is flagged
    assert repeat_mask(np.asarray([[4] * 8]), 3)[0].tolist() == [False] + [True] * 7
    # the whole row counts, as in the report's measure; file ends are negatives of their own
    from ouroboros_jax.training.unlikelihood import negatives

    after = np.asarray([[7, 8, 9, EOS_ID, 7, 8, 9, 7, 8, 9]])
    assert repeat_mask(after, 3)[0].tolist() == [False] * 4 + [True] * 6
    assert negatives(after, 3)[0].tolist() == [False] * 3 + [True] * 7


def test_unlikelihood_steps_push_down_the_flagged_tokens_only():
    from ouroboros_jax.training.unlikelihood import make_ul_step, unlikelihood_loss

    cfg, tx, params, opt = _tiny_setup()
    rng = np.random.default_rng(1)
    toks = jnp.asarray(rng.integers(3, 64, size=(2, 16)), jnp.int32)
    flagged = np.zeros((2, 15), bool)
    flagged[:, 8:] = True

    def target_probs(p):
        from ouroboros_jax.models.llama import causal_mask, forward

        logits, _ = forward(p, cfg, toks[:, :-1], jnp.broadcast_to(jnp.arange(15), (2, 15)), causal_mask(2, 15))
        lp = jax.nn.log_softmax(logits, axis=-1)
        return np.exp(np.asarray(jnp.take_along_axis(lp, toks[:, 1:, None], axis=-1)[..., 0]))

    before = target_probs(params)
    l0 = float(unlikelihood_loss(params, cfg, toks, jnp.asarray(flagged), jnp.float32))
    # -log(1 - p) summed over flagged positions, per row
    assert l0 == pytest.approx(float(-np.log1p(-before[flagged]).sum() / 2), rel=1e-4)
    step = make_ul_step(cfg, tx, jnp.float32)
    p2, o2 = params, opt
    for _ in range(10):
        p2, o2, loss = step(p2, o2, toks, jnp.asarray(flagged))
    after = target_probs(p2)
    assert np.all(after[flagged] < before[flagged])
    assert float(unlikelihood_loss(p2, cfg, toks, jnp.asarray(flagged), jnp.float32)) < l0
