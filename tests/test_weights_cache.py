"""The weights cache (models/weights_cache.py): a GGUF's dequantized weights written after the
first load and mapped by the next, bit-identical and without dequantizing; a changed file, a
damaged entry or another dtype is a miss, never stale weights; a full disk or "off" writes
nothing; the CLI flag is checked before anything loads."""

import json
import os

import numpy as np
import pytest

import ouroboros_jax as oj
from ouroboros_jax import cli
from ouroboros_jax.models import gguf, weights_cache
from ouroboros_jax.models.params import leaves_of

from conftest import make_hf_model
from test_gguf import T, write_gguf


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("wc_hf")
    hf = make_hf_model(d, vocab=97, hidden=64, layers=2, heads=4, kv_heads=2, inter=128,
                       seed=11, scale=0.3)
    return write_gguf(d / "tiny_q8.gguf", hf, qtype=T.Q8_0)


def load(path, dtype, directory=None):
    """load_model, then the weights cache's writes finished (they run on a thread)."""
    m = oj.load_model(path, dtype=dtype, weights_cache=directory)
    weights_cache.wait()
    return m


def leaves(model) -> dict:
    out = {}
    for leaf in leaves_of(model.config):
        where = model.params["layers"] if leaf.per_layer else model.params
        out[leaf.name] = np.asarray(where[leaf.name])
    return out


def mapped_from(path: str, address: int) -> bool:
    """Whether `address` lies in one of this process's mappings of the file at `path`."""
    real = os.path.realpath(path)
    for line in open("/proc/self/maps"):
        parts = line.split()
        if len(parts) >= 6 and parts[5] == real:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def counting_dequantizer(monkeypatch) -> list:
    """Counts `load_gguf_params` calls (the dequantizing path) from here on."""
    calls = []
    real = gguf.load_gguf_params

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(gguf, "load_gguf_params", counted)
    return calls


def test_second_load_maps_the_same_weights_without_dequantizing(q8_gguf, tmp_path,
                                                                monkeypatch, capsys):
    calls = counting_dequantizer(monkeypatch)
    plain = oj.load_model(q8_gguf, dtype="float32")
    first = load(q8_gguf, "float32", str(tmp_path))
    weights_cache.wait()  # written behind the load, on a thread
    assert "keeping the float32 weights of tiny_q8.gguf" in capsys.readouterr().err
    assert len(calls) == 2  # no entry yet: dequantized, then written
    entries = sorted(os.listdir(tmp_path))
    assert [e.rsplit(".", 1)[1] for e in entries] == ["bin", "json"]
    second = load(q8_gguf, "float32", str(tmp_path))
    assert len(calls) == 2 and capsys.readouterr().err == ""  # mapped, nothing written
    want = leaves(plain)
    for name, got in leaves(second).items():
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want[name], err_msg=name)
    # the arrays are the entry's pages, not a copy of them
    data = os.path.join(tmp_path, entries[0])
    assert mapped_from(data, second.params["embed"].unsafe_buffer_pointer())
    assert not mapped_from(data, plain.params["embed"].unsafe_buffer_pointer())
    prompt = [5, 17, 33, 42, 61, 7]
    kw = dict(max_new_tokens=6, eos_token_id=-1)
    assert oj.generate(second, [prompt], **kw).tokens == oj.generate(plain, [prompt], **kw).tokens
    assert os.path.getsize(data) % weights_cache.PAGE == 0


def test_a_changed_file_or_dtype_is_a_miss(q8_gguf, tmp_path, monkeypatch):
    load(q8_gguf, "float32", str(tmp_path))
    calls = counting_dequantizer(monkeypatch)
    load(q8_gguf, "bfloat16", str(tmp_path))
    assert len(calls) == 1  # another dtype: its own entry
    st = os.stat(q8_gguf)
    os.utime(q8_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # the file changed
    try:
        load(q8_gguf, "float32", str(tmp_path))
        assert len(calls) == 2
    finally:
        os.utime(q8_gguf, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("damage", ["truncated", "wrong shape", "manifest garbage"])
def test_a_damaged_entry_is_ignored_and_written_again(q8_gguf, tmp_path, monkeypatch, damage):
    want = leaves(load(q8_gguf, "float32", str(tmp_path)))
    name = weights_cache.entry_name(q8_gguf, np.float32)
    data, manifest = (os.path.join(tmp_path, name + ext) for ext in (".bin", ".json"))
    if damage == "truncated":
        os.truncate(data, os.path.getsize(data) - weights_cache.PAGE)
    elif damage == "wrong shape":
        meta = json.load(open(manifest))
        meta["leaves"]["embed"][1][0] += 1
        json.dump(meta, open(manifest, "w"))
    else:
        open(manifest, "w").write("{not json")
    calls = counting_dequantizer(monkeypatch)
    got = leaves(load(q8_gguf, "float32", str(tmp_path)))
    assert len(calls) == 1  # dequantized again, never read from the damaged entry
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    load(q8_gguf, "float32", str(tmp_path))
    assert len(calls) == 1  # and the entry written again is whole


def test_no_room_writes_nothing_and_says_so(q8_gguf, tmp_path, monkeypatch, capsys):
    class Usage:
        free = weights_cache.FREE_MARGIN  # less than the margin plus the entry

    monkeypatch.setattr(weights_cache.shutil, "disk_usage", lambda d: Usage)
    m = load(q8_gguf, "float32", str(tmp_path))
    assert m.params is not None
    assert "not caching the float32 weights of tiny_q8.gguf" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_without_a_directory_nothing_is_written(q8_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    oj.load_model(q8_gguf, dtype="float32")
    assert os.listdir(tmp_path) == []
    assert weights_cache.resolve("off") is None and weights_cache.resolve("OFF ") is None
    monkeypatch.setenv(weights_cache.ENV, "off")
    assert weights_cache.resolve(None) is None
    monkeypatch.setenv(weights_cache.ENV, str(tmp_path / "w"))
    assert weights_cache.resolve(None) == str(tmp_path / "w")
    monkeypatch.delenv(weights_cache.ENV)
    assert weights_cache.resolve(None) == str(tmp_path / "ouroboros-jax" / "weights")


def test_cli_flag_naming_a_file_is_refused_before_loading(q8_gguf, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", q8_gguf, "--prompt", "hi", "--weights-cache", str(f)])
    assert "--weights-cache" in str(e.value.code) and "not a directory" in str(e.value.code)
    assert f.read_text() == "x"


def test_a_load_during_the_write_waits_for_it(q8_gguf, tmp_path, monkeypatch):
    calls = counting_dequantizer(monkeypatch)
    oj.load_model(q8_gguf, dtype="float32", weights_cache=str(tmp_path))  # writes on a thread
    oj.load_model(q8_gguf, dtype="float32", weights_cache=str(tmp_path))  # no wait() between
    assert len(calls) == 1  # mapped the entry the first load wrote, not dequantized again


def test_a_killed_writers_temporary_file_is_removed(q8_gguf, tmp_path):
    data = os.path.join(tmp_path, weights_cache.entry_name(q8_gguf, np.float32) + ".bin")
    dead = 2 ** 22 + 12345  # above the default pid_max: no such process
    stale = f"{data}.{dead}.tmp"
    open(stale, "wb").write(b"partial")
    load(q8_gguf, "float32", str(tmp_path))
    assert not os.path.exists(stale) and os.path.exists(data)
