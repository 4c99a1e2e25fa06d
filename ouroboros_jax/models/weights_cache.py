"""The CLI's weights cache: a GGUF's dequantized weights kept on disk, mapped on the next load.

Why: the project computes in float32 (or the dtype asked), so a GGUF's quantized blocks are
dequantized at every load. On the real Qwen pair on this project's 2-core CPU that took 12-13 s
of a 50-60 s CLI call, every process (issue 53, docs/real-models.md). A second process mapping
the same float32 bytes from the page cache has them in well under a second: the arrays are
adopted by jax without a copy (`gguf_read.to_device`, page-aligned), and their pages are
faulted in by the first forward. The weights stay held once, as file-backed pages.

Where: `--weights-cache DIR`, else $OUROBOROS_JAX_WEIGHTS_CACHE, else
$XDG_CACHE_HOME/ouroboros-jax/weights (~/.cache/ouroboros-jax/weights); "off" keeps nothing.
Like the compile cache, the library writes nothing by itself: `load_model(...,
weights_cache=DIR)` uses one, and the CLI passes the resolved directory.

An entry is one file of every leaf's bytes at page-aligned offsets and a JSON manifest beside
it, named by a digest of the GGUF's resolved path, size and modification time, the dtype and
FORMAT (so a changed file, another dtype or a changed loader is a miss, never stale weights).
It is written behind the caller's back (`write_behind`: a thread, while the process decodes;
the process waits for it at exit), to a temporary name then renamed, so a reader sees a whole
entry or none (a killed writer's temporary file is removed by the next writer); an entry
whose file size or leaves disagree with its manifest is ignored (and written again). An entry
is written only where the disk keeps `FREE_MARGIN` free beside it; the first load says on stderr
what it writes, where, and how to turn it off.
"""

from __future__ import annotations

import glob
import hashlib
import json
import mmap
import os
import shutil
import sys
import threading
import time
from typing import Optional

import numpy as np

from .config import ModelConfig
from .params import leaves_of, nest

ENV = "OUROBOROS_JAX_WEIGHTS_CACHE"
OFF = "off"
# bump when dequantization or the params layout changes: entries of another format are misses
FORMAT = 1
# an entry is written only if the disk keeps this much free beside it
FREE_MARGIN = 4 << 30
PAGE = mmap.PAGESIZE


def default_dir() -> str:
    """Where the CLI keeps dequantized weights unless told otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ouroboros-jax", "weights")


def resolve(flag: Optional[str]) -> Optional[str]:
    """The directory to use (None: no cache) from the flag, the environment and the default."""
    choice = flag if flag is not None else os.environ.get(ENV) or default_dir()
    return None if choice.strip().lower() == OFF else os.path.expanduser(choice)


def entry_name(path: str, dtype) -> str:
    """The entry of a GGUF file's weights in `dtype`: a digest of the file's resolved path, size
    and modification time (ns), the dtype and FORMAT."""
    real = os.path.realpath(path)
    st = os.stat(real)
    ident = f"{real}|{st.st_size}|{st.st_mtime_ns}|{np.dtype(dtype).name}|{FORMAT}"
    stem = os.path.splitext(os.path.basename(real))[0]
    return f"{stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _paths(directory: str, name: str) -> tuple[str, str]:
    return os.path.join(directory, name + ".bin"), os.path.join(directory, name + ".json")


def _aligned(n: int) -> int:
    return -(-n // PAGE) * PAGE


def read(directory: str, path: str, config: ModelConfig, dtype) -> Optional[dict]:
    """The params of the GGUF at `path` from the cache, mapped without a copy (a dict as
    `nest` builds it, jax arrays over the entry's pages), or None: no entry, or one that does
    not match the config's leaves and shapes, or whose file is not the manifest's size."""
    from .gguf_read import to_device

    data, manifest = _paths(directory, entry_name(path, dtype))
    writing = _PENDING.pop(data, None)
    if writing is not None:
        writing.join()
    try:
        with open(manifest) as f:
            meta = json.load(f)
        size = os.path.getsize(data)
    except (OSError, ValueError):
        return None
    leaves = meta.get("leaves", {})
    want = {leaf.name: leaf for leaf in leaves_of(config)}
    if size != meta.get("bytes") or set(leaves) != set(want):
        return None
    dt = np.dtype(dtype)
    for name, leaf in want.items():
        offset, shape, kind = leaves[name]
        if tuple(shape) != tuple(leaf.shape(config)) or kind != dt.name:
            return None
    # copy-on-write pages: jax never writes its inputs, and nothing reaches the file if it did
    whole = np.memmap(data, dtype=np.uint8, mode="c", shape=(size,))

    def leaf_array(leaf):
        offset, shape, _ = leaves[leaf.name]
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return to_device(whole[offset:offset + n].view(dt).reshape(shape))

    return nest(config, leaf_array)


def write_behind(directory: str, path: str, config: ModelConfig, params: dict, dtype,
                 say=None) -> threading.Thread:
    """`write` on a thread of its own, started now: the caller goes on (the file writes wait
    on the disk, not on the cores its decoding uses). Not a daemon: the interpreter waits for
    it at exit, so a process never leaves a partial entry behind, and its wall clock includes
    whatever of the write the decoding did not cover."""
    t = threading.Thread(target=write, args=(directory, path, config, params, dtype, say),
                         name="ouroboros-jax weights cache", daemon=False)
    _PENDING[_paths(directory, entry_name(path, dtype))[0]] = t
    t.start()
    return t


# entry file -> the thread writing it in this process: a load of the same entry waits for it
# (it would otherwise dequantize the file again beside the write)
_PENDING: dict = {}


def wait() -> None:
    """Waits for every write this process started (`write_behind`)."""
    while _PENDING:
        _PENDING.pop(next(iter(_PENDING))).join()


def _drop_stale(data: str) -> None:
    """Removes temporary files of this entry left by processes that no longer run (a process
    killed while writing)."""
    for tmp in glob.glob(glob.escape(data) + ".*.tmp"):
        try:
            os.kill(int(tmp.rsplit(".", 2)[1]), 0)
        except ProcessLookupError:
            try:
                os.remove(tmp)
            except OSError:
                pass
        except (ValueError, PermissionError):
            pass


def write(directory: str, path: str, config: ModelConfig, params: dict, dtype,
          say=None) -> Optional[str]:
    """Writes the params (as `read` returns them) as the entry of the GGUF at `path` -> the
    entry's file, or None where the disk lacks the room (said on stderr) or the directory
    cannot be written. say: where the one-line notice goes (stderr)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    dt = np.dtype(dtype)
    arrays = {}
    for leaf in leaves_of(config):
        where = params["layers"] if leaf.per_layer else params
        arrays[leaf.name] = np.asarray(where[leaf.name])  # no copy on the CPU backend
    leaves, offset = {}, 0
    for name, a in arrays.items():
        leaves[name] = [offset, list(a.shape), dt.name]
        offset = _aligned(offset + a.nbytes)
    data, manifest = _paths(directory, entry_name(path, dtype))
    try:
        os.makedirs(directory, exist_ok=True)
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    name = os.path.basename(path)
    if free < offset + FREE_MARGIN:
        say(f"ouroboros-jax: not caching the {dt.name} weights of {name} ({offset / 1e9:.1f} GB):"
            f" {free / 1e9:.1f} GB free in {directory}")
        return None
    say(f"ouroboros-jax: keeping the {dt.name} weights of {name} ({offset / 1e9:.1f} GB) in "
        f"{directory}, so the next load maps them instead of dequantizing; written while this "
        f"process runs (--weights-cache off, or {ENV}=off, turns this off)")
    t0 = time.perf_counter()
    _drop_stale(data)
    tmp = f"{data}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            for name_, a in arrays.items():
                f.seek(leaves[name_][0])
                f.write(memoryview(np.ascontiguousarray(a, dt).reshape(-1).view(np.uint8)))
            f.truncate(offset)
        with open(manifest + ".tmp", "w") as f:
            json.dump({"format": FORMAT, "source": os.path.realpath(path), "bytes": offset,
                       "seconds": round(time.perf_counter() - t0, 3), "leaves": leaves}, f)
        os.replace(tmp, data)  # the data first: a manifest never names a partial file
        os.replace(manifest + ".tmp", manifest)
    except OSError as e:
        for p in (tmp, manifest + ".tmp"):
            if os.path.exists(p):
                os.remove(p)
        say(f"ouroboros-jax: could not cache the weights of {name} in {directory} ({e})")
        return None
    return data
