"""Limits and the auto store under a hostile but realistic user: a config="auto" cache that cannot
break the default path, sizes bounded by the model and the device before anything is allocated,
concurrent writers that lose nothing, a pool clock that cannot wrap, named errors for the
remaining raw exceptions, and the CLI cases."""

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax.auto import AutoTuner, prices
from ouroboros_jax.decoding.lookahead import LookaheadConfig
from ouroboros_jax.decoding.ouroboros import OuroborosConfig
from ouroboros_jax.decoding.speculative import SpeculativeConfig
from ouroboros_jax.pool import PhrasePool, init_pool, insert, insert_many, load_pool, lookup, save_pool

from conftest import copy_dir, make_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_S = 5.0  # "quickly": a refusal is host arithmetic, seconds at most on a loaded 2-core box


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, private config="auto" cache directory for one test."""
    d = tmp_path / "cache"
    d.mkdir()
    monkeypatch.setenv("OUROBOROS_JAX_CACHE", str(d))
    return d


@pytest.fixture
def tuner(cache_dir):
    """A fresh AutoTuner over that directory's store, as a new process has it."""
    return AutoTuner()


def _cache_file(d):
    return d / "auto.json"


def _usable(section, v) -> bool:
    """What a cache entry must be for a decision to use it (the issue's spec, written here
    independently of auto/store.py's own check)."""
    num = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    if section == "device":  # a device's calibration: two positive rates
        return (isinstance(v, dict) and sorted(v) == ["bandwidth", "flops"]
                and all(num(x) and x > 0 for x in v.values()))
    if section == "timing":  # least-squares sums of calls, the last a count of calls
        return (isinstance(v, list) and len(v) == 6 and all(num(x) for x in v)
                and v[0] >= 0 and v[2] >= 0 and isinstance(v[5], int) and v[5] >= 0)
    if section == "choice":  # a method's name and its config's fields (None: vanilla)
        return (isinstance(v, dict) and sorted(v) == ["config", "method"]
                and isinstance(v["method"], str)
                and (v["config"] is None or isinstance(v["config"], dict)))
    if section == "compiled":  # a loop in the compile cache: its choice, its compile seconds
        return (isinstance(v, dict) and sorted(v) == ["config", "method", "seconds"]
                and _usable("choice", {"method": v["method"], "config": v["config"]})
                and num(v["seconds"]) and v["seconds"] >= 0)
    if section == "latency":
        return (isinstance(v, dict) and bool(v) and all(k.isdigit() for k in v)
                and all(num(t) and t > 0 for t in v.values()))
    if section == "anchor":  # a model's measured 1-token forward over its shape's price
        return num(v) and v > 0
    if section == "depth":  # [reached, accepted] counts per depth of a draft chain
        return (isinstance(v, list) and bool(v) and all(
            isinstance(d, list) and len(d) == 2 and all(isinstance(x, int) for x in d)
            and 0 <= d[1] <= d[0] for d in v))
    if section == "free":  # [rounds, tokens kept] per match length of free proposals
        return (isinstance(v, list) and bool(v) and all(
            isinstance(d, list) and len(d) == 2 and all(isinstance(x, int) and x >= 0 for x in d)
            for d in v))
    if not (isinstance(v, list) and len(v) == 2 and num(v[0]) and isinstance(v[1], int)):
        return False
    return 0 <= v[0] <= v[1] and (section == "realised" or isinstance(v[0], int))


def _file_is_valid(path) -> dict:
    """The cache file on disk parses and every entry of it is usable."""
    data = json.loads(path.read_text())
    assert isinstance(data, dict) and set(data) <= {"latency", "agreement", "realised", "device",
                                                    "timing", "choice", "anchor", "depth",
                                                    "free", "compiled"}, data
    for section, entries in data.items():
        assert isinstance(entries, dict), (section, entries)
        assert all(_usable(section, v) for v in entries.values()), (section, entries)
    return data


# ------------------------------------------------------------------ 1. the auto cache is a hint
@pytest.mark.parametrize("text", ["[]", "null", '{"latency": 5}', '"auto"', "{not json",
                                  '{"realised": [1, 2]}', '{"agreement": {"k": "half"}}',
                                  '{"anchor": {"k": -1.5}}'])
def test_structurally_wrong_cache_is_ignored_rewritten_and_warned_once(tiny_pair, cache_dir,
                                                                       tuner, text):
    target, draft, _ = tiny_pair
    _cache_file(cache_dir).write_text(text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tuner.agreement.realised_agreement(target, draft) is None
        tuner.agreement.record_realised(target, draft, 0.5, 80)
        assert tuner.agreement.realised_agreement(target, draft) is not None
    said = [w for w in caught if "auto.json" in str(w.message)]
    assert len(said) == 1 and issubclass(said[0].category, RuntimeWarning), \
        [str(w.message) for w in caught]
    data = _file_is_valid(_cache_file(cache_dir))
    assert list(data["realised"].values())[0][1] == 80


@pytest.mark.parametrize("bad", ["fast", 0, -1.0, float("nan"), float("inf"), None, [1]])
def test_unusable_latency_entry_is_measured_again(tiny_target, cache_dir, tuner, bad):
    B, S = 1, 64
    key = tuner.prices.latency_key(tiny_target, B, S)  # the store's key for this model and shape
    _cache_file(cache_dir).write_text(json.dumps({"latency": {key: {"1": bad}}}))
    with pytest.warns(RuntimeWarning, match="invalid latency"):
        table = tuner.prices.probe_latency(tiny_target, B, S, sizes=(1,), reps=1)
    assert set(table) == {1} and math.isfinite(table[1]) and table[1] > 0
    assert _file_is_valid(_cache_file(cache_dir))["latency"][key]["1"] == table[1]


@pytest.mark.parametrize("bad", [["3", 10], [30, 10], [-1, 10], [1.5, 10], "0.7", [1, 2, 3]])
def test_unusable_agreement_entry_never_reaches_a_decision(tiny_pair, cache_dir, tuner, bad):
    target, draft, _ = tiny_pair
    key = f"{tuner.signatures(target)}|{tuner.signatures(draft)}"
    _cache_file(cache_dir).write_text(json.dumps({"agreement": {key: bad},
                                                  "realised": {key: bad}}))
    prompt = jnp.asarray([[5, 6, 7, 8, 9, 10, 11, 12]], jnp.int32)
    with pytest.warns(RuntimeWarning, match="invalid"):
        a, n = tuner.agreement.pair_agreement(target, draft, prompt,
                                              jnp.asarray([8], jnp.int32))
    assert 0.0 <= a <= 1.0 and n == 8  # this call's positions only: the bad entry was dropped
    assert tuner.agreement.realised_agreement(target, draft) is None
    _file_is_valid(_cache_file(cache_dir))


def test_default_call_runs_on_a_broken_cache_and_repairs_it(tiny_pair, cache_dir, tuner,
                                                            monkeypatch):
    target, draft, _ = tiny_pair
    monkeypatch.setattr(prices, "TARGET_SIZES", (1, 4))  # a short probe: this test is the store's
    monkeypatch.setattr(prices, "DRAFT_SIZES", (1, 4))
    _cache_file(cache_dir).write_text("[]")
    # 16 tokens: room for a whole chain of the exploring call's 8 (a chain the budget cuts
    # short teaches no depth, `speculative.chain_lesson`)
    kw = dict(max_new_tokens=16, eos_token_id=-1)
    with pytest.warns(RuntimeWarning, match="auto.json"):
        out = oj.generate(target, [[5, 6, 7, 8]], draft=draft, method="speculative",
                          tuner=tuner, **kw)
    assert out.tokens == oj.generate(target, [[5, 6, 7, 8]], **kw).tokens
    assert "nan" not in out.stats["auto"]["reason"]
    kept = _file_is_valid(_cache_file(cache_dir))
    # what the call chose and learned from its own rounds (it measures nothing: issue 53)
    assert kept["choice"] and kept["depth"] and kept["realised"]
    assert not {"device", "anchor", "agreement"} & set(kept)


def test_cache_that_cannot_be_replaced_leaves_no_temp_files(tiny_pair, cache_dir, tuner):
    target, draft, _ = tiny_pair
    _cache_file(cache_dir).mkdir()  # a directory where the file should be
    with pytest.warns(RuntimeWarning, match="cannot be"):
        for _ in range(3):
            tuner.agreement.record_realised(target, draft, 0.5, 80)
    # the results still serve this process
    assert tuner.agreement.realised_agreement(target, draft) is not None
    assert sorted(os.listdir(cache_dir)) == ["auto.json", "auto.json.lock"]


# Children start together: each says it is ready (imports done, model loaded) and waits for
# the parent's "go", so every one reads the fresh cache before any has written.
_READY = """
import os, sys, time
def ready_then_wait(i):
    open(os.path.join(sys.argv[-1], f"ready{i}"), "w").close()
    while not os.path.exists(os.path.join(sys.argv[-1], "go")):
        time.sleep(0.005)
"""

_PROBE_CHILD = _READY + """
import ouroboros_jax as oj
from ouroboros_jax.auto import AutoTuner
m = oj.load_model(sys.argv[1])
ready_then_wait(sys.argv[2])
AutoTuner().prices.probe_latency(m, int(sys.argv[2]), 64, sizes=(1,), reps=1)
"""


def _run_together(script, argvs, sync_dir):
    """Runs one child per argv (sync_dir appended), says "go" once all are ready; returns their
    (returncode, stderr)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", script, *argv, str(sync_dir)], env=env,
                              stderr=subprocess.PIPE) for argv in argvs]
    deadline = time.time() + 240
    while (len([f for f in os.listdir(sync_dir) if f.startswith("ready")]) < len(procs)
           and time.time() < deadline and all(p.poll() is None for p in procs)):
        time.sleep(0.02)
    (sync_dir / "go").touch()
    return [(p.wait(timeout=300), p.stderr.read().decode()) for p in procs]


def test_concurrent_processes_probing_keep_every_entry(tiny_target, cache_dir):
    # three batch sizes = three buckets = three keys, probed by three processes at once
    batches = (1, 2, 4)
    sync = cache_dir.parent / "sync"
    sync.mkdir()
    done = _run_together(_PROBE_CHILD, [(tiny_target.path, str(b)) for b in batches], sync)
    assert all(rc == 0 for rc, _ in done), done
    keys = _file_is_valid(_cache_file(cache_dir))["latency"]
    assert sorted(int(k.split("|B")[1].split("|")[0]) for k in keys) == list(batches)
    assert [f for f in os.listdir(cache_dir) if f.endswith(".tmp")] == []


def test_concurrent_threads_pool_every_count(tiny_pair, cache_dir, tuner):
    target, draft, _ = tiny_pair
    n_threads, calls = 8, 5

    def work():
        for _ in range(calls):
            tuner.agreement.record_realised(target, draft, 0.5, 10)

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (s, n), = _file_is_valid(_cache_file(cache_dir))["realised"].values()
    assert n == n_threads * calls * 10
    assert [f for f in os.listdir(cache_dir) if f.endswith(".tmp")] == []


# ------------------------------------------------------------------ 2. sizes with bounds
@pytest.mark.parametrize("make", [
    lambda: SpeculativeConfig(gamma=10**6),
    lambda: SpeculativeConfig(gamma=10**4),
    lambda: LookaheadConfig(window=10**6),
    lambda: LookaheadConfig(guesses=10**6),
    lambda: LookaheadConfig(ngram=10**6),
    lambda: LookaheadConfig(window=1000, guesses=1000, ngram=7),
    lambda: LookaheadConfig(pool_rows=2**40),
    lambda: OuroborosConfig(gamma=10**6),
    lambda: OuroborosConfig(window=10**6),
    lambda: OuroborosConfig(window=400, guesses=400, ngram=7),
    lambda: OuroborosConfig(gamma=4090, suffixes=3, ngram=7),
], ids=["sd-gamma-1e6", "sd-gamma-1e4", "la-window", "la-guesses", "la-ngram", "la-tree",
        "la-pool-rows", "o-gamma", "o-window", "o-draft-tree", "o-target-tree"])
def test_config_sizes_past_any_useful_tree_are_refused(make):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="Config"):
        make()
    assert time.perf_counter() - t0 < QUICK_S


def _quick_refusal(call, match):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        call()
    assert time.perf_counter() - t0 < QUICK_S


def test_pool_rows_are_bounded_by_the_vocabulary(tiny_pair):
    target, draft, _ = tiny_pair
    V = target.config.vocab_size
    for rows in (10**9, V + 1):
        _quick_refusal(lambda: oj.generate(target, [[5, 6, 7]], method="lookahead",
                                           config=LookaheadConfig(pool_rows=rows)),
                       f"pool_rows={rows} exceeds the vocabulary")
        _quick_refusal(lambda: oj.generate(target, [[5, 6, 7]], draft=draft, method="ouroboros",
                                           config=OuroborosConfig(pool_rows=rows)),
                       f"pool_rows={rows} exceeds the vocabulary")


def test_a_tree_larger_than_the_cache_is_refused(tiny_pair):
    target, draft, _ = tiny_pair  # 1024 positions
    _quick_refusal(lambda: oj.generate(target, [[5, 6, 7]], draft=draft, method="speculative",
                                       config=SpeculativeConfig(gamma=2000)),
                   r"gamma=2000\) scores 2001 tokens in one target forward")
    _quick_refusal(lambda: oj.generate(target, [[5, 6, 7]], method="lookahead",
                                       config=LookaheadConfig(window=20, guesses=20, ngram=7),
                                       max_cache_len=200),
                   "240 tokens in one target forward, more than the cache holds")


def test_cache_past_the_position_limit_needs_an_explicit_override(tiny_target, monkeypatch):
    from ouroboros_jax import bounds

    short = oj.Model(dataclasses.replace(tiny_target.config, max_position_embeddings=256),
                     tiny_target.params)
    for n in (1000, 10**9):
        _quick_refusal(lambda: oj.generate(short, [[5, 6, 7]], max_new_tokens=4,
                                           max_cache_len=n),
                       f"max_cache_len={n} exceeds the target's max_position_embeddings")
    monkeypatch.setenv(bounds.PAST_POSITIONS_ENV, "1")
    # allowed on purpose: runs (on positions past the trained 256)
    out = oj.generate(short, [[5, 6, 7]], max_new_tokens=4, max_cache_len=300, eos_token_id=-1)
    assert len(out.tokens[0]) == 4
    # and a cache no device holds is refused by name, not RESOURCE_EXHAUSTED
    _quick_refusal(lambda: oj.generate(short, [[5, 6, 7]], max_new_tokens=4,
                                       max_cache_len=10**9),
                   "device memory .*max_cache_len")


def test_memory_estimate_counts_what_a_call_allocates(tiny_pair):
    from ouroboros_jax import bounds
    from ouroboros_jax.decoding import METHODS

    target, draft, _ = tiny_pair
    c = target.config
    kv = 2 * c.num_layers * 4 * 512 * c.num_kv_heads * c.head_dim * 4  # fp32 cache
    got = bounds.estimate_bytes(METHODS["vanilla"], None, target, None, 4, 16, 512)
    assert kv < got < 2 * kv + 4 * 4 * 16 * c.vocab_size * 4
    sd = bounds.estimate_bytes(METHODS["speculative"], SpeculativeConfig(gamma=4), target, draft,
                               4, 16, 512)
    assert sd > got  # the draft's cache on top
    # Python ints: a 10**9-slot cache is priced, not wrapped around
    assert bounds.estimate_bytes(METHODS["vanilla"], None, target, None, 1, 16, 10**9) > 10**11


# ------------------------------------------------------------------ 3. concurrent pool savers
def _small_pool(seed=0):
    rs = np.random.RandomState(seed)
    keys = rs.randint(0, 11, size=6)
    return insert_many(init_pool(11, 2, 2, rows=5), jnp.asarray(keys, jnp.int32),
                       jnp.asarray(rs.randint(0, 11, size=(6, 2)), jnp.int32))


def test_concurrent_save_pool_from_threads_never_fails(tmp_path):
    path = tmp_path / "p.npz"
    pools = [_small_pool(i) for i in range(8)]
    errors = []

    def work(pool):
        for _ in range(20):
            try:
                save_pool(path, pool)
            except Exception as e:  # noqa: BLE001  every failure is the finding
                errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(p,)) for p in pools]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    got = load_pool(path)
    assert any(np.array_equal(np.asarray(got.keys), np.asarray(p.keys)) for p in pools)
    assert sorted(os.listdir(tmp_path)) == ["p.npz"]


_SAVE_CHILD = _READY + """
import numpy as np
from ouroboros_jax.pool import PhrasePool, save_pool
i = int(sys.argv[2])
pool = PhrasePool(keys=np.full((5, 2), -1, np.int32), phrases=np.full((5, 2, 2), i, np.int32),
                  stamps=np.zeros((5, 2), np.int32), clock=np.zeros((), np.int32), vocab_size=11)
ready_then_wait(i)
for _ in range(30):
    save_pool(sys.argv[1], pool)
"""


def test_concurrent_save_pool_from_processes_never_fails(tmp_path):
    d = tmp_path / "pools"
    d.mkdir()
    path = d / "p.npz"
    sync = tmp_path / "sync"
    sync.mkdir()
    done = _run_together(_SAVE_CHILD, [(str(path), str(i)) for i in range(4)], sync)
    assert all(rc == 0 for rc, _ in done), done
    assert int(np.asarray(load_pool(path).phrases)[0, 0, 0]) in range(4)
    assert sorted(os.listdir(d)) == ["p.npz"]


# ------------------------------------------------------------------ 4. damaged pool files
@pytest.fixture(scope="module")
def pool_bytes_on_disk(tmp_path_factory):
    p = tmp_path_factory.mktemp("pool") / "ok.npz"
    save_pool(p, _small_pool())
    return p.read_bytes()


def _load_or_value_error(path):
    """load_pool either succeeds (the damage hit a field nothing reads, e.g. a zip timestamp)
    or raises a ValueError naming the file; never anything else."""
    try:
        load_pool(path)
    except ValueError as e:
        assert str(path) in str(e)
        return False
    return True


def test_empty_garbage_and_npy_files_are_refused_naming_the_file(tmp_path):
    cases = {"empty.npz": b"", "garbage.npz": os.urandom(300),
             "zipmagic.npz": b"PK\x03\x04" + os.urandom(200)}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=name):
            load_pool(tmp_path / name)
    np.save(tmp_path / "array.npy", np.zeros(3))
    with pytest.raises(ValueError, match="array.npy"):
        load_pool(tmp_path / "array.npy")


def test_every_bit_flip_and_truncation_is_refused_or_harmless(tmp_path, pool_bytes_on_disk):
    data = pool_bytes_on_disk
    p = tmp_path / "damaged.npz"
    refused = 0
    tries = 0
    for i in range(len(data)):
        b = bytearray(data)
        b[i] ^= 1 << (i % 8)  # one bit of every byte, each bit position in turn
        p.write_bytes(bytes(b))
        refused += not _load_or_value_error(p)
        tries += 1
    for n in range(0, len(data), 7):
        p.write_bytes(data[:n])
        refused += not _load_or_value_error(p)
        tries += 1
    assert refused > tries // 2  # most damage is caught (and the rest was harmless)


# ------------------------------------------------------------------ 5. the pool clock
def _near_the_top(pool, room):
    """The pool as after ~2**31 writes: same order, stamps shifted so that `room` writes are
    left before the int32 clock passes 2**31 - 1."""
    shift = CLOCK_MAX - room - int(pool.clock)
    return pool.replace(stamps=jnp.where(pool.stamps > 0, pool.stamps + shift, 0),
                        clock=pool.clock + shift)


CLOCK_MAX = 2**31 - 1  # the largest int32 stamp


def test_pool_clock_never_wraps_and_a_pool_past_it_saves_and_loads(tmp_path):
    pool = init_pool(11, 3, 2, rows=5)
    pool = insert(insert(pool, 1, jnp.array([2, 3])), 1, jnp.array([4, 5]))  # A, B under key 1
    pool = insert(pool, 2, jnp.array([6, 7]))  # C under key 2 (row 2)
    pool = _near_the_top(pool, 3)
    pool = insert(pool, 1, jnp.array([8, 9]))  # D
    assert int(pool.clock) == CLOCK_MAX - 2
    for k in range(3):  # six more writes (rows 1 and 3): past 2**31 - 1 without renumbering
        pool = insert_many(pool, jnp.array([1, 3], jnp.int32),
                           jnp.array([[k, k], [k + 1, k]], jnp.int32))
    stamps = np.asarray(pool.stamps)
    live = stamps[stamps > 0]
    assert (stamps >= 0).all() and len(np.unique(live)) == len(live)
    assert 0 < int(pool.clock) < CLOCK_MAX and live.max() == int(pool.clock)
    # key 1's newest three phrases, newest first (LRU order survived the renumbering)
    phrases, found = lookup(pool, jnp.int32(1), 3)
    assert np.asarray(found).all()
    assert np.asarray(phrases).tolist() == [[2, 2], [1, 1], [0, 0]]
    # and key 2's phrase (oldest of all) is still there
    phrases, found = lookup(pool, jnp.int32(2), 1)
    assert bool(found[0]) and np.asarray(phrases[0]).tolist() == [6, 7]
    save_pool(tmp_path / "p.npz", pool)
    back = load_pool(tmp_path / "p.npz")
    for n in ("keys", "phrases", "stamps", "clock"):
        np.testing.assert_array_equal(np.asarray(getattr(back, n)), np.asarray(getattr(pool, n)))


def test_a_long_lived_pool_keeps_its_order_through_generate_and_saves(tiny_target, tmp_path):
    from conftest import REPEAT, ngram_pool

    cfg = LookaheadConfig(window=3, ngram=3, guesses=3)
    kw = dict(method="lookahead", config=cfg, max_new_tokens=16, eos_token_id=-1)
    pool = ngram_pool(tiny_target.config.vocab_size, REPEAT, 3, 3)
    want = oj.generate(tiny_target, REPEAT[:2], pool=pool, **kw)
    # the same pool after ~2**31 writes: a call writes hundreds more, past the int32 clock
    old = _near_the_top(pool, 5)
    out = oj.generate(tiny_target, REPEAT[:2], pool=old, **kw)
    assert out.tokens == want.tokens  # the same tokens and the same pool, up to the numbering
    stamps, ref = np.asarray(out.pool.stamps), np.asarray(want.pool.stamps)
    assert (stamps >= 0).all() and ((stamps > 0) == (ref > 0)).all()
    assert (np.argsort(stamps[stamps > 0]) == np.argsort(ref[ref > 0])).all()
    save_pool(tmp_path / "p.npz", out.pool)
    np.testing.assert_array_equal(np.asarray(load_pool(tmp_path / "p.npz").stamps), stamps)


def test_renumbering_keeps_the_order_of_every_slot():
    from ouroboros_jax.pool.phrase_pool import renumber_stamps

    rs = np.random.RandomState(0)
    stamps = np.zeros((7, 4), np.int32)
    filled = rs.rand(7, 4) < 0.6
    stamps[filled] = rs.choice(np.arange(1, 2**31 - 1, 9973), filled.sum(), replace=False)
    p = init_pool(97, 4, 2, rows=7).replace(stamps=jnp.asarray(stamps),
                                            clock=jnp.int32(stamps.max()))
    r = np.asarray(renumber_stamps(p).stamps)
    assert ((r > 0) == filled).all()
    assert sorted(r[filled].tolist()) == list(range(1, filled.sum() + 1))
    assert (np.argsort(r[filled]) == np.argsort(stamps[filled])).all()
    assert int(renumber_stamps(p).clock) == filled.sum()


# ------------------------------------------------------------------ 6. named errors
@pytest.mark.parametrize("args,match", [
    ((97, 2.5, 2), "guesses must be an integer"),
    ((97.0, 2, 2), "vocab_size must be an integer"),
    ((97, 2, "2"), "phrase_len must be an integer"),
    ((97, True, 2), "guesses must be an integer"),
    ((97, 2, 2, 3.5), "rows must be an integer"),
    ((97, 2, 2, 0), "rows must be an integer"),
    ((2**31, 2, 2), "vocab_size must be an integer"),
])
def test_init_pool_refuses_bad_argument_types_by_name(args, match):
    with pytest.raises(ValueError, match=match):
        init_pool(*args)


def test_load_model_refuses_a_bad_dtype_and_a_config_json_path(tiny_target):
    with pytest.raises(ValueError, match="dtype must be"):
        oj.load_model(tiny_target.path, dtype="garbage")
    with pytest.raises(ValueError, match="dtype must be"):
        oj.load_model(tiny_target.path, dtype=np.int32)
    cfg = os.path.join(tiny_target.path, "config.json")
    with pytest.raises(ValueError, match="is a file") as e:
        oj.load_model(cfg)
    assert repr(os.path.abspath(tiny_target.path)) in str(e.value)  # points at the directory


def test_model_params_are_checked_against_the_config(tiny_pair):
    target, draft, _ = tiny_pair
    c, p = target.config, target.params
    with pytest.raises(ValueError, match="params must be a dict"):
        oj.Model(config=c, params={})
    with pytest.raises(ValueError, match=r"lacks \['embed'\]"):
        oj.Model(c, {k: v for k, v in p.items() if k != "embed"})
    with pytest.raises(ValueError, match=r"params\['embed'\] has shape \(64, 97\)"):
        oj.Model(c, {**p, "embed": p["embed"].T})
    # the draft's params (1 layer, other widths) under the target's config
    with pytest.raises(ValueError, match="has shape"):
        oj.Model(c, draft.params)
    with pytest.raises(ValueError, match="floating-point"):
        oj.Model(c, {**p, "final_norm": np.ones(c.hidden_size, np.int32)})
    with pytest.raises(ValueError, match="config must be a ModelConfig"):
        oj.Model(config={"vocab_size": 97}, params=p)


def test_generate_refuses_a_mesh_string_and_a_lone_surrogate(tiny_target):
    from ouroboros_jax.models.loading import load_tokenizer
    from ouroboros_jax.training.assets import DEMO_DIR

    with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh.*make_mesh"):
        oj.generate(tiny_target, [[1, 2, 3]], mesh="1x8")
    m = oj.Model(tiny_target.config, tiny_target.params,
                 tokenizer=load_tokenizer(str(DEMO_DIR / "draft")))
    with pytest.raises(ValueError, match=r"prompts\[0\] is not valid Unicode"):
        oj.generate(m, ["x\ud800y"], max_new_tokens=2)


# ------------------------------------------------------------------ 7. CLI
def test_bench_refuses_zero_repeats_and_unknown_methods_before_loading(capsys):
    from ouroboros_jax.cli import main

    with pytest.raises(SystemExit, match="--repeats must be an integer >= 1, got 0"):
        main(["bench", "--quick", "--repeats", "0"])
    with pytest.raises(SystemExit, match="unknown method.*'bogus'"):
        main(["bench", "--quick", "--methods", "vanilla,bogus"])
    assert "[bench] models" not in capsys.readouterr().err  # nothing was loaded


def test_memory_of_huge_sizes_is_positive_and_exact(capsys):
    from ouroboros_jax.cli import main
    from ouroboros_jax.models.presets import PRESETS
    from ouroboros_jax.sharding import memory_plan

    main(["memory", "--preset", "llama-2-70b", "--batch", "100000000", "--cache-len",
          "100000000"])
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("llama-2-70b") and "-" not in line[len("llama-2-70b"):], line
    # the cache grows linearly with batch x cache length, exactly
    c = PRESETS["llama-2-70b"]
    small = memory_plan(c, 1, 8, 1000, 1000)["kv_cache_per_device_bytes"]
    assert memory_plan(c, 1, 8, 10**8, 10**8)["kv_cache_per_device_bytes"] == small * 10**10


@pytest.fixture(scope="module")
def distill_target(tmp_path_factory):
    """A tiny target directory with the demo tokenizer (distill needs one)."""
    import shutil

    from ouroboros_jax.training.assets import DEMO_DIR

    d = tmp_path_factory.mktemp("distill24")
    make_hf_model(d, layers=1)
    for n in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_DIR / "draft" / n, d / n)
    return str(d)


def test_distill_writes_nothing_when_it_refuses(tmp_path, distill_target):
    from ouroboros_jax.training import distill

    data = tmp_path / "data.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 50)
    base = ["--target", distill_target, "--data", str(data), "--seq-len", "32",
            "--prompt-tokens", "8", "--new-tokens", "8"]
    cases = [
        (["--target", str(tmp_path / "nowhere"), "--draft-config", '{"num_layers": 1}'],
         "--target"),
        (["--draft-config", "{oops"], "--draft-config is not valid JSON"),
        (["--draft-config", '{"num_layers": 1}', "--eval-prompts", str(tmp_path / "none.json")],
         "--eval-prompts"),
        (["--draft-config", '{"num_layers": 1}', "--seq-len", "100000", "--prompt-tokens", "8"],
         "fewer than --seq-len"),
    ]
    for i, (extra, match) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(SystemExit, match=match):
            distill.main(base + extra + ["--out", str(out)])
        assert not out.exists(), (extra, os.listdir(out))


def test_distill_refuses_an_out_that_is_a_file(tmp_path, distill_target):
    from ouroboros_jax.training import distill

    f = tmp_path / "out.txt"
    f.write_text("keep me")
    with pytest.raises(SystemExit, match="--out .*not a directory"):
        distill.main(["--target", distill_target, "--draft-config", '{"num_layers": 1}',
                      "--data", str(f), "--out", str(f)])
    assert f.read_text() == "keep me"


# ------------------------------------------------------------------ 8. the serving engine
def test_engine_sizes_are_bounded_before_anything_is_allocated(tiny_pair):
    from ouroboros_jax.serving.engine import Engine

    target, draft, _ = tiny_pair
    _quick_refusal(lambda: Engine(target, slots=10**6, max_cache_len=1024),
                   r"device memory \(1000000 rows x .*slots")
    _quick_refusal(lambda: Engine(target, method="lookahead",
                                  config=LookaheadConfig(pool_rows=10**9)),
                   "pool_rows=1000000000 exceeds the vocabulary")
    _quick_refusal(lambda: Engine(target, draft, method="speculative",
                                  config=SpeculativeConfig(gamma=2000)),
                   "2001 tokens in one target forward")
