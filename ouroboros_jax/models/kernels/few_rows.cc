// y[M, N] = x[M, K] @ w[K, N] in float32 for a few rows (M <= 16) on x86-64 with AVX-512: the
// products of a verification forward (M = the tree's nodes; models/few_rows.py says which).
//
// Why: XLA:CPU runs M = 1 as a streaming matrix-vector product at memory speed, but hands M > 1
// to a general matrix product that packs the weights first; at M = 9 that cost 2.2-2.5x the
// M = 1 product (llama.cpp's few-row kernels ~1.4x), and speculative decoding on a CPU lives on
// those few rows. Here the weights are streamed once, kDepth rows at a time in memory order,
// and each row of y keeps one register per 16 columns across those kDepth rows.
//
// Every output y[m, n] is the same chain of fused multiply-adds over k = 0, 1, ..., K-1 whatever
// M is, so a row's result does not depend on the rows beside it.
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <cstdint>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kVec = 16;    // floats per AVX-512 register
constexpr int64_t kDepth = 16;  // weight rows per step (16 measured fastest of 8, 16, 32)
constexpr int64_t kMaxRows = 16;

// rows [0, M) of y, columns [c0, c1): w read kDepth rows at a time, each row in memory order
// (prefetch-friendly), each output register taking kDepth products before it returns to cache
template <int M>
void columns(const float* x, int64_t K, const float* w, int64_t N, float* y, int64_t c0,
             int64_t c1) {
  for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
    int64_t k1 = std::min(K, k0 + kDepth);
    for (int64_t n = c0; n < c1; n += kVec) {
      int64_t left = std::min<int64_t>(kVec, c1 - n);
      __mmask16 mask = left == kVec ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
      __m512 acc[M];
      for (int m = 0; m < M; ++m)
        acc[m] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + m * N + n);
      for (int64_t k = k0; k < k1; ++k) {
        __m512 wv = _mm512_maskz_loadu_ps(mask, w + k * N + n);
        for (int m = 0; m < M; ++m)
          acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wv, acc[m]);
      }
      for (int m = 0; m < M; ++m) _mm512_mask_storeu_ps(y + m * N + n, mask, acc[m]);
    }
  }
}

using ColumnsFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
template <int... Ms>
constexpr std::array<ColumnsFn, sizeof...(Ms)> table(std::integer_sequence<int, Ms...>) {
  return {&columns<Ms + 1>...};
}
constexpr auto kColumns = table(std::make_integer_sequence<int, kMaxRows>{});

}  // namespace

extern "C" void few_rows_matmul(const float* x, const float* w, float* y, int64_t M, int64_t K,
                                int64_t N, int threads) {
  ColumnsFn fn = kColumns[M - 1];
  int64_t vecs = (N + kVec - 1) / kVec;
  int t = (int)std::max<int64_t>(1, std::min<int64_t>(threads, vecs));
  int64_t per = (vecs + t - 1) / t * kVec;
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i) {
    int64_t c0 = std::min(N, i * per), c1 = std::min(N, (i + 1) * per);
    if (c0 < c1) pool.emplace_back(fn, x, K, w, N, y, c0, c1);
  }
  fn(x, K, w, N, y, 0, std::min(N, per));
  for (auto& th : pool) th.join();
}

static ffi::Error FewRowsImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                              ffi::ResultBuffer<ffi::F32> y, int64_t threads) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (wd.size() != 2 || xd.size() < 1 || xd.back() != wd[0])
    return ffi::Error::InvalidArgument("few_rows_matmul: x [..., K] and w [K, N] expected");
  int64_t K = wd[0], N = wd[1], M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  if (M < 1 || M > kMaxRows || K < 1 || N < 1)
    return ffi::Error::InvalidArgument("few_rows_matmul: 1 to 16 rows, K >= 1, N >= 1");
  few_rows_matmul(x.typed_data(), w.typed_data(), y->typed_data(), M, K, N, (int)threads);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsMatmul, FewRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));
