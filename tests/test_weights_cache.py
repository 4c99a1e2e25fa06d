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
    """Counts dequantized tensor pieces (`gguf_read.fill_tensor` calls) from here on."""
    from ouroboros_jax.models import gguf_read

    calls = []
    real = gguf_read.fill_tensor

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(gguf_read, "fill_tensor", counted)
    return calls


def entry(q8_gguf, directory, dtype=np.float32) -> str:
    return weights_cache.entry_dir(str(directory), q8_gguf, dtype)


def test_second_load_maps_the_same_weights_without_dequantizing(q8_gguf, tmp_path,
                                                                monkeypatch, capsys):
    plain = oj.load_model(q8_gguf, dtype="float32")
    calls = counting_dequantizer(monkeypatch)
    load(q8_gguf, "float32", str(tmp_path))
    assert "keeping the float32 weights of tiny_q8.gguf" in capsys.readouterr().err
    assert calls  # no entry yet: dequantized, then written
    want = leaves(plain)
    files = sorted(os.listdir(entry(q8_gguf, tmp_path)))
    assert files == sorted(name + ".bin" for name in want)  # every leaf whole, no temp file
    del calls[:]
    second = load(q8_gguf, "float32", str(tmp_path))
    assert not calls and capsys.readouterr().err == ""  # mapped, nothing dequantized or written
    for name, got in leaves(second).items():
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want[name], err_msg=name)
    # the arrays are the entry's pages, not a copy of them
    embed = os.path.join(entry(q8_gguf, tmp_path), "embed.bin")
    assert mapped_from(embed, second.params["embed"].unsafe_buffer_pointer())
    assert not mapped_from(embed, plain.params["embed"].unsafe_buffer_pointer())
    prompt = [5, 17, 33, 42, 61, 7]
    kw = dict(max_new_tokens=6, eos_token_id=-1)
    assert oj.generate(second, [prompt], **kw).tokens == oj.generate(plain, [prompt], **kw).tokens


def test_a_changed_file_or_dtype_is_a_miss(q8_gguf, tmp_path, monkeypatch):
    load(q8_gguf, "float32", str(tmp_path))
    calls = counting_dequantizer(monkeypatch)
    load(q8_gguf, "bfloat16", str(tmp_path))
    assert calls  # another dtype: its own entry
    del calls[:]
    st = os.stat(q8_gguf)
    os.utime(q8_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # the file changed
    try:
        load(q8_gguf, "float32", str(tmp_path))
        assert calls
    finally:
        os.utime(q8_gguf, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_or_partial_entry_maps_the_rest(q8_gguf, tmp_path, monkeypatch, damage):
    want = leaves(oj.load_model(q8_gguf, dtype="float32"))
    load(q8_gguf, "float32", str(tmp_path))
    d = entry(q8_gguf, tmp_path)
    wq = os.path.join(d, "wq.bin")
    if damage == "truncated":
        os.truncate(wq, os.path.getsize(wq) - 4)
    else:  # a process that ended before writing it
        os.remove(wq)
    calls = counting_dequantizer(monkeypatch)
    m = load(q8_gguf, "float32", str(tmp_path))
    assert 0 < len(calls) < len(want)  # only the damaged leaf dequantized
    assert mapped_from(os.path.join(d, "embed.bin"), m.params["embed"].unsafe_buffer_pointer())
    got = leaves(m)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    del calls[:]
    load(q8_gguf, "float32", str(tmp_path))
    assert not calls  # and the leaf written again is whole


def test_no_room_writes_nothing_and_says_so(q8_gguf, tmp_path, monkeypatch, capsys):
    class Usage:
        free = weights_cache.FREE_MARGIN  # less than the margin plus the entry

    monkeypatch.setattr(weights_cache.shutil, "disk_usage", lambda d: Usage)
    m = load(q8_gguf, "float32", str(tmp_path))
    assert m.params is not None
    assert "not caching the float32 weights of tiny_q8.gguf" in capsys.readouterr().err
    assert os.listdir(entry(q8_gguf, tmp_path)) == []


def test_off_unless_asked(q8_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(weights_cache.ENV, raising=False)
    oj.load_model(q8_gguf, dtype="float32")
    assert os.listdir(tmp_path) == []
    assert weights_cache.resolve(None) is None  # nothing asked: off
    assert weights_cache.resolve("off") is None and weights_cache.resolve("OFF ") is None
    assert weights_cache.resolve("on") == str(tmp_path / "ouroboros-jax" / "weights")
    assert weights_cache.resolve(str(tmp_path / "w")) == str(tmp_path / "w")
    monkeypatch.setenv(weights_cache.ENV, "on")
    assert weights_cache.resolve(None) == str(tmp_path / "ouroboros-jax" / "weights")
    assert weights_cache.resolve("off") is None  # the flag wins over the environment
    monkeypatch.setenv(weights_cache.ENV, str(tmp_path / "v"))
    assert weights_cache.resolve(None) == str(tmp_path / "v")


def test_cli_flag_naming_a_file_is_refused_before_loading(q8_gguf, tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", q8_gguf, "--prompt", "hi", "--weights-cache", str(f)])
    assert "--weights-cache" in str(e.value.code) and "not a directory" in str(e.value.code)
    assert f.read_text() == "x"


def test_a_load_during_the_write_waits_for_it(q8_gguf, tmp_path, monkeypatch):
    oj.load_model(q8_gguf, dtype="float32", weights_cache=str(tmp_path))  # writes on a thread
    calls = counting_dequantizer(monkeypatch)
    oj.load_model(q8_gguf, dtype="float32", weights_cache=str(tmp_path))  # no wait() between
    assert not calls  # mapped what the first load wrote, not dequantized again


def test_a_killed_writers_temporary_file_is_removed(q8_gguf, tmp_path):
    d = entry(q8_gguf, tmp_path)
    os.makedirs(d)
    stale = os.path.join(d, f"embed.bin.{2 ** 22 + 12345}.tmp")  # above any pid_max: no process
    open(stale, "wb").write(b"partial")
    load(q8_gguf, "float32", str(tmp_path))
    assert not os.path.exists(stale) and os.path.exists(os.path.join(d, "embed.bin"))


def test_at_exit_a_writer_stops_and_leaves_no_partial_file(q8_gguf, tmp_path, monkeypatch):
    """The exit hook's flag: the writer stops before its next chunk, removes its temporary file
    and writes no further leaf (a later load writes them)."""
    m = oj.load_model(q8_gguf, dtype="float32")
    monkeypatch.setattr(weights_cache, "CHUNK", 1024)
    stop = weights_cache.threading.Event()
    stop.set()
    monkeypatch.setattr(weights_cache, "_STOP", stop)
    t = weights_cache.write_behind(str(tmp_path), q8_gguf, m.config, m.params, np.float32,
                                   say=lambda msg: None)
    t.join()
    assert os.listdir(entry(q8_gguf, tmp_path)) == []


def test_flush_waits_for_the_whole_entry(q8_gguf, tmp_path, monkeypatch):
    """The CLI's generate calls `flush` after its answer: then every leaf is whole on disk."""
    monkeypatch.setattr(weights_cache, "CHUNK", 4096)  # many chunks: the write takes a while
    m = oj.load_model(q8_gguf, dtype="float32", weights_cache=str(tmp_path))
    weights_cache.flush(progress=False)
    assert sorted(os.listdir(entry(q8_gguf, tmp_path))) == sorted(n + ".bin" for n in leaves(m))
