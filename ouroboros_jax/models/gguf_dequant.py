"""GGUF blocks dequantized by a small C++ kernel (`kernels/gguf_dequant.cc`), bit-identical to
the `gguf` package's numpy kernels, for the types public checkpoints use most: Q4_0, Q4_1, Q5_0,
Q8_0, Q4_K, Q6_K. Every other type, and a machine without a C++ compiler, keeps the numpy
kernels (`gguf_read.dequantize_rows`).

Why: dequantizing is most of a GGUF load's user time, and the CLI loads at every run (issue
53's first contact). gguf's kernels run ~20 numpy operations per chunk, each a pass over the
chunk's values; the kernel makes one pass, value by value, with the same float32 operations in
the same order (built with -ffp-contract=off: no product fused into an add), so the weights
are the same bits. Built once per machine into the cache directory, as the few-row kernel is
(`few_rows.build`); `OUROBOROS_JAX_GGUF_KERNEL=0` keeps numpy's.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import sys
import threading
from typing import Optional

import numpy as np

SOURCE = os.path.join(os.path.dirname(__file__), "kernels", "gguf_dequant.cc")
# plain C++ at the build machine's baseline ISA (no -march: a cache directory may be shared)
FLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")
ENV = "OUROBOROS_JAX_GGUF_KERNEL"
_LOADING = threading.Lock()  # the target's and the draft's loads may ask at once


def _library() -> Optional[ctypes.CDLL]:
    with _LOADING:
        return _load()


@functools.lru_cache(maxsize=None)
def _load() -> Optional[ctypes.CDLL]:
    """The built kernel (built on first use), or None where it cannot be (said once)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return None
    from . import few_rows

    path = few_rows.library_path(compiler, SOURCE, FLAGS)
    try:
        if not os.path.exists(path):
            few_rows.build(path, compiler, SOURCE, FLAGS)
        lib = ctypes.CDLL(path)
    except Exception as e:  # noqa: BLE001 - any failure keeps numpy's kernels
        print(f"ouroboros-jax: the GGUF dequantizing kernel could not be built ({e}); using "
              f"numpy's (set {ENV}=0 to skip the attempt)", file=sys.stderr)
        return None
    lib.gguf_dequant_supports.argtypes = [ctypes.c_int]
    lib.gguf_dequant_supports.restype = ctypes.c_int
    lib.gguf_dequant_rows.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.gguf_dequant_rows.restype = ctypes.c_int
    lib.gguf_dequant_rows_t.argtypes = lib.gguf_dequant_rows.argtypes
    lib.gguf_dequant_rows_t.restype = ctypes.c_int
    return lib


def supports(tensor_type: int) -> bool:
    """Whether rows of this ggml type number are dequantized by the kernel here."""
    lib = _library()
    return lib is not None and bool(lib.gguf_dequant_supports(int(tensor_type)))


def dequantize_rows(blocks: np.ndarray, tensor_type: int, row_values: int
                    ) -> Optional[np.ndarray]:
    """uint8 blocks [rows, row bytes] (whole rows of one tensor) -> float32 [rows, row_values],
    or None where the kernel does not take this type here (the caller uses numpy's)."""
    if not supports(tensor_type):
        return None
    out = np.empty((blocks.shape[0], row_values), np.float32)
    return out if dequantize_into(blocks, tensor_type, row_values, out, False) else None


def dequantize_into(blocks: np.ndarray, tensor_type: int, row_values: int, out: np.ndarray,
                    transposed: bool) -> bool:
    """Rows of uint8 blocks [rows, row bytes] dequantized straight into `out`: a float32 view
    [rows, row_values] (transposed: [row_values, rows], a torch Linear's rows into our [in,
    out] leaf) whose last axis is contiguous. False, writing nothing, where the kernel does
    not take this type here or `out` is not such a view (the caller goes the numpy way)."""
    rows = blocks.shape[0]
    want = (row_values, rows) if transposed else (rows, row_values)
    if (out.dtype != np.float32 or out.shape != want or out.strides[1] != 4
            or out.strides[0] % 4 or not supports(tensor_type)):
        return False
    blocks = np.ascontiguousarray(blocks, np.uint8)
    fn = _library().gguf_dequant_rows_t if transposed else _library().gguf_dequant_rows
    return fn(int(tensor_type), blocks.ctypes.data, rows, row_values, out.ctypes.data,
              out.strides[0] // 4) == 0
