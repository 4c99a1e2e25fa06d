"""Reading a GGUF file at disk speed: the header, metadata and tensor table parsed with `struct`
over one memory map, and tensors dequantized chunk by chunk straight into preallocated arrays.

Why not `gguf.GGUFReader`: it builds numpy views for every metadata element, two per string, so a
150k-token vocabulary plus its 150k merges costs ~500k views (tens of seconds on a small CPU)
before a weight is read. `GGUFFile` walks the same bytes with `struct` and decodes string arrays
only when asked. Its `fields`, `get_field(key).contents()` and `tensors` (`gguf.ReaderTensor`s,
with `data` a view of the map) behave as the reader's do, which is all `gguf.py` uses.

Why not `gguf.dequantize` per tensor: it dequantizes 16 rows at a time (per-call overhead on
small rows) and returns a whole float32 copy that the loader then transposed, cast and stacked
(Qwen2.5 0.5B peaked at 6.7 GB). `fill_leaf` calls the same per-block kernels
(`dequantize_blocks`, so the values are bit-identical) on chunks of ~`CHUNK_ELEMS` values, writes
each chunk, transposed and cast, into its place in the leaf's one preallocated array, and lets
the kernel's temporaries die with the chunk. Host memory stays near the weights themselves.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any, Callable, Optional

import numpy as np

DEFAULT_ALIGNMENT = 32  # general.alignment when the file does not say
VERSIONS = (2, 3)
# values per dequantized chunk: large enough that the kernels' per-call overhead (~20 numpy calls)
# is small, small enough that their temporaries and the transposed write stay in cache (measured
# on Q4_K/Q6_K rows of 1536: 2^17 is ~2x faster than 2^20 or 2^15)
CHUNK_ELEMS = 1 << 17
# values per unit of work handed to a thread
PIECE_ELEMS = 1 << 22

# GGUFValueType -> struct code (scalars); 8 = string, 9 = array
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
           12: "d"}
_STRING, _ARRAY = 8, 9


class Field:
    """One metadata value, as `gguf.ReaderField` presents it: `contents()` gives the Python value
    (a str, int, float, bool, or a list of them for an array), `types` the GGUFValueType chain
    ([ARRAY, element type] for an array), `data` one index per array element (its length is the
    array's). String arrays are decoded on the first `contents()` call."""

    def __init__(self, name: str, types: list, value: Any = None,
                 decode: Optional[Callable[[], list]] = None, count: int = 1):
        self.name = name
        self.types = types
        self._value = value
        self._decode = decode
        self.data = range(count) if types and int(types[0]) == _ARRAY else [0]

    def contents(self, index_or_slice=slice(None)) -> Any:
        if self._decode is not None:
            self._value, self._decode = self._decode(), None
        if isinstance(self._value, list):
            return self._value[index_or_slice]
        return self._value


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> `Field`) and tensors (`tensors`: a list of
    `gguf.ReaderTensor` whose `data` is a zero-copy view of the map: float32/float16/float64 for
    those types, else the raw bytes, [rows..., bytes per row]). Raises ValueError (or
    struct.error/IndexError, which `gguf.open_gguf` turns into one naming the file) on a file
    that is not a readable GGUF."""

    def __init__(self, path: str):
        from gguf import GGMLQuantizationType, GGUFValueType

        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ValueError("empty file")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        mm = self._mm
        if mm[:4] != b"GGUF":
            raise ValueError(f"bad magic {mm[:4]!r}")
        order = "<"
        (version,) = struct.unpack_from("<I", mm, 4)
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            order = ">"
            (version,) = struct.unpack_from(">I", mm, 4)
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (supported: {VERSIONS})")
        self.byte_order = order
        n_tensors, n_kv = struct.unpack_from(order + "QQ", mm, 8)
        pos = 24
        self.fields: dict[str, Field] = {}
        self.spans: dict[str, tuple[int, int]] = {}  # key -> its entry's bytes [start, end)
        for _ in range(n_kv):
            start = pos
            key, pos = self._string(pos)
            (kind,) = struct.unpack_from(order + "I", mm, pos)
            field, pos = self._field(key, kind, pos + 4, GGUFValueType)
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            self.fields[key] = field
            self.spans[key] = (start, pos)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from(order + "I", mm, pos)
            dims = struct.unpack_from(order + f"{n_dims}Q", mm, pos + 4)
            pos += 4 + 8 * n_dims
            kind, offset = struct.unpack_from(order + "IQ", mm, pos)
            pos += 12
            infos.append((name, dims, GGMLQuantizationType(kind), offset))
        align = self.fields.get("general.alignment")
        self.alignment = DEFAULT_ALIGNMENT
        if align is not None:
            a = align.contents()
            if align.types != [GGUFValueType.UINT32] or a == 0 or a & (a - 1):
                raise ValueError(f"bad general.alignment {a!r}")
            self.alignment = a
        self.data_offset = -(-pos // self.alignment) * self.alignment
        self.tensors = [self._tensor(*info, size) for info in infos]

    def digest(self, keys) -> str:
        """A hash of the raw bytes of the metadata entries `keys` (those present, in file
        order): equal for two files whose entries are byte for byte the same, without decoding
        them (a 150k-token vocabulary decodes in ~0.5 s; its bytes hash in milliseconds)."""
        import hashlib

        h = hashlib.sha256(self.byte_order.encode())
        for key in self.fields:
            if key in keys:
                a, b = self.spans[key]
                h.update(self._mm[a:b])
        return h.hexdigest()

    # ---------------------------------------------------------------- parsing
    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(self.byte_order + "Q", self._mm, pos)
        end = pos + 8 + n
        if end > len(self._mm):
            raise ValueError("a string runs past the end of the file")
        return self._mm[pos + 8:end].decode("utf-8"), end

    def _field(self, key: str, kind: int, pos: int, value_types) -> tuple[Field, int]:
        order, mm = self.byte_order, self._mm
        if kind in _SCALAR:
            code = order + _SCALAR[kind]
            (v,) = struct.unpack_from(code, mm, pos)
            return Field(key, [value_types(kind)], v), pos + struct.calcsize(code)
        if kind == _STRING:
            v, pos = self._string(pos)
            return Field(key, [value_types(kind)], v), pos
        if kind != _ARRAY:
            raise ValueError(f"metadata key {key!r} has unknown value type {kind}")
        sub, count = struct.unpack_from(order + "IQ", mm, pos)
        pos += 12
        types = [value_types(_ARRAY)]
        if sub in _SCALAR:
            width = struct.calcsize(_SCALAR[sub])
            end = pos + count * width
            if end > len(mm):
                raise ValueError(f"metadata array {key!r} runs past the end of the file")
            arr = np.frombuffer(mm, np.dtype(_SCALAR[sub]).newbyteorder(order), count, pos)
            return Field(key, types + [value_types(sub)], count=count,
                         decode=lambda: arr.tolist()), end
        if sub == _STRING:
            start = pos
            for _ in range(count):  # lengths only: the strings are decoded when asked for
                (n,) = struct.unpack_from(order + "Q", mm, pos)
                pos += 8 + n
            if pos > len(mm):
                raise ValueError(f"metadata array {key!r} runs past the end of the file")
            return Field(key, types + [value_types(sub)], count=count,
                         decode=lambda: self._strings(start, count)), pos
        if sub == _ARRAY:  # flattened, as gguf.GGUFReader does
            values, subtypes = [], []
            for _ in range(count):
                f, pos = self._field(key, sub, pos, value_types)
                values += f.contents()
                subtypes = subtypes or f.types
            return Field(key, types + subtypes, values, count=count), pos
        raise ValueError(f"metadata key {key!r} holds an array of unknown type {sub}")

    def _strings(self, pos: int, count: int) -> list[str]:
        out = []
        for _ in range(count):
            s, pos = self._string(pos)
            out.append(s)
        return out

    def _tensor(self, name: str, dims: tuple, kind, offset: int, size: int):
        from gguf import GGML_QUANT_SIZES, ReaderTensor

        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elems * type_size // block
        start = self.data_offset + offset
        shape = tuple(int(d) for d in reversed(dims))
        plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                 "I16": np.int16, "I32": np.int32, "I64": np.int64}.get(kind.name)
        if start + n_bytes > size:
            raise ValueError(f"tensor {name}: its data ends past the end of the file "
                             f"(truncated file)")
        if plain is not None:
            dtype = np.dtype(plain).newbyteorder(self.byte_order)
            data = np.frombuffer(self._mm, dtype, n_elems, start).reshape(shape)
        else:
            if shape[-1] % block:
                raise ValueError(f"tensor {name}: row of {shape[-1]} values is not a whole "
                                 f"number of {kind.name} blocks of {block}")
            data = np.frombuffer(self._mm, np.uint8, n_bytes, start).reshape(
                *shape[:-1], shape[-1] // block * type_size)
        return ReaderTensor(name=name, tensor_type=kind, shape=np.array(dims, np.uint64),
                            n_elements=n_elems, n_bytes=n_bytes, data_offset=start, data=data,
                            field=None)

    # ---------------------------------------------------------------- access
    def get_field(self, key: str) -> Optional[Field]:
        return self.fields.get(key)

    def release(self, t) -> None:
        """Drops the tensor's pages from this process's resident set (they stay in the page
        cache): once dequantized, its bytes are not needed again, and counting them on top of
        the weights would put the peak at weights + file."""
        page = mmap.PAGESIZE
        lo = t.data_offset // page * page
        hi = min(len(self._mm), t.data_offset + t.n_bytes)
        if hasattr(self._mm, "madvise") and hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


# -------------------------------------------------------------------- dequantization
def dequantize_rows(t, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of tensor `t` (numpy order: the last dimension is a row) as float32
    [stop - start, row length], computed as `gguf.dequantize` computes them (the same per-block
    kernel, or `gguf_dequant`'s C++ one for the types it takes: the same operations), so
    bit-identical to it."""
    from gguf import quants

    from .gguf_dequant import dequantize_rows as kernel_rows

    kind = t.tensor_type.name
    data = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim else t.data.reshape(1, 1)
    rows = data[start:stop]
    if kind in ("F32", "F16", "F64"):
        return rows.astype(np.float32)
    n_values = int(t.shape[0])
    fast = kernel_rows(rows, int(t.tensor_type), n_values)
    if fast is not None:
        return fast
    q = quants._type_traits[t.tensor_type]
    q.init_grid()
    out = q.dequantize_blocks(np.ascontiguousarray(rows).reshape(-1, q.type_size))
    return out.reshape(stop - start, n_values)


def row_count(t) -> int:
    """Rows of `t` in numpy order (every dimension but the last, which `shape[0]` holds in
    GGUF's innermost-first order)."""
    return int(np.prod(t.shape[1:], dtype=np.int64)) if len(t.shape) > 1 else 1


def pieces(t, row_align: int = 1, elems: int = PIECE_ELEMS) -> list[tuple[int, int]]:
    """`t`'s rows cut into [start, stop) ranges of about `elems` values, each a whole multiple
    of `row_align` rows (but the last): the units handed to worker threads."""
    n_rows = row_count(t)
    per = max(1, elems // max(1, int(t.shape[0])) // row_align) * row_align
    return [(r0, min(n_rows, r0 + per)) for r0 in range(0, n_rows, per)]


def fill_tensor(t, out2d: np.ndarray, transpose: bool, row_align: int = 1,
                rows_fn: Optional[Callable[[np.ndarray], np.ndarray]] = None,
                rows: Optional[tuple[int, int]] = None) -> None:
    """Dequantizes rows [start, stop) of `t` (`rows`; all by default) chunk by chunk into
    `out2d`: [rows, row length] when `transpose` is False, else [row length, rows] (a torch
    Linear [out, in] into our [in, out]). Chunks are whole multiples of `row_align` rows;
    `rows_fn` (e.g. undoing llama.cpp's q/k permutation, per head) is applied to each chunk
    first. Casting to `out2d`'s dtype happens in the copy."""
    start, stop = rows if rows is not None else (0, row_count(t))
    if rows_fn is None and t.data.ndim and t.tensor_type.name not in ("F32", "F16", "F64"):
        from .gguf_dequant import dequantize_into

        dest = out2d[:, start:stop] if transpose else out2d[start:stop]
        data = t.data.reshape(-1, t.data.shape[-1])[start:stop]
        if dequantize_into(data, int(t.tensor_type), int(t.shape[0]), dest, transpose):
            return  # in one pass, transposed as it is written (`gguf_dequant`)
    per = max(1, CHUNK_ELEMS // max(1, int(t.shape[0])) // row_align) * row_align
    for r0 in range(start, stop, per):
        r1 = min(stop, r0 + per)
        w = dequantize_rows(t, r0, r1)
        if rows_fn is not None:
            w = rows_fn(w)
        if transpose:
            out2d[:, r0:r1] = w.T
        else:
            out2d[r0:r1] = w


def aligned_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array on fresh anonymous pages: page-aligned, so that on the CPU backend
    `jax.device_put(..., may_alias=True)` adopts it without a copy. Not `np.empty`: numpy asks
    for transparent huge pages on large arrays, and where memory is fragmented the kernel's
    compaction for them cost 3.6x the system time of plain pages (2 GB: 4.6 s vs 1.3 s, here)."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if n == 0:
        return np.empty(shape, dtype)
    # private: Python's default anonymous map is shared, i.e. shmem pages, whose first touch
    # cost 1.7x a private page's system time here (4 GB: 2.2-2.4 s against 1.3)
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)
    return np.frombuffer(mmap.mmap(-1, n, flags=flags), dtype).reshape(shape)


def to_device(a: np.ndarray):
    """`a` as a jax array: adopted without a copy on the CPU backend (the array is aligned and
    nobody writes it again), copied to the default device elsewhere."""
    import jax

    return jax.device_put(a, may_alias=True)


def byte_bar(total: int, desc: str):
    """A tqdm bar over `total` bytes on stderr, shown only once 2 s have passed (quick work
    stays silent); None where tqdm is missing or too old for `delay` (then silent rather than
    always printing)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    import sys

    try:
        return tqdm(total=total, unit="B", unit_scale=True, desc=desc, delay=2.0,
                    mininterval=1.0, file=sys.stderr, leave=False, dynamic_ncols=True)
    except TypeError:
        return None
