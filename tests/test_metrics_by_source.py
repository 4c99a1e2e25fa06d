"""/metrics reports only the measures of the method that runs (serving/metrics.py): no
spec-decode counters for plain decoding, no pool counters without a pool, accepted tokens by
the method's own draft sources, adding up to the accepted tokens."""

import numpy as np

from ouroboros_jax.decoding import METHODS
from ouroboros_jax.decoding.common import SOURCES
from ouroboros_jax.serving.metrics import EngineCounters, render


def _step(counters, kept, sources):
    """One step of two busy slots over two rounds (kept [k, busy]), all live."""
    kept = np.asarray(kept)
    counters.rounds(kept, np.ones_like(kept, bool), np.full_like(kept, 3), np.asarray(sources))


def _names(text):
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def test_each_method_exports_its_own_counters():
    for method, spec in METHODS.items():
        c = EngineCounters(4, spec.sources, spec.keeps_pool)
        m = c.snapshot()
        names = _names(render(m))
        assert ("ouroboros:pool_hit_rate" in names) == spec.keeps_pool, method
        assert ("ouroboros:spec_decode_num_drafts_total" in names) == bool(spec.sources), method
        assert set(m.get("accepted_by_source", {})) == set(spec.sources), method
    assert METHODS["vanilla"].sources == () and not METHODS["prompt_lookup"].keeps_pool


def test_accepted_by_source_adds_up_to_the_accepted_tokens():
    spec = METHODS["ouroboros"]
    c = EngineCounters(6, spec.sources, spec.keeps_pool)
    # per slot: accepted = kept - 1 per round, split between the chain and pool phrases
    src = np.zeros((2, len(SOURCES)), int)
    src[0, SOURCES.index("draft_chain")], src[0, SOURCES.index("pool_phrases")] = 3, 2
    src[1, SOURCES.index("draft_chain")] = 1
    _step(c, [[3, 1], [4, 2]], src)
    m = c.snapshot()
    assert m["num_accepted_tokens"] == 2 + 0 + 3 + 1 == sum(m["accepted_by_source"].values())
    text = render(m)
    assert 'ouroboros:spec_decode_num_accepted_tokens_by_source_total{source="pool_phrases"} 2' \
        in text
    # free drafts' spans of the context: a source of Ouroboros', none accepted in this step
    assert 'ouroboros:spec_decode_num_accepted_tokens_by_source_total{source="prompt_lookup"} 0' \
        in text
    # only the method's own sources: speculative decoding's chain is all it reports
    spec = METHODS["speculative"]
    c = EngineCounters(6, spec.sources, spec.keeps_pool)
    _step(c, [[3, 1], [4, 2]], src)
    assert "pool_phrases" not in render(c.snapshot())
