"""The few-row CPU product (models/few_rows.py): the kernel against a float64 reference over
the shapes its blocking has edges at, rows independent of their neighbours, its gradient, and
where it does and does not apply. Needs an AVX-512 CPU and a C++ compiler (the kernel's own
requirements: elsewhere the library keeps XLA's product, which every other test exercises)."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouroboros_jax.models import few_rows, quant

needs_kernel = pytest.mark.skipif(
    not few_rows.cpu_has_avx512() or shutil.which("g++") is None,
    reason="the few-row kernel needs an AVX-512 CPU and g++ (XLA's product runs instead)")


@pytest.fixture
def kernel_on(monkeypatch):
    """The kernel on in this process: the suite runs 8 fake CPU devices, where `enabled()` keeps
    XLA's product (a custom call has no sharding rule); these tests run unsharded products."""
    assert few_rows._registered() is not None
    monkeypatch.setattr(few_rows, "enabled", lambda: True)
    monkeypatch.setattr(few_rows, "MIN_WEIGHTS", 1)  # small shapes reach the kernel too


def _ref(x, w):
    return np.asarray(x, np.float64).reshape(-1, x.shape[-1]) @ np.asarray(w, np.float64)


@needs_kernel
@pytest.mark.parametrize("rows,k,n", [(2, 96, 200), (9, 1537, 1000), (16, 7, 17), (5, 1, 1),
                                      (3, 33, 16), (13, 64, 4097)])
def test_kernel_matches_a_float64_product(rows, k, n, kernel_on):
    rng = np.random.default_rng(rows * 1000 + n)
    x = jnp.asarray(rng.standard_normal((1, rows, k), np.float32))
    w = jnp.asarray(rng.standard_normal((k, n), np.float32))
    assert few_rows.applies(x, w)
    y = np.asarray(jax.jit(few_rows.matmul)(x, w))
    assert y.shape == (1, rows, n)
    ref = _ref(x, w)
    # float32 sums of k terms of unit size: rounding ~ sqrt(k) * 2^-24 * |terms|
    assert np.abs(y.reshape(rows, n) - ref).max() <= 1e-5 * np.sqrt(k) * np.abs(ref).max() + 1e-6
    # every column is written (a masked tail that skipped one would leave garbage or zeros)
    assert np.all(np.isfinite(y)) and np.abs(y - ref.reshape(y.shape)).max() < 1e-2


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel_on):
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((9, 1536), np.float32))
    w = jnp.asarray(rng.standard_normal((1536, 300), np.float32))
    f = jax.jit(few_rows.matmul)
    y9 = np.asarray(f(x, w))
    for lo in (0, 4, 7):
        pair = np.asarray(f(x[lo:lo + 2], w))
        assert np.array_equal(pair, y9[lo:lo + 2])  # bit for bit


@needs_kernel
def test_gradient_is_xlas(kernel_on):
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 3, 40), np.float32))
    w = jnp.asarray(rng.standard_normal((40, 24), np.float32))
    g = jax.grad(lambda x, w: jnp.sum(few_rows.matmul(x, w) ** 2), argnums=(0, 1))(x, w)
    h = jax.grad(lambda x, w: jnp.sum((x @ w) ** 2), argnums=(0, 1))(x, w)
    for a, b in zip(g, h):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_where_it_applies(kernel_on):
    w = jnp.zeros((8, 4), jnp.float32)
    assert few_rows.applies(jnp.zeros((1, 2, 8)), w)
    assert few_rows.applies(jnp.zeros((4, 4, 8)), w)  # 16 rows
    assert not few_rows.applies(jnp.zeros((1, 1, 8)), w)  # one row: XLA's matrix-vector product
    assert not few_rows.applies(jnp.zeros((17, 8)), w)  # a prefill's many rows
    assert not few_rows.applies(jnp.zeros((2, 8), jnp.bfloat16), w.astype(jnp.bfloat16))
    assert not few_rows.applies(jnp.zeros((2, 8)), jnp.zeros((8, 2, 2)))


def test_small_weights_keep_xlas_product(monkeypatch):
    """Weights that sit in the caches keep XLA's product (the kernel's fixed cost per call
    outweighs XLA's packing there: the demo pair's products)."""
    monkeypatch.setattr(few_rows, "enabled", lambda: True)
    x = jnp.zeros((1, 9, 1024), jnp.float32)
    assert not few_rows.applies(x, jnp.zeros((1024, few_rows.MIN_WEIGHTS // 1024 - 1)))
    assert few_rows.applies(x, jnp.zeros((1024, few_rows.MIN_WEIGHTS // 1024)))


@needs_kernel
def test_linear_uses_it_for_a_few_rows_only(kernel_on):
    """quant.linear, every plain weight product of the models, runs the custom call for a
    few rows and XLA's dot otherwise (read off the lowered program)."""
    w = jnp.ones((8, 6), jnp.float32)
    few = jax.jit(lambda x: quant.linear(x, w)).lower(jnp.ones((1, 3, 8))).as_text()
    one = jax.jit(lambda x: quant.linear(x, w)).lower(jnp.ones((1, 1, 8))).as_text()
    assert few_rows.TARGET in few and few_rows.TARGET not in one
    y = jax.jit(lambda x: quant.linear(x, w, out_dtype=jnp.float32))(jnp.ones((1, 3, 8)))
    np.testing.assert_allclose(np.asarray(y), 8.0)


def test_off_on_a_multi_device_cpu():
    assert jax.device_count() > 1  # the suite's fake mesh (conftest.py)
    assert not few_rows.enabled()


def test_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(few_rows.ENV, "0")
    few_rows.enabled.cache_clear()
    try:
        assert not few_rows.enabled()
        assert not few_rows.applies(jnp.zeros((2, 8)), jnp.zeros((8, 4)))
    finally:
        few_rows.enabled.cache_clear()


def test_a_failed_build_keeps_xlas_product(monkeypatch, tmp_path, capsys):
    """A compiler that fails: one line on stderr naming the way out, and no kernel."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", shutil.which("false") or "false")
    few_rows._register.cache_clear()
    try:
        assert few_rows._registered() is None
        err = capsys.readouterr().err
        assert "building the few-row CPU kernel" in err  # said before the seconds it takes
        assert "could not be built" in err and few_rows.ENV in err
    finally:
        few_rows._register.cache_clear()
        few_rows.enabled.cache_clear()


def test_cpuinfo_parsing(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw\n")
    assert few_rows.cpu_has_avx512(str(p))
    p.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512_bf16\n")
    assert not few_rows.cpu_has_avx512(str(p))
    assert not few_rows.cpu_has_avx512(str(tmp_path / "missing"))


EXACT_SCRIPT = """
import json, sys
import ouroboros_jax as oj
from ouroboros_jax.models import few_rows
assert few_rows.enabled(), "the kernel should be on in a one-device CPU process"
few_rows.MIN_WEIGHTS = 1  # the tiny models' products reach the kernel too
traced, kernel = [0], few_rows._kernel
def counted(x2, w):
    traced[0] += 1
    return kernel(x2, w)
few_rows._kernel = counted
qtraced, qkernel = [0], few_rows._quant_kernel
def qcounted(*a):
    qtraced[0] += 1
    return qkernel(*a)
few_rows._quant_kernel = qcounted
q8traced, q8kernel = [0], few_rows._q8_kernel
def q8counted(*a):
    q8traced[0] += 1
    return q8kernel(*a)
few_rows._q8_kernel = q8counted
t, d = oj.load_model(sys.argv[1]), oj.load_model(sys.argv[2])
dq = oj.load_model(sys.argv[2], quantize="int8")  # the CLI's default draft without VNNI
d8 = oj.load_model(sys.argv[2], quantize="w8a8")  # and with it (k4 codes where it runs)
prompts = [[1, 5, 9, 14, 3, 7, 22], [1, 40, 41, 42, 40, 41, 42, 40, 41]]
out = {}
for method, cfg in [("vanilla", None), ("speculative", oj.SpeculativeConfig(gamma=4)),
                    ("prompt_lookup", None), ("ouroboros", None)]:
    kw = {} if cfg is None else {"config": cfg}
    r = oj.generate(t, prompts, draft=None if method in ("vanilla", "prompt_lookup") else d,
                    method=method, max_new_tokens=12, **kw)
    out[method] = [list(map(int, row)) for row in r.tokens]
for method in ("speculative", "ouroboros"):
    r = oj.generate(t, prompts, draft=dq, method=method, max_new_tokens=12)
    out[method + "_int8_draft"] = [list(map(int, row)) for row in r.tokens]
    r = oj.generate(t, prompts, draft=d8, method=method, max_new_tokens=12)
    out[method + "_w8a8_draft"] = [list(map(int, row)) for row in r.tokens]
# the packed layout (views on a CPU): verifications and the quantized drafts' forwards scan
# their layers over the stacks, each product reading its layer in place (few_rows.LayerOf)
from ouroboros_jax.models import layout
layout.set_packing(True)
attraced, at = [0], few_rows.matmul_at
def atcounted(*a):
    attraced[0] += 1
    return at(*a)
few_rows.matmul_at = atcounted
for method, draft in [("vanilla", None), ("speculative", d), ("ouroboros", d),
                      ("speculative", dq), ("speculative", d8), ("ouroboros", d8)]:
    r = oj.generate(t, prompts, draft=draft, method=method, max_new_tokens=12)
    name = "packed_" + method + {id(dq): "_int8", id(d8): "_w8a8"}.get(id(draft), "")
    out[name] = [list(map(int, row)) for row in r.tokens]
assert attraced[0] > 0, "no forward scanned its layers in place"
assert traced[0] > 0, "no product went through the kernel"
assert qtraced[0] > 0, "no quantized product went through the kernel"
assert q8traced[0] > 0 or not few_rows.q8_enabled(), "no w8a8 product went through the kernel"
print(json.dumps(out))
"""


@needs_kernel
@pytest.mark.slow
def test_methods_with_the_kernel_give_transformers_tokens(tmp_path):
    """A one-device process (the kernel on: prefill of <= 16 tokens and every verification):
    vanilla gives transformers' greedy tokens, and every method gives vanilla's, with a float
    draft and with an int8 draft whose products run through the quantized kernel; and in the
    packed layout too, where those forwards scan their layers reading each in place."""
    import json
    import os
    import subprocess
    import sys

    import torch

    from conftest import make_hf_model

    td, dd = tmp_path / "t", tmp_path / "d"
    torch_t = make_hf_model(td, seed=0)
    make_hf_model(dd, seed=1, layers=1)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    # programs read back from a compile cache are not traced, and the check counts traces
    env["OUROBOROS_JAX_COMPILE_CACHE"] = "off"
    env["OUROBOROS_JAX_CACHE"] = str(tmp_path / "auto")
    done = subprocess.run([sys.executable, "-c", EXACT_SCRIPT, str(td), str(dd)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    prompts = [[1, 5, 9, 14, 3, 7, 22], [1, 40, 41, 42, 40, 41, 42, 40, 41]]
    for i, p in enumerate(prompts):
        with torch.no_grad():
            ref = torch_t.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert out["vanilla"][i][:len(ref)] == ref
    for method in ("speculative", "prompt_lookup", "ouroboros", "speculative_int8_draft",
                   "ouroboros_int8_draft", "speculative_w8a8_draft", "ouroboros_w8a8_draft",
                   "packed_vanilla", "packed_speculative", "packed_ouroboros",
                   "packed_speculative_int8", "packed_speculative_w8a8",
                   "packed_ouroboros_w8a8"):
        assert out[method] == out["vanilla"], method


# ------------------------------------------------------------------ quantized weights
def _qweight(rng, k, n, G, offset):
    codes = rng.integers(-16, 16, (k // G, G, n)).astype(np.int8)
    scale = rng.random((k // G, n), np.float32) + np.float32(0.01)
    off = rng.random((k // G, n), np.float32) if offset else None
    return quant.QuantArray(jnp.asarray(codes), jnp.asarray(scale),
                            None if off is None else jnp.asarray(off), (k,), 1, 8, jnp.float32)


@needs_kernel
@pytest.mark.parametrize("rows,k,n,G,offset", [
    (1, 96, 200, 32, False), (1, 896, 4864, 32, True), (2, 64, 17, 16, True),
    (3, 4864, 40, 4864, False), (9, 128, 1000, 32, True), (16, 64, 31, 16, False),
    (5, 33, 16, 33, True), (8, 256, 4097, 32, False), (4, 1024, 96, 32, True),
    (40, 96, 70, 32, True)])
def test_quantized_kernel_matches_a_float64_product(rows, k, n, G, offset, kernel_on):
    """Groups split over threads (many groups) and columns split (one group per channel), the
    row blocks of 8 (9 and 16 rows), NB register blocks (1-2, 3-4, 5-8 rows) and column tails."""
    rng = np.random.default_rng(rows * 7 + n + G)
    w = _qweight(rng, k, n, G, offset)
    x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
    assert few_rows.quant_applies(x, w)
    y = np.asarray(jax.jit(quant.linear)(x, w))
    ref = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(w), np.float64)
    assert y.shape == (rows, n) and np.all(np.isfinite(y))
    assert np.abs(y - ref).max() <= 2e-5 * np.sqrt(k) * np.abs(ref).max() + 1e-5


@needs_kernel
@pytest.mark.parametrize("form,G,n", [("int8", 32, 300), ("int8", 640, 300),
                                      ("int8", 640, 1100), ("w8a8", 32, 300),
                                      ("w8a8", 32, 1100)])
def test_quantized_rows_do_not_depend_on_the_rows_beside_them(form, G, n, kernel_on,
                                                              monkeypatch):
    """Both quantized forms, bit for bit, over column chunks too (n = 1100: three chunks of
    kChunk = 512, the last short)."""
    rng = np.random.default_rng(G + n)
    w = _qweight(rng, 640, n, G, True)
    if form == "w8a8":
        if not few_rows.cpu_has_avx512(flag="avx512_vnni"):
            pytest.skip("the w8a8 product needs AVX512-VNNI")
        monkeypatch.setattr(few_rows, "q8_enabled", lambda: True)
        w = quant.k4_codes({"w": w})["w"]
    x = jnp.asarray(rng.standard_normal((16, 640), np.float32))
    f = jax.jit(quant.linear)
    y16 = np.asarray(f(x, w))
    for lo, m in ((0, 1), (3, 1), (2, 3), (8, 5), (1, 9)):
        assert np.array_equal(np.asarray(f(x[lo:lo + m], w)), y16[lo:lo + m])  # bit for bit


@needs_kernel
def test_quantized_gradient_is_the_dequantized_products(kernel_on):
    rng = np.random.default_rng(5)
    w = _qweight(rng, 64, 48, 32, True)
    x = jnp.asarray(rng.standard_normal((2, 64), np.float32))
    g = jax.grad(lambda x: jnp.sum(quant.linear(x, w) ** 2))(x)
    wd = quant.dequantize(w)
    ref = jax.grad(lambda x: jnp.sum((x @ wd) ** 2))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_quantized_products_route(kernel_on):
    """1-64 rows of an int8-coded weight: the custom call; a longer prefill's 65 rows: no
    custom call (dequantized, then XLA's product); 4-bit codes not made int8: XLA's grouped
    product."""
    rng = np.random.default_rng(1)
    w = _qweight(rng, 64, 48, 32, False)
    top = few_rows.QUANT_MAX_ROWS
    for rows, want in ((1, True), (17, True), (top, True), (top + 1, False)):
        x = jnp.zeros((rows, 64), jnp.float32)
        text = jax.jit(quant.linear).lower(x, w).as_text()
        assert (few_rows.QUANT_TARGET in text) is want, rows
    c4 = jnp.clip(w.codes, -8, 7)
    w4 = quant.QuantArray(c4.astype(jnp.int4), w.scale, None, (64,), 1, 4, jnp.float32)
    assert not few_rows.quant_applies(jnp.zeros((1, 64), jnp.float32), w4)
    w8 = quant.int8_codes({"w": w4})["w"]
    assert w8.codes.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(w8.codes), np.asarray(c4))


def test_draft_scheme(monkeypatch):
    """--draft-quantize: auto is w8a8 where the kernel runs with VNNI, int8 where it runs
    without (float32), else --quantize."""
    monkeypatch.setattr(few_rows, "enabled", lambda: True)
    monkeypatch.setattr(few_rows, "q8_enabled", lambda: True)
    assert quant.draft_scheme("auto", None, jnp.float32) == "w8a8"
    assert quant.draft_scheme("w8a8", None, jnp.float32) == "w8a8"
    monkeypatch.setattr(few_rows, "q8_enabled", lambda: False)
    assert quant.draft_scheme("auto", None, jnp.float32) == "int8"
    assert quant.draft_scheme("auto", None, jnp.bfloat16) is None
    assert quant.draft_scheme("auto", "int4", jnp.float32) == "int4"
    assert quant.draft_scheme("off", None, jnp.float32) is None
    assert quant.draft_scheme("int4", None, jnp.float32) == "int4"
    from ouroboros_jax import demo_pair

    _, small = demo_pair()  # 3M parameters: in the caches, left float
    assert quant.draft_scheme("auto", None, jnp.float32, small) is None
    assert quant.draft_scheme("int8", None, jnp.float32, small) == "int8"
    monkeypatch.setattr(few_rows, "enabled", lambda: False)
    assert quant.draft_scheme("auto", None, jnp.float32) is None
    with pytest.raises(ValueError, match="draft quantize"):
        quant.draft_scheme("int2", None, jnp.float32)


def test_cli_refuses_a_bad_draft_quantize(capsys):
    from ouroboros_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "--draft-quantize", "int2", "--prompt", "x"])
    assert e.value.code == 2
    assert "--draft-quantize" in capsys.readouterr().err


# ------------------------------------------------------------------ the draft's form (w8a8)
needs_vnni = pytest.mark.skipif(
    not few_rows.cpu_has_avx512(flag="avx512_vnni") or shutil.which("g++") is None,
    reason="the w8a8 product needs AVX512-VNNI and g++ (a w8a8 draft stays int8 elsewhere)")


@pytest.fixture
def q8_on(kernel_on, monkeypatch):
    monkeypatch.setattr(few_rows, "q8_enabled", lambda: True)


def _q8_reference(x, w):
    """float64 product of x quantized as the kernel does (per row, blocks of 32 inputs or the
    group length: round(x * 127 / max|x|)) against codes * scale, less the float x's group sums
    times the offsets (the offset term reads x itself)."""
    x = np.asarray(x, np.float64)
    K, G = x.shape[-1], w.group_size
    XB = 32 if G % 32 == 0 else G
    xb = x.reshape(-1, K // XB, XB)
    amax = np.abs(xb).max(-1, keepdims=True)
    xq = np.clip(np.rint(xb * (127 / np.where(amax > 0, amax, 1))), -127, 127)
    plain = quant.QuantArray(quant.plain_codes(w) if w.k4 else w.codes, w.scale, None,
                             w.in_shape, 1, 8, jnp.float32)
    y = (xq * amax / 127).reshape(x.shape) @ np.asarray(quant.dequantize(plain), np.float64)
    if w.offset is not None:
        y = y - x.reshape(-1, K // G, G).sum(-1) @ np.asarray(w.offset, np.float64)
    return y


def test_k4_codes_round_trip():
    """k4_codes stores code + 128 with four inputs side by side per column, in the plain
    shape; plain_codes and dequantize read it back exactly; 4-bit codes and groups not a
    multiple of 4 stay as they are."""
    rng = np.random.default_rng(3)
    w = _qweight(rng, 64, 12, 16, True)
    codes = np.asarray(w.codes).copy()
    codes[0, 0, 0], codes[0, 1, 0] = -128, 127
    w = quant.QuantArray(jnp.asarray(codes), w.scale, w.offset, (64,), 1, 8, jnp.float32)
    k = quant.k4_codes({"w": w})["w"]
    assert k.k4 and k.codes.dtype == jnp.uint8 and k.codes.shape == w.codes.shape
    raw = np.asarray(k.codes).reshape(4, 4, 12, 4)  # [ng, G / 4, N, 4]
    assert raw[0, 0, 0, 0] == 0 and raw[0, 0, 0, 1] == 255  # -128 + 128, 127 + 128
    assert raw[1, 2, 5, 3] == int(codes[1, 2 * 4 + 3, 5]) + 128
    np.testing.assert_array_equal(np.asarray(quant.plain_codes(k)), codes)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(k)), np.asarray(quant.dequantize(w)))
    stacked = quant._map(lambda a: jnp.stack([a, a]), w)  # a lead (layers) axis, sliced back
    ks = quant.k4_codes({"w": stacked})["w"]
    np.testing.assert_array_equal(np.asarray(ks[1].codes), np.asarray(k.codes))
    r = k.reshape(64, 3, 4)  # an output reshape (wq's [E, H, D] view) keeps the form
    assert r.k4 and r.shape == (64, 3, 4)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(r)),
                                  np.asarray(quant.dequantize(w)).reshape(64, 3, 4))
    with pytest.raises(ValueError, match="concat_out"):
        quant.concat_out([k, k])  # the fused (GPU) layout never takes it
    odd = _qweight(rng, 66, 5, 6, False)
    assert not quant.k4_codes({"w": odd})["w"].k4


@needs_vnni
@pytest.mark.parametrize("rows,k,n,G,offset", [
    (1, 96, 200, 32, False), (1, 896, 4864, 32, True), (2, 64, 17, 16, True),
    (3, 4864, 40, 4864, False), (9, 128, 1000, 32, True), (16, 64, 31, 16, False),
    (4, 1024, 96, 32, True), (40, 96, 70, 32, True), (2, 36, 50, 36, False)])
def test_w8a8_kernel_matches_its_float64_reference(rows, k, n, G, offset, q8_on):
    """The k4 product against float64 with x quantized as documented: groups split over
    threads and columns split, row blocks of 8, register blocks, column tails, x blocks of 32
    or of a shorter group (16, 36)."""
    rng = np.random.default_rng(rows * 11 + n + G)
    w = quant.k4_codes({"w": _qweight(rng, k, n, G, offset)})["w"]
    x = jnp.asarray(rng.standard_normal((rows, k), np.float32))
    assert few_rows.q8_applies(x, w) and not few_rows.quant_applies(x, w)
    y = np.asarray(jax.jit(quant.linear)(x, w))
    ref = _q8_reference(x, w)
    assert y.shape == (rows, n) and np.all(np.isfinite(y))
    assert np.abs(y - ref).max() <= 2e-5 * np.sqrt(k) * np.abs(ref).max() + 1e-5
    # and close to the weight's own float product (int8 activations: ~1% of the scale)
    full = np.asarray(x, np.float64) @ np.asarray(quant.dequantize(w), np.float64)
    assert np.abs(y - full).max() <= 0.05 * np.abs(full).max()


@needs_vnni
def test_w8a8_routes(q8_on):
    """1-64 rows of a k4 weight: its custom call; 65 rows: dequantized (plain codes read back
    from the k4 layout), then XLA's float product, equal to the plain int8 weight's."""
    rng = np.random.default_rng(2)
    w = _qweight(rng, 64, 48, 32, False)
    k = quant.k4_codes({"w": w})["w"]
    top = few_rows.QUANT_MAX_ROWS
    for rows, want in ((1, True), (top, True), (top + 1, False)):
        text = jax.jit(quant.linear).lower(jnp.zeros((rows, 64), jnp.float32), k).as_text()
        assert (few_rows.Q8_TARGET in text) is want, rows
        assert few_rows.QUANT_TARGET not in text
    x = jnp.asarray(rng.standard_normal((top + 1, 64), np.float32))
    np.testing.assert_allclose(np.asarray(quant.linear(x, k)), np.asarray(quant.linear(x, w)),
                               rtol=1e-5, atol=1e-5)


def test_w8a8_in_one_program_per_leaf_gives_the_three_passes_codes(monkeypatch, tiny_pair):
    """quantize_loaded's w8a8 (`_draft_form_leaf`, one program per leaf) holds exactly the codes
    and scales of quantize, then int8 codes, then the k4 form, leaf by leaf."""
    monkeypatch.setattr(few_rows, "enabled", lambda: True)
    monkeypatch.setattr(few_rows, "q8_enabled", lambda: True)
    draft = tiny_pair[1]
    fused = quant.quantize_loaded(draft.params, draft.config, "w8a8")
    passes = quant.k4_codes(quant.int8_codes(quant.quantize_params(draft.params, draft.config,
                                                                   "w8a8")))
    a = jax.tree.leaves(fused, is_leaf=quant.is_quantized)
    b = jax.tree.leaves(passes, is_leaf=quant.is_quantized)
    assert len(a) == len(b) and sum(quant.is_quantized(x) for x in a) >= 4
    for x, y in zip(a, b):
        assert quant.is_quantized(x) == quant.is_quantized(y)
        if quant.is_quantized(x):
            assert x.k4 and y.k4 and x.codes.dtype == y.codes.dtype == jnp.uint8
            assert (x.in_shape, x.out_ndim, x.bits, x.dtype) == (y.in_shape, y.out_ndim, y.bits,
                                                                 y.dtype)
            np.testing.assert_array_equal(np.asarray(x.codes), np.asarray(y.codes))
            np.testing.assert_array_equal(np.asarray(x.scale), np.asarray(y.scale))
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_w8a8_quantizes_to_k4_where_it_runs(monkeypatch, tiny_pair):
    """quantize="w8a8" (load_model's and quantize_model's): int8 codes, in the k4 form where
    q8 runs, plain int8 where it does not; `bits_of` takes it."""
    monkeypatch.setattr(few_rows, "enabled", lambda: True)
    for on in (True, False):
        monkeypatch.setattr(few_rows, "q8_enabled", lambda on=on: on)
        m = quant.quantize_model(tiny_pair[1], "w8a8")
        ws = [x for x in jax.tree.leaves(m.params, is_leaf=quant.is_quantized)
              if quant.is_quantized(x)]
        assert ws and all(x.k4 is on for x in ws)
        assert all(x.codes.dtype == (jnp.uint8 if on else jnp.int8) for x in ws)
    assert quant.bits_of("w8a8") == 8
    from jax.sharding import Mesh

    from ouroboros_jax.sharding import param_specs_of

    monkeypatch.setattr(few_rows, "q8_enabled", lambda: True)
    k4 = quant.quantize_model(tiny_pair[1], "w8a8")
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    with pytest.raises(ValueError, match="one CPU device only"):
        param_specs_of(k4.params, k4.config, mesh)  # never split: its memory is interleaved


# ------------------------------------------------------------------ one layer of a stack, in place
def _stack_of(leaves):
    """Per-layer weights (arrays or QuantArrays) stacked on a lead layer axis."""
    return jax.tree.map(lambda *a: jnp.stack(a), *leaves)


@needs_kernel
@pytest.mark.parametrize("form", ["float32", "int8", "w8a8"])
def test_a_layer_read_in_place_is_that_layers_product_bit_for_bit(form, kernel_on, monkeypatch):
    """`LayerOf` (the stack and a traced layer index) through `linear` gives, for every layer,
    the same bits as the layer's own weight through the same kernel; the program passes the
    whole stack (no slice of it) to the `_at` custom call."""
    rng = np.random.default_rng({"float32": 1, "int8": 2, "w8a8": 3}[form])
    k, n, L, rows = 128, 96, 3, (9 if form == "float32" else 5)
    if form == "float32":
        layers = [jnp.asarray(rng.standard_normal((k, n), np.float32)) for _ in range(L)]
        target = few_rows.AT_TARGET
    else:
        layers = [_qweight(rng, k, n, 32, form == "int8") for _ in range(L)]
        target = few_rows.QUANT_AT_TARGET
        if form == "w8a8":
            if not few_rows.cpu_has_avx512(flag="avx512_vnni"):
                pytest.skip("the w8a8 product needs AVX512-VNNI")
            monkeypatch.setattr(few_rows, "q8_enabled", lambda: True)
            layers = [quant.k4_codes({"w": w})["w"] for w in layers]
            target = few_rows.Q8_AT_TARGET
    stack = _stack_of(layers)
    x = jnp.asarray(rng.standard_normal((1, rows, k), np.float32))
    assert few_rows.at_applies(stack, rows, x.dtype)
    at = jax.jit(lambda x, s, i: quant.linear(x, few_rows.LayerOf(s, i)))
    own = jax.jit(quant.linear)
    for i in range(L):
        y = np.asarray(at(x, stack, jnp.int32(i)))
        assert y.shape == (1, rows, n)
        assert np.array_equal(y, np.asarray(own(x, layers[i])))
    text = at.lower(x, stack, jnp.int32(0)).as_text()
    assert target in text and "dynamic_slice" not in text
    # a reshaped view (wo's [H, D, E] read as [H*D, E]) keeps the product and the output shape
    y = jax.jit(lambda x, s, i: quant.linear(x, few_rows.LayerOf(s, i).reshape(k, 4, -1)))(
        x, stack, jnp.int32(2))
    assert y.shape == (1, rows, 4, n // 4)
    assert np.array_equal(np.asarray(y).reshape(1, rows, n), np.asarray(own(x, layers[2])))


@needs_kernel
def test_a_layer_out_of_the_stack_is_refused(kernel_on):
    stack = jnp.ones((2, 16, 32), jnp.float32)
    x = jnp.ones((3, 16), jnp.float32)
    f = jax.jit(lambda x, s, i: quant.linear(x, few_rows.LayerOf(s, i)))
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(f(x, stack, jnp.int32(2)))


@needs_kernel
def test_where_a_layer_in_place_applies(kernel_on, monkeypatch):
    """float32: 2-16 rows (one row stays XLA's matrix-vector product); int8: 1-64; w8a8: 1-64
    where q8 runs; nothing when the kernel is off or x is not float32."""
    rng = np.random.default_rng(4)
    f32 = jnp.zeros((2, 16, 32), jnp.float32)
    assert [few_rows.at_applies(f32, r, jnp.float32) for r in (1, 2, 16, 17)] == [
        False, True, True, False]
    assert not few_rows.at_applies(f32, 4, jnp.bfloat16)
    i8 = _stack_of([_qweight(rng, 64, 48, 32, False)] * 2)
    assert [few_rows.at_applies(i8, r, jnp.float32) for r in (1, 64, 65)] == [True, True, False]
    monkeypatch.setattr(few_rows, "q8_enabled", lambda: False)
    k4 = quant.k4_codes({"w": i8})["w"]
    assert k4.k4 and not few_rows.at_applies(k4, 4, jnp.float32)
    monkeypatch.setattr(few_rows, "enabled", lambda: False)
    assert not few_rows.at_applies(f32, 4, jnp.float32)
