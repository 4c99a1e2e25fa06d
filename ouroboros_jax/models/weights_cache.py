"""The CLI's weights cache: a GGUF's dequantized weights kept on disk, mapped on the next load.

Why: the project computes in float32 (or the dtype asked), so a GGUF's quantized blocks are
dequantized at every load. On the real Qwen pair on this project's 2-core CPU that took 12-13 s
of a 50-60 s CLI call, every process (issue 53, docs/real-models.md). A second process mapping
the same float32 bytes from the page cache has them in well under a second: the arrays are
adopted by jax without a copy (`gguf_read.to_device`, page-aligned), and their pages are
faulted in by the first forward. The weights stay held once, as file-backed pages.

Where: `--weights-cache DIR` (or `on`: $XDG_CACHE_HOME/ouroboros-jax/weights, i.e.
~/.cache/ouroboros-jax/weights), else $OUROBOROS_JAX_WEIGHTS_CACHE the same way; off unless
asked. Opt-in because its first write is not free where disks are slow: on this project's VM
(a disk writing 60-86 MB/s, fresh pages slow to back) writing the real pair's 9.6 GB made the
first process 30-90 s longer (the decoding beside it up to 2x slower); later processes then
load in well under a second instead of 13 s. The library writes nothing by itself either:
`load_model(..., weights_cache=DIR)` uses one, and the CLI passes the resolved directory.

An entry is a directory named by a digest of the GGUF's resolved path, size and modification
time, the dtype and FORMAT (so a changed file, another dtype or a changed loader is a miss,
never stale weights), holding one file per params leaf. A leaf's file is written under a
temporary name and renamed once whole, and read only at the size the model's config gives it:
a reader maps the whole leaves it finds and dequantizes the others (`load_gguf_params`' keep
hook), and a damaged file is ignored and written again.

The leaves a load did not find are written by a thread from the load on (`write_behind`),
beside the compile and the decoding; the CLI's `generate` waits for it after its answer
(`flush`, with a bar), so its next process finds the whole entry (a writer that gave up at exit
left the second process half an entry; writing only after the answer cost more still). A
writer stopped at exit (the serving process ending, Ctrl-C) stops after its current chunk
(`CHUNK`) and removes its partial file; what it did not write, a later load does (a killed
writer's temporary file is removed by the next writer). Written only where the disk keeps
`FREE_MARGIN` free beside it; the first write says on stderr what it writes, where, and how
to turn it off.
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import os
import shutil
import sys
import threading
from typing import Optional

import numpy as np

from ..cache_home import cache_home
from .config import ModelConfig
from .params import Leaf, leaves_of

ENV = "OUROBOROS_JAX_WEIGHTS_CACHE"
OFF, ON = "off", "on"
# bump when dequantization or the params layout changes: entries of another format are misses
FORMAT = 1
# an entry is written only if the disk keeps this much free beside it
FREE_MARGIN = 4 << 30


def default_dir() -> str:
    """Where the CLI keeps dequantized weights unless told otherwise."""
    return cache_home("weights")


def resolve(flag: Optional[str]) -> Optional[str]:
    """The directory to use (None: no cache) from the flag, else the environment: "on" is
    `default_dir()`, "off" or nothing is none (the cache is opt-in: its first write is slow on
    slow disks, see the module's docstring)."""
    choice = (flag if flag is not None else os.environ.get(ENV) or OFF).strip()
    if choice.lower() == OFF:
        return None
    return default_dir() if choice.lower() == ON else os.path.expanduser(choice)


def entry_dir(directory: str, path: str, dtype) -> str:
    """The entry of a GGUF file's weights in `dtype`: a directory named by a digest of the
    file's resolved path, size and modification time (ns), the dtype and FORMAT."""
    real = os.path.realpath(path)
    st = os.stat(real)
    ident = f"{real}|{st.st_size}|{st.st_mtime_ns}|{np.dtype(dtype).name}|{FORMAT}"
    stem = os.path.splitext(os.path.basename(real))[0]
    return os.path.join(directory, f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}")


def _leaf_file(entry: str, leaf: Leaf) -> str:
    return os.path.join(entry, leaf.name + ".bin")


def _nbytes(leaf: Leaf, config: ModelConfig, dtype) -> int:
    return int(np.prod(leaf.shape(config), dtype=np.int64)) * np.dtype(dtype).itemsize


# entry -> the thread writing its leaves in this process: a load of the same entry waits for it
# (it would otherwise dequantize the leaves again beside the write)
_PENDING: dict = {}


def wait() -> None:
    """Waits for every write this process started (`write_behind`)."""
    while _PENDING:
        _PENDING.pop(next(iter(_PENDING))).join()


def read(directory: str, path: str, config: ModelConfig, dtype) -> dict:
    """{leaf name: jax array} of the leaves of the GGUF at `path` whose files the entry holds
    whole (the size the config gives them), each mapped without a copy; the others are not
    there (a load dequantizes them)."""
    from .gguf_read import to_device

    entry = entry_dir(directory, path, dtype)
    writing = _PENDING.pop(entry, None)
    if writing is not None:
        writing.join()
    dt = np.dtype(dtype)
    out = {}
    for leaf in leaves_of(config):
        f = _leaf_file(entry, leaf)
        try:
            if os.path.getsize(f) != _nbytes(leaf, config, dt):
                continue
        except OSError:
            continue
        # copy-on-write pages: jax never writes its inputs, and nothing reaches the file if it did
        a = np.memmap(f, dtype=dt, mode="c", shape=tuple(leaf.shape(config)))
        out[leaf.name] = to_device(a)
    return out


def write_behind(directory: str, path: str, config: ModelConfig, params: dict, dtype,
                 have=(), say=None) -> Optional[threading.Thread]:
    """Writes the leaves of `params` (a loaded model's, as `nest` builds them) not in `have`
    (names the entry holds already) on a daemon thread, started now -> the thread, or None
    where nothing is missing or the disk lacks the room (said on stderr). The caller goes on
    (`flush` waits for it); at exit it stops after its current chunk (what it did not write, a
    later load does)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    entry = entry_dir(directory, path, dtype)
    dt = np.dtype(dtype)
    have = set(have)
    todo = [leaf for leaf in leaves_of(config) if leaf.name not in have]
    if not todo:
        return None
    size = sum(_nbytes(leaf, config, dt) for leaf in todo)
    name = os.path.basename(path)
    try:
        os.makedirs(entry, exist_ok=True)
        free = shutil.disk_usage(entry).free
    except OSError as e:
        say(f"ouroboros-jax: could not cache the weights of {name} in {directory} ({e})")
        return None
    if free < size + FREE_MARGIN:
        say(f"ouroboros-jax: not caching the {dt.name} weights of {name} ({size / 1e9:.1f} GB):"
            f" {free / 1e9:.1f} GB free in {directory}")
        return None
    say(f"ouroboros-jax: keeping the {dt.name} weights of {name} ({size / 1e9:.1f} GB) in "
        f"{directory}, so later loads map them instead of dequantizing (--weights-cache off, "
        f"or {ENV}=off, turns this off)")
    arrays = [(leaf, (params["layers"] if leaf.per_layer else params)[leaf.name])
              for leaf in todo]
    t = threading.Thread(target=_write_leaves, args=(entry, arrays, dt, say), daemon=True,
                         name="ouroboros-jax weights cache")
    t.nbytes = size
    _PENDING[entry] = t
    t.start()
    return t


def flush(progress: bool = True) -> None:
    """Waits for every write this process started, with a bar on stderr over their bytes once
    2 s have passed (the CLI's generate, after its answer: its second process needs the whole
    entry)."""
    from .gguf_read import byte_bar

    todo = list(_PENDING.values())
    total, start = sum(getattr(t, "nbytes", 0) for t in todo), _WRITTEN[0]
    bar = byte_bar(total, "writing the weights cache") if progress else None
    try:
        while any(t.is_alive() for t in todo):
            for t in todo:
                t.join(0.5)
            if bar is not None:
                bar.n = _WRITTEN[0] - start
                bar.refresh()
    finally:
        if bar is not None:
            bar.close()
    wait()


_WRITTEN = [0]  # bytes the writers wrote in this process (the bar's count)


# bytes a writer thread writes between looks at the stop flag: at exit the process waits for
# at most one chunk (0.8 s at this VM's 86 MB/s)
CHUNK = 64 << 20
_STOP = threading.Event()


@atexit.register
def _stop_writers() -> None:
    """At exit (before jax's own teardown: registered after jax's import), every writer stops
    after its current chunk and removes its partial file; what it did not write, a later load
    does."""
    _STOP.set()
    wait()


def _write_leaves(entry: str, arrays: list, dt, say) -> None:
    """Each leaf to a temporary file in CHUNK pieces, renamed once whole; stops (its partial
    file removed) when the process exits."""
    _drop_stale(entry)
    for leaf, a in arrays:
        final = _leaf_file(entry, leaf)
        tmp = f"{final}.{os.getpid()}.tmp"
        done = False
        try:
            raw = np.ascontiguousarray(np.asarray(a), dt).reshape(-1).view(np.uint8)
            with open(tmp, "wb") as f:
                for i in range(0, raw.size, CHUNK):
                    if _STOP.is_set():
                        break
                    f.write(memoryview(raw[i:i + CHUNK]))
                    _WRITTEN[0] += min(CHUNK, raw.size - i)
                else:
                    done = True
            if done:
                os.replace(tmp, final)
        except OSError as e:
            say(f"ouroboros-jax: could not cache {leaf.name} in {entry} ({e})")
        finally:
            if not done and os.path.exists(tmp):
                os.remove(tmp)
        if not done:
            return


def _drop_stale(entry: str) -> None:
    """Removes temporary files left in the entry by processes that no longer run (a process
    that ended, or was killed, while writing)."""
    for tmp in glob.glob(os.path.join(glob.escape(entry), "*.tmp")):
        try:
            os.kill(int(tmp.rsplit(".", 2)[1]), 0)
        except ProcessLookupError:
            try:
                os.remove(tmp)
            except OSError:
                pass
        except (ValueError, PermissionError):
            pass
