"""The few-row product on a CPU: y[M, N] = x[M, K] @ w[K, N] in float32 for 2 <= M <= 16 rows,
through our own kernel (`kernels/few_rows.cc`, an XLA FFI custom call) where it applies.

Why: a decode forward multiplies 1 row by every weight and a verification forward M = the
tree's nodes (5-17). XLA:CPU streams the weights once for M = 1, but for M > 1 it runs a
general matrix product that packs them first: a stack of six 1536 x 8960 products took
14-16 ms at M = 1 and 36-40 ms at M = 9 (2.2-2.5x; llama.cpp's few-row kernels ~1.4x), and on
the real pair the target's 9-token verification cost 2.2x its 1-token forward. The kernel
streams the weights once for every row: 25-28 ms at M = 9 on the same stack (2 AVX-512
cores). On the real pair (`models.timing.forward_timer`, 64 cached tokens) the target's 2- and
9-token forwards took 346 and 606 ms against XLA's 440 and 763. One row stays XLA's (its
matrix-vector product already reads at memory speed; the kernel's was slower there), and so do
weights under 2 MiB (`MIN_WEIGHTS`), where the custom call's fixed cost outweighs XLA's packing.

Exactness: each output is one chain of fused multiply-adds over k in order, whatever M is, so
a row's result does not depend on the rows beside it (tested bit for bit); against XLA's own
product it differs by float32 rounding only (the order of the sums), as XLA's one-row and
many-row products already differ from each other.

Where it runs (`enabled`): the CPU backend with one device (a custom call has no sharding
rule; a CPU mesh keeps XLA's product), an x86-64 CPU with AVX-512, a C++ compiler to build the
kernel once per machine (`g++`, ~5 s, cached under the XDG cache directory by a hash of the
source, the flags and jaxlib), and `OUROBOROS_JAX_FEW_ROWS` not `0`. Anywhere else, and for
more rows, other dtypes or quantized weights, `matmul` is `x @ w`. A build that fails is said
once on stderr and the process keeps XLA's product.

Two more forms share the build and the helper threads: `quant_matmul` (1-64 rows by a weight
kept as int8 codes, `quant.QuantArray`) and `q8_matmul`, a draft's w8a8 form (`quant.k4_codes`:
the activations quantized to int8 per row and block of 32, AVX512-VNNI dot products; close to
the model, not equal to it, so only a draft takes it).

Letters (package glossary): the product's own M rows, K inputs, N outputs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..cache_home import cache_home
from ..xla_cpu import KERNEL_ENV, cpu_has_avx512  # noqa: F401 - cpu_has_avx512 re-exported

MAX_ROWS = 16  # the kernel's register blocking (kMaxRows in the source)
MIN_ROWS = 2  # one row: XLA's matrix-vector product (see the module docstring)
# weights of fewer elements (2 MiB) keep XLA's product: they sit in the caches, where XLA's
# packing costs little and a custom call's fixed cost (a thread per call) does not. With every
# product on the kernel the demo pair's (384 x 1024 MLP, 384 x 384 attention) took speculative
# from 1.36x to 1.05x vanilla; at this bound only its 384 x 8192 LM head runs here (1.43x)
MIN_WEIGHTS = 1 << 19
TARGET = "ouroboros_few_rows_matmul"
QUANT_TARGET = "ouroboros_few_rows_quant_matmul"
Q8_TARGET = "ouroboros_few_rows_q8_matmul"
# the same products reading one layer of a stacked weight in place (`LayerOf`)
AT_TARGET = "ouroboros_few_rows_matmul_at"
QUANT_AT_TARGET = "ouroboros_few_rows_quant_matmul_at"
Q8_AT_TARGET = "ouroboros_few_rows_q8_matmul_at"
# rows a quantized weight's product takes through the kernel (in blocks of 8, each block
# streaming the codes again); more rows dequantize the weight and run XLA's product
# (`quant.linear`). A six-product stack of int8 1536 x 8960: 17 rows 39 ms through the kernel
# against 130 ms dequantized first, 32 rows 66 against 149, 64 rows 122 against 164, 150 rows
# 278 against 233
QUANT_MAX_ROWS = 64
# rows the draft's w8a8 form takes through its kernel (`q8_applies`); more dequantize first.
# The real 0.5B draft's forward of 200 rows: 1109 ms through the kernel's 8-row blocks (each
# streams the codes again), 923 ms dequantized first, 731 ms in float32
Q8_MAX_ROWS = 64
ENV = KERNEL_ENV
SOURCE = os.path.join(os.path.dirname(__file__), "kernels", "few_rows.cc")
FLAGS = ("-O3", "-mavx512f", "-mfma", "-std=c++17", "-shared", "-fPIC")


def cache_dir() -> str:
    """Where built kernels are kept: $XDG_CACHE_HOME (or ~/.cache)/ouroboros-jax/kernels."""
    return cache_home("kernels")


def library_path(compiler: str, source: str = SOURCE, flags: tuple = FLAGS) -> str:
    """A built kernel's path: named by a hash of the source, the compiler, the flags and the
    jaxlib version (whose FFI headers it is built against), so any change builds anew."""
    import jaxlib

    h = hashlib.sha256()
    with open(source, "rb") as f:
        h.update(f.read())
    h.update(repr((compiler, flags, jaxlib.__version__)).encode())
    name = os.path.splitext(os.path.basename(source))[0]
    return os.path.join(cache_dir(), f"{name}-{h.hexdigest()[:16]}.so")


def build(path: str, compiler: str, source: str = SOURCE, flags: tuple = FLAGS) -> None:
    """Compiles a kernel to `path`: into a temporary file beside it, renamed into place, so
    processes building at once (pytest's workers) never load a partial library."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    try:
        cmd = [compiler, *flags, f"-I{jax.ffi.include_dir()}", source, "-o", tmp, "-lpthread"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
            raise RuntimeError((errors or done.stderr.strip().splitlines() or
                                [f"{compiler} exited with {done.returncode}"])[0])
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# a target and its draft load on two threads at once (`loading.load_both`), each may ask first
_REGISTERING = threading.Lock()


def _registered() -> Optional[str]:
    """Builds (once per machine) and registers the kernel; its library path, or None when it
    cannot be built here (said once on stderr). Once per process, whichever thread asks."""
    with _REGISTERING:
        return _register()


@functools.lru_cache(maxsize=None)
def _register() -> Optional[str]:
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        return None
    path = library_path(compiler)
    try:
        if not os.path.exists(path):
            print("ouroboros-jax: building the few-row CPU kernel (once per machine, ~5 s)",
                  file=sys.stderr, flush=True)
            build(path, compiler)
        lib = ctypes.cdll.LoadLibrary(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.FewRowsMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(QUANT_TARGET, jax.ffi.pycapsule(lib.FewRowsQuantMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(Q8_TARGET, jax.ffi.pycapsule(lib.FewRowsQ8Matmul),
                                    platform="cpu")
        for target, fn in ((AT_TARGET, lib.FewRowsMatmulAt),
                           (QUANT_AT_TARGET, lib.FewRowsQuantMatmulAt),
                           (Q8_AT_TARGET, lib.FewRowsQ8MatmulAt)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(fn), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure keeps XLA's product
        print(f"ouroboros-jax: the few-row CPU kernel could not be built ({e}); using XLA's "
              f"product (set {ENV}=0 to skip the attempt)", file=sys.stderr)
        return None
    return path


@functools.lru_cache(maxsize=None)
def enabled() -> bool:
    """Whether `matmul` uses the kernel in this process (see the module docstring)."""
    if os.environ.get(ENV, "1") == "0":
        return False
    if jax.default_backend() != "cpu" or jax.device_count() != 1 or not cpu_has_avx512():
        return False
    return _registered() is not None


@functools.lru_cache(maxsize=None)
def q8_enabled() -> bool:
    """Whether the draft's form (`quant.k4_codes`: activations quantized too, integer dot
    products) runs here: `enabled()` on a CPU with AVX512-VNNI (Intel since Cascade Lake,
    AMD since Zen 4)."""
    return enabled() and cpu_has_avx512(flag="avx512_vnni")


def threads() -> int:
    """Threads one product splits its columns over: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def _kernel(x2: jax.Array, w: jax.Array) -> jax.Array:
    """x2 float32[M,K] @ w float32[K,N] -> float32[M,N] by the custom call."""
    out = jax.ShapeDtypeStruct((x2.shape[0], w.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method="sequential")(
        x2, w, threads=np.int64(threads()))


@jax.custom_vjp
def _product(x2: jax.Array, w: jax.Array) -> jax.Array:
    return _kernel(x2, w)


def _product_fwd(x2, w):
    return _kernel(x2, w), (x2, w)


def _product_bwd(res, g):
    x2, w = res  # the gradients by XLA's own products (a custom call has no derivative)
    return g @ w.T, x2.T @ g


_product.defvjp(_product_fwd, _product_bwd)


def applies(x: jax.Array, w: jax.Array) -> bool:
    """Whether x [..., K] @ w [K, N] goes through the kernel: float32 both, a 2-D weight of at
    least MIN_WEIGHTS elements, MIN_ROWS..MAX_ROWS rows, and `enabled()`."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    return (w.ndim == 2 and x.dtype == jnp.float32 and w.dtype == jnp.float32
            and MIN_ROWS <= rows <= MAX_ROWS and x.shape[-1] == w.shape[0]
            and w.shape[0] * w.shape[1] >= MIN_WEIGHTS and enabled())


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N]: the kernel where it `applies`, else XLA's product."""
    if not applies(x, w):
        return x @ w
    y = _product(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*x.shape[:-1], w.shape[1])


# ------------------------------------------------------------------ quantized weights
def _quant_kernel(x2, codes, scale, offset):
    """x2 float32[M,K] against int8 codes [ng,G,N], scale (and offset) float32[ng,N] ->
    float32[M,N] by the custom call (offset None: none)."""
    out = jax.ShapeDtypeStruct((x2.shape[0], codes.shape[2]), jnp.float32)
    has = offset is not None
    return jax.ffi.ffi_call(QUANT_TARGET, out, vmap_method="sequential")(
        x2, codes, scale, offset if has else scale, threads=np.int64(threads()),
        has_offset=has)


def _dense(codes, scale, offset):
    """The float32 weight [K, N] the codes stand for (for the gradient)."""
    w = codes.astype(jnp.float32) * scale[:, None, :]
    if offset is not None:
        w = w - offset[:, None, :]
    return w.reshape(-1, codes.shape[2])


@jax.custom_vjp
def _quant_product(x2, codes, scale, offset):
    return _quant_kernel(x2, codes, scale, offset)


def _quant_fwd(x2, codes, scale, offset):
    return _quant_kernel(x2, codes, scale, offset), (codes, scale, offset)


def _quant_bwd(res, g):
    codes, scale, offset = res  # the input's gradient only: the codes are not trained
    return (g @ _dense(codes, scale, offset).T, None, None, None)


_quant_product.defvjp(_quant_fwd, _quant_bwd)


def quant_applies(x: jax.Array, w) -> bool:
    """Whether x [..., K] times a one-layer `quant.QuantArray` goes through the kernel: float32
    activations and weight dtype, int8 codes (`quant.int8_codes`), 1..QUANT_MAX_ROWS rows, and
    `enabled()`. One row included: XLA:CPU converts the codes outside its product (a 1536 x
    8960 int8 matrix-vector product took 44 ms against 3.0 ms in float32)."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    return (w.lead_ndim == 0 and w.codes.dtype == jnp.int8 and x.dtype == jnp.float32
            and w.dtype == jnp.float32 and 1 <= rows <= QUANT_MAX_ROWS and enabled())


def quant_matmul(x: jax.Array, w) -> jax.Array:
    """x [..., I] times a one-layer QuantArray -> [..., O] float32 through the kernel (the
    caller checks `quant_applies`)."""
    ng, G = w.codes.shape[:2]
    O = int(np.prod(w.out_shape, dtype=np.int64))
    codes = w.codes.reshape(ng, G, O)
    scale = w.scale.reshape(ng, O)
    offset = None if w.offset is None else w.offset.reshape(ng, O)
    y = _quant_product(x.reshape(-1, x.shape[-1]), codes, scale, offset)
    return y.reshape(*x.shape[:-1], O)


# ------------------------------------------------------------------ the draft's form
def _q8_kernel(x2, codes, scale, offset):
    """x2 float32[M,K] against k4 codes uint8 [ng,G,N] (`quant.k4_codes`), scale (and offset)
    float32[ng,N] -> float32[M,N] by the custom call, x quantized per row inside it."""
    out = jax.ShapeDtypeStruct((x2.shape[0], codes.shape[2]), jnp.float32)
    has = offset is not None
    return jax.ffi.ffi_call(Q8_TARGET, out, vmap_method="sequential")(
        x2, codes, scale, offset if has else scale, threads=np.int64(threads()),
        has_offset=has)


def q8_applies(x: jax.Array, w) -> bool:
    """Whether x [..., K] times a one-layer k4 `quant.QuantArray` goes through the kernel:
    float32, 1..QUANT_MAX_ROWS rows, and `q8_enabled()` (a k4 weight anywhere else is
    dequantized first, `quant.linear`)."""
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    return (w.lead_ndim == 0 and w.k4 and x.dtype == jnp.float32 and w.dtype == jnp.float32
            and 1 <= rows <= Q8_MAX_ROWS and q8_enabled())


def q8_matmul(x: jax.Array, w) -> jax.Array:
    """x [..., I] times a one-layer k4 QuantArray -> [..., O] float32 through the kernel (the
    caller checks `q8_applies`). No gradient: the form is for drafting only."""
    ng, G = w.codes.shape[:2]
    O = int(np.prod(w.out_shape, dtype=np.int64))
    y = _q8_kernel(x.reshape(-1, x.shape[-1]), w.codes.reshape(ng, G, O),
                   w.scale.reshape(ng, O), None if w.offset is None else w.offset.reshape(ng, O))
    return y.reshape(*x.shape[:-1], O)


# ------------------------------------------------------------------ a layer of a stack, in place
class LayerOf:
    """Layer `index` (int32 scalar, traced) of a stacked weight: a float32 array [L, in...,
    out...] or a QuantArray with one lead axis, standing for that layer's weight of `shape`
    (the stack's without L, or a `reshape` of it). A forward that scans its layers
    (`llama.forward`) hands each step these instead of slices: `linear` passes the whole stack
    and the index to the kernel's `_at` form, which reads the layer where it lies. A scan's
    slice of the stack would be a copy of the layer's weights every step; unrolling the
    layers instead (one view each) puts every layer's code in the program. Only products the
    kernel takes (`at_applies`) are given these; it is no pytree, it lives inside one trace."""

    def __init__(self, stack, index, shape: Optional[tuple] = None):
        self.stack, self.index = stack, index
        self.shape = tuple(stack.shape[1:]) if shape is None else tuple(shape)

    def reshape(self, *shape) -> "LayerOf":
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        total = int(np.prod(self.shape, dtype=np.int64))
        if -1 in shape:
            known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
            shape = tuple(total // known if d == -1 else d for d in shape)
        assert int(np.prod(shape, dtype=np.int64)) == total, (self.shape, shape)
        return LayerOf(self.stack, self.index, shape)


def _quantized(w) -> bool:
    """A `quant.QuantArray` (codes and scales; read by its fields, as the forms above do)."""
    return getattr(w, "codes", None) is not None


def at_applies(stack, rows: int, x_dtype) -> bool:
    """Whether a product of `rows` rows (x of x_dtype) with one layer of `stack` has an `_at`
    form here: float32 stack and 2-16 rows (one row stays XLA's matrix-vector product, which
    reads a view as fast), an int8 QuantArray and 1-64 rows, or a w8a8 (k4) one and 1-64 rows
    on a VNNI CPU; `enabled()` in each case. Weights under MIN_WEIGHTS count too: in place,
    the kernel saves their slice's copy."""
    if x_dtype != jnp.float32 or not enabled():
        return False
    if not _quantized(stack):
        return stack.dtype == jnp.float32 and stack.ndim >= 3 and MIN_ROWS <= rows <= MAX_ROWS
    if stack.lead_ndim != 1 or stack.dtype != jnp.float32:
        return False
    if stack.k4:
        return 1 <= rows <= Q8_MAX_ROWS and q8_enabled()
    return stack.codes.dtype == jnp.int8 and 1 <= rows <= QUANT_MAX_ROWS


def matmul_at(x: jax.Array, w: LayerOf) -> jax.Array:
    """x [..., K] times layer w.index of w.stack (`at_applies` holds) -> [..., N] float32, N
    = the layer's elements / K."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    stack, layer = w.stack, jnp.asarray(w.index, jnp.int32)
    L = stack.shape[0]
    if not _quantized(stack):
        N = int(np.prod(stack.shape[1:], dtype=np.int64)) // K
        out = jax.ShapeDtypeStruct((x2.shape[0], N), jnp.float32)
        y = jax.ffi.ffi_call(AT_TARGET, out, vmap_method="sequential")(
            x2, stack.reshape(L, K, N), layer, threads=np.int64(threads()))
        return y.reshape(*x.shape[:-1], N)
    ng, G = stack.codes.shape[1:3]
    N = int(np.prod(stack.out_shape, dtype=np.int64))
    has = stack.offset is not None
    scale = stack.scale.reshape(L, ng, N)
    target = Q8_AT_TARGET if stack.k4 else QUANT_AT_TARGET
    out = jax.ShapeDtypeStruct((x2.shape[0], N), jnp.float32)
    y = jax.ffi.ffi_call(target, out, vmap_method="sequential")(
        x2, stack.codes.reshape(L, ng, G, N), scale,
        stack.offset.reshape(L, ng, N) if has else scale, layer,
        threads=np.int64(threads()), has_offset=has)
    return y.reshape(*x.shape[:-1], N)
