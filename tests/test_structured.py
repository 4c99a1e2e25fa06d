"""Structured output inside the loop (`ouroboros_jax.constrain`, `decoding/constrained.py`):
the table against hand-written automata, tree states along chains and trees, every method's
constrained greedy tokens equal to constrained vanilla's (itself checked against transformers
with the same automaton as a logits mask), sampling lossless w.r.t. the constrained
distribution, and refusals naming the field."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.constrain import ConstraintError, regex_for, stack_tables, table_for
from ouroboros_jax.constrain import device as cdev
from ouroboros_jax.constrain.table import from_transitions

from conftest import TINY_VOCAB, char_tokenizer, make_hf_model

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("outlines_core")

EOS = 2
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "ok": {"type": "boolean"},
                         "kind": {"enum": ["a", "bb"]}},
          "required": ["name", "ok", "kind"]}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
REGEX_FORMAT = {"type": "regex", "pattern": "(ab|c)+d"}
PROMPTS = ["hello", "abc def", "x"]


def json_tokenizer():
    """A character-level tokenizer over TINY_VOCAB ids that can spell JSON: 0 <pad>, 1 <s>,
    2 </s>, 3 <unk>, newline, then printable ASCII but '`', '~', '^'."""
    return char_tokenizer(["\n"] + [chr(c) for c in range(32, 127) if chr(c) not in "`~^"])


@pytest.fixture(scope="module")
def json_model(tmp_path_factory):
    """(Model, torch model): the tiny target (seed 0) with `json_tokenizer` attached."""
    d = tmp_path_factory.mktemp("json_target")
    torch_model = make_hf_model(d, seed=0)
    json_tokenizer().save_pretrained(d)
    return oj.load_model(str(d)), torch_model


@pytest.fixture(scope="module")
def json_draft(tmp_path_factory):
    """A 1-layer draft (seed 1) over the same vocabulary and tokenizer: unrelated weights, so
    its distribution differs from the target's."""
    d = tmp_path_factory.mktemp("json_draft")
    make_hf_model(d, layers=1, hidden=32, heads=2, kv_heads=1, inter=64, seed=1)
    json_tokenizer().save_pretrained(d)
    return oj.load_model(str(d))


# ------------------------------------------------------------------ the table, hand-written

# "a b* c" over tokens 0..5 (EOS 5): 0 -a-> 1, 1 -b-> 1, 1 -c-> 2 (accepting); token 3 = "bc"
# 1 -bc-> 2; token 4 never allowed
HAND = {0: {0: 1}, 1: {1: 1, 2: 2, 3: 2}}


def hand_table():
    return from_transitions(HAND, 0, [2], [5], 6)


def test_hand_table_classes_states_and_forced_tokens():
    t = hand_table()
    S, C = t.next_state.shape
    assert S == 3
    # classes: a, b, {c, bc} (identical columns), 4 (refused everywhere), EOS
    assert t.class_of[2] == t.class_of[3]
    assert len({t.class_of[i] for i in (0, 1, 2, 4, 5)}) == 5 and C == 5
    for s, row in HAND.items():
        for tok in range(6):
            want = row.get(tok, s if (s == 2 and tok == 5) else -1)
            assert t.next_state[s, t.class_of[tok]] == want
    assert t.next_state[2, t.class_of[5]] == 2  # EOS only where the text may end
    assert t.next_state[1, t.class_of[5]] == -1
    assert list(t.n_allowed) == [1, 3, 1] and list(t.forced_token) == [0, -1, 5]


def reference_states(root, parents, tokens):
    """The state at every node by a plain walk of HAND (-1: left the language)."""
    out = []
    for i, p in enumerate(parents):
        if p < 0:
            out.append(root)
            continue
        s = out[p]
        out.append(-1 if s < 0 else (HAND.get(s, {}).get(tokens[i], s if s == 2 and tokens[i] == 5
                                                         else -1)))
    return out


def test_tree_states_mask_and_advance_follow_the_automaton_along_chains_and_trees():
    rc = stack_tables([hand_table(), None, hand_table()], 6)
    parents = np.array([-1, 0, 1, 1, 0, 4, 2], np.int32)  # a chain and two branches
    tokens = np.array([[9, 0, 1, 2, 4, 0, 3],     # root state 0: a, a-b, a-c; 4 refused
                       [9, 4, 4, 4, 4, 4, 4],     # unconstrained: everything allowed
                       [9, 1, 3, 2, 5, 0, 1]], np.int32)  # root state 1: b, b-bc, b-c, EOS
    roots = np.array([0, 0, 1], np.int32)
    st = np.asarray(cdev.tree_states(rc, jnp.asarray(roots), parents, jnp.asarray(tokens) % 6))
    for b in (0, 2):
        want = reference_states(int(roots[b]), parents, list(tokens[b] % 6))
        assert st[b].tolist() == want
    assert st[1].tolist() == [0] * 7
    allowed = np.asarray(cdev.allowed_mask(rc, jnp.asarray(st)))
    for b in (0, 2):
        for i in range(7):
            s = st[b, i]
            want = ([True] * 6 if s < 0 else
                    [HAND.get(s, {}).get(t, s if (s == 2 and t == 5) else -1) >= 0
                     for t in range(6)])
            assert allowed[b, i].tolist() == want
    assert allowed[1].all()
    # advance along [a, b, c, EOS] for 4 tokens: a and EOS were forced, b and c were not
    seqs = jnp.asarray([[0, 1, 2, 5], [0, 1, 2, 5], [0, 1, 2, 5]], jnp.int32)
    state, forced = cdev.advance(rc, jnp.zeros((3,), jnp.int32), seqs, jnp.asarray([4, 4, 2]))
    assert np.asarray(state).tolist() == [2, 0, 1]
    assert np.asarray(forced).tolist() == [2, 0, 1]


def test_outlines_table_accepts_exactly_the_regex():
    import re

    tok = json_tokenizer()
    t = table_for(REGEX_FORMAT, tok, TINY_VOCAB, [EOS])
    assert t is table_for(REGEX_FORMAT, tok, TINY_VOCAB, [EOS])  # cached
    rng = np.random.RandomState(0)
    alphabet = "abcdx"
    for _ in range(200):
        text = "".join(rng.choice(list(alphabet), size=rng.randint(1, 7)))
        s = 0
        for ch in text:
            s = -1 if s < 0 else int(t.next_state[s, t.class_of[tok.convert_tokens_to_ids(ch)]])
        accepted = s >= 0 and bool(t.accepting[s])
        assert accepted == bool(re.fullmatch(REGEX_FORMAT["pattern"], text)), text


# ---------------------------------------------------------------------------- exactness


def masked_greedy_reference(torch_model, table, prompt_ids, max_new):
    """Greedy decoding with transformers, the table's allowed tokens as a logits mask: the
    peer's way (a host-side logits processor over the same automaton)."""
    import torch

    ids, s, out = list(prompt_ids), 0, []
    for _ in range(max_new):
        with torch.no_grad():
            logits = torch_model(torch.tensor([ids])).logits[0, -1].numpy()
        allowed = table.next_state[s][table.class_of] >= 0
        tok = int(np.argmax(np.where(allowed, logits, -np.inf)))
        out.append(tok)
        if tok == EOS:
            break
        s = int(table.next_state[s, table.class_of[tok]])
        ids.append(tok)
    return out


def check_valid(texts):
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


def test_constrained_vanilla_equals_transformers_with_the_automaton_as_a_mask(json_model):
    model, torch_model = json_model
    out = oj.generate(model, PROMPTS, method="vanilla", max_new_tokens=80,
                      response_format=JSON_FORMAT, config=None)
    check_valid(out.texts)
    table = table_for(JSON_FORMAT, model.tokenizer, TINY_VOCAB, [EOS])
    for p, toks in zip(PROMPTS, out.tokens):
        ids = model.tokenizer(p)["input_ids"]
        assert toks == masked_greedy_reference(torch_model, table, ids, 80)
        assert toks[-1] == EOS
    free = oj.generate(model, PROMPTS, method="vanilla", max_new_tokens=20, config=None)
    assert free.tokens != [t[:20] for t in out.tokens]  # the constraint changed the output
    assert out.stats["forced_tokens"] > 0
    assert out.stats["constraint_table_bytes"] == table.nbytes


def test_constrained_speculative_equals_constrained_vanilla(json_model):
    model, _ = json_model
    want = oj.generate(model, PROMPTS, method="vanilla", max_new_tokens=80,
                       response_format=JSON_FORMAT, config=None).tokens
    # the draft is the target unconstrained: its chains leave the language and are cut
    got = oj.generate(model, PROMPTS, draft=model, method="speculative", max_new_tokens=80,
                      response_format=JSON_FORMAT, config=oj.SpeculativeConfig(gamma=4))
    assert got.tokens == want
    check_valid(got.texts)


@pytest.mark.parametrize("method", ["prompt_lookup", "lookahead", "ouroboros"])
def test_constrained_tree_methods_equal_constrained_vanilla(json_model, method):
    model, _ = json_model
    want = oj.generate(model, PROMPTS, method="vanilla", max_new_tokens=80,
                       response_format=JSON_FORMAT, config=None).tokens
    got = oj.generate(model, PROMPTS, draft=model if method == "ouroboros" else None,
                      method=method, max_new_tokens=80, response_format=JSON_FORMAT,
                      config=None)
    assert got.tokens == want
    check_valid(got.texts)


def test_a_batch_mixes_formats_and_unconstrained_rows_each_as_its_solo_call(json_model):
    model, _ = json_model
    formats = [JSON_FORMAT, None, REGEX_FORMAT]
    got = oj.generate(model, PROMPTS, draft=model, method="speculative", max_new_tokens=40,
                      response_format=formats, config=oj.SpeculativeConfig(gamma=3))
    for p, f, toks in zip(PROMPTS, formats, got.tokens):
        solo = oj.generate(model, [p], method="vanilla", max_new_tokens=40,
                           response_format=f, config=None)
        assert toks == solo.tokens[0]
    import re

    assert re.fullmatch(REGEX_FORMAT["pattern"], got.texts[2])


# ------------------------------------------------------------------------------ sampling


def test_constrained_sampling_is_lossless_and_a_wrong_rule_is_caught(json_model, json_draft):
    """The first token of 512 rows (streams 0..511) drawn by constrained speculative sampling
    (an unrelated draft, itself masked, the Leviathan rule against the masked target) against
    the exact constrained distribution: chi-square. A rule that keeps every draft token (the
    draft's distribution leaks through) is rejected by the same test."""
    from scipy.stats import chisquare

    from ouroboros_jax.decoding.speculative import leviathan_accept, run_speculative
    from ouroboros_jax.decoding.common import make_pair
    from ouroboros_jax.request import eos_array, row_knobs
    import torch

    model, torch_model = json_model
    fmt = {"type": "regex", "pattern": "[a-h]+"}
    table = table_for(fmt, model.tokenizer, TINY_VOCAB, [EOS])
    ids = model.tokenizer("hello")["input_ids"]
    with torch.no_grad():
        logits = torch_model(torch.tensor([ids])).logits[0, -1].double().numpy() / 2.0
    allowed = table.next_state[0][table.class_of] >= 0
    p = np.exp(np.where(allowed, logits, -np.inf) - logits[allowed].max())
    p /= p.sum()
    B = 512
    prompt = jnp.asarray(np.tile(np.asarray(ids, np.int32), (B, 1)))
    plens = jnp.full((B,), len(ids), jnp.int32)
    limits, sp = row_knobs(B, 1, eos_array(EOS), 2.0, 0, 1.0, 7, TINY_VOCAB)
    limits = limits.replace(constraint=stack_tables([table] * B, TINY_VOCAB))
    pair = make_pair(model, json_draft)
    cfg = oj.SpeculativeConfig(gamma=2)

    def first_tokens(rule=None):
        seq, _, _ = run_speculative(pair, prompt, plens, limits, sp, cfg=cfg, slots=64,
                                    greedy=False, accept_rule=rule)
        return np.asarray(seq.tokens)[:, len(ids)]

    def pvalue(tokens):
        support = np.flatnonzero(allowed)
        counts = np.array([(tokens == t).sum() for t in support])
        assert counts.sum() == B  # every draw is in the language
        return chisquare(counts, p[support] * B).pvalue

    assert pvalue(first_tokens()) > 1e-3

    def keep_drafts(logp, logq, drafts, keys, drafted=None):
        acc = leviathan_accept(logp, logq, drafts, keys, drafted)
        gamma = drafts.shape[1]
        return acc.replace(tokens=jnp.concatenate([drafts, acc.tokens[:, -1:]], 1),
                           count=jnp.full_like(acc.count, gamma + 1))

    assert pvalue(first_tokens(keep_drafts)) < 1e-3


# -------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("fmt, field", [
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
        "a": {"type": "integer", "multipleOf": 3}}}}},
     "response_format.json_schema.schema.properties.a.multipleOf"),
    ({"type": "json_schema", "json_schema": {}}, "response_format.json_schema.schema"),
    ({"type": "regex", "pattern": "(a"}, "response_format.pattern"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_bad_formats_are_refused_naming_the_field(fmt, field):
    with pytest.raises(ConstraintError) as e:
        regex_for(fmt)
    assert e.value.field.startswith(field) and str(e.value).startswith(field)


def test_a_table_over_the_bound_is_refused_naming_the_bound():
    with pytest.raises(ConstraintError, match="over the bound"):
        table_for({"type": "regex", "pattern": "[a-z]{0,100}"}, json_tokenizer(), TINY_VOCAB,
                  [EOS], max_bytes=1000)


def test_generate_refuses_a_bad_format_before_running(json_model):
    model, _ = json_model
    with pytest.raises(ConstraintError, match=r"response_format\.type"):
        oj.generate(model, PROMPTS, max_new_tokens=4, response_format={"type": "yaml"})
    with pytest.raises(ConstraintError, match="EOS"):
        oj.generate(model, PROMPTS, max_new_tokens=4, eos_token_id=-1,
                    response_format=REGEX_FORMAT)


# ------------------------------------------- forced runs, the masked draft, the peer (issue 55)

FORCED_FORMAT = {"type": "regex", "pattern": "abc[a-h]{1,12}de"}  # "abc", "de" forced


@pytest.mark.parametrize("kw", [dict(), dict(phrase_drafting=False, lengthening=False),
                                dict(free_drafts=True)],
                         ids=["paper", "token_drafting", "free_drafts"])
def test_ouroboros_proposes_forced_runs_free_and_equals_constrained_vanilla(json_model,
                                                                           json_draft, kw):
    """Forced runs ride the free-draft path (no draft forward) in every Ouroboros variant; an
    unrelated draft, masked along its own chain: the tokens stay constrained vanilla's."""
    model, _ = json_model
    cfg = oj.OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2, **kw)
    for fmt in (JSON_FORMAT, FORCED_FORMAT):
        want = oj.generate(model, PROMPTS, method="vanilla", max_new_tokens=60,
                           response_format=fmt, config=None)
        got = oj.generate(model, PROMPTS, draft=json_draft, method="ouroboros",
                          max_new_tokens=60, response_format=fmt, config=cfg)
        assert got.tokens == want.tokens
        assert got.stats["forced_tokens"] == want.stats["forced_tokens"] > 0
        # forced runs at a round's start were offered as free drafts (one met mid-chain is
        # drafted, or is the target's bonus token, and is counted as forced only)
        assert 0 < got.stats["forced_tokens_proposed"] <= got.stats["forced_tokens"]
        assert want.stats["forced_tokens_proposed"] == 0
    import re

    assert all(re.fullmatch(FORCED_FORMAT["pattern"], t[:-len("</s>")] if t.endswith("</s>")
                            else t) for t in got.texts)


@pytest.mark.parametrize("phrases", [False, True], ids=["token_drafting", "phrase_drafting"])
def test_the_masked_draft_proposes_the_constrained_chain(json_model, phrases):
    """The draft is the target itself: masked by the constraint along its own chain (token by
    token, or its Jacobi phrases) it drafts the target's constrained greedy tokens, so every
    drafted token is accepted. Unmasked, it drafts the unconstrained ones, which leave the
    language, and fewer are accepted than match."""
    model, _ = json_model
    cfg = oj.OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4, suffixes=2,
                             phrase_drafting=phrases, lengthening=False, recycling=False)
    got = oj.generate(model, PROMPTS[:1], draft=model, method="ouroboros", max_new_tokens=60,
                      response_format=JSON_FORMAT, config=cfg)
    s = got.stats
    assert s["draft_matches"] == s["draft_accepted"] > 0  # every draft token the target's
    free = oj.generate(model, PROMPTS[:1], draft=model, method="ouroboros", max_new_tokens=60,
                       config=cfg)  # unconstrained: the same pair agrees everywhere too
    assert free.stats["draft_matches"] == free.stats["draft_accepted"]


def test_transformers_with_the_table_processor_equals_constrained_vanilla(json_model):
    """The peer row's processor (`constrain.peer`): transformers' greedy generate masked by the
    same table, host state per row, gives constrained vanilla's tokens."""
    import torch
    from transformers import LogitsProcessorList

    from ouroboros_jax.constrain.peer import TableLogitsProcessor

    model, torch_model = json_model
    table = table_for(JSON_FORMAT, model.tokenizer, TINY_VOCAB, [EOS])
    want = oj.generate(model, PROMPTS, method="vanilla", max_new_tokens=60,
                       response_format=JSON_FORMAT, config=None)
    for p, toks in zip(PROMPTS, want.tokens):
        ids = model.tokenizer(p)["input_ids"]
        proc = TableLogitsProcessor(table, len(ids))
        with torch.no_grad():
            out = torch_model.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False,
                                       logits_processor=LogitsProcessorList([proc]),
                                       eos_token_id=EOS, pad_token_id=0)
        assert out[0, len(ids):].tolist() == toks


def test_constrained_ouroboros_sampling_after_a_forced_run_is_lossless(json_model, json_draft):
    """512 rows sample "ab[a-h]+" with Ouroboros (an unrelated draft, masked): the first round
    verifies the forced run "ab" as a free draft and draws the next token; its counts against
    the exact constrained distribution after "ab" (chi-square). The same counts against the
    distribution one position earlier (what a forced run verified at the wrong position, or a
    bonus drawn from the wrong node, would give) are rejected: the test can tell."""
    from scipy.stats import chisquare
    import torch

    model, torch_model = json_model
    fmt = {"type": "regex", "pattern": "ab[a-h]+"}
    table = table_for(fmt, model.tokenizer, TINY_VOCAB, [EOS])
    ids = model.tokenizer("hello")["input_ids"]
    ab = model.tokenizer("ab", add_special_tokens=False)["input_ids"]
    B = 512
    out = oj.generate(model, [ids] * B, draft=json_draft, method="ouroboros", max_new_tokens=3,
                      temperature=2.0, seed=7, response_format=fmt,
                      config=oj.OuroborosConfig(gamma=4, window=4, ngram=4, guesses=4,
                                                suffixes=2))
    assert all(t[:2] == ab for t in out.tokens)
    assert out.stats["forced_tokens_proposed"] == 2 * B
    drawn = np.array([t[2] for t in out.tokens])
    s = table.next_state[0, table.class_of[ab[0]]]
    s = table.next_state[s, table.class_of[ab[1]]]
    allowed = table.next_state[s][table.class_of] >= 0
    support = np.flatnonzero(allowed)

    def pvalue(context):
        with torch.no_grad():
            logits = torch_model(torch.tensor([context])).logits[0, -1].double().numpy() / 2.0
        p = np.exp(np.where(allowed, logits, -np.inf) - logits[allowed].max())
        p /= p.sum()
        counts = np.array([(drawn == t).sum() for t in support])
        assert counts.sum() == B  # every draw is in the language
        return chisquare(counts, p[support] * B).pvalue

    assert pvalue(ids + ab) > 1e-3
    assert pvalue(ids + ab[:1]) < 1e-3
