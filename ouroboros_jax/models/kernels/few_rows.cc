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
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <unistd.h>
#include <utility>
#include <cstdint>
#include <cmath>
#include <cstring>
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

// The same for a weight kept as integer codes (models/quant.py's QuantArray, int8 codes):
// w[g * G + j, n] = codes[g, j, n] * scale[g, n] - offset[g, n], K = ng * G. Each row keeps, per
// 16 columns, the group's partial sum p = sum_j x[m, gG + j] * codes[g, j, n] (the codes turned
// into float32 in registers), then y += p * scale - (sum_j x[m, gG + j]) * offset. The weights
// are read as one byte each instead of four, which is what a memory-bound forward pays for.
// Rows are independent as above (one fixed chain per output). Partial sums wait in `part`
// between kDepth blocks of a group, so a long group (one per channel: G = K) streams the same
// way as a short one.
constexpr int64_t kQuantDepth = 16;  // code rows per pass (16 measured fastest of 16/32/64)
// Columns are taken kChunk at a time, every row block and group of a chunk before the next:
// the partial sums of a chunk (8 rows x kChunk floats) stay in the core's L2 between passes
// (over a whole 151936-column LM head they took 1.2 MB a thread at 4 rows and went to memory
// and back every pass), and a chunk's codes are still in the caches for the next row block
// (more than 8 rows: a prefill's blocks each streamed the whole weight from memory).
constexpr int64_t kChunk = 512;

// 16 codes (fewer at a tail: `left`, zeros past it) as float32 lanes
inline __m512 codes_ps(const int8_t* row, int64_t left) {
  __m128i c8;
  if (left >= kVec) {
    c8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  } else {
    alignas(16) int8_t tail[kVec] = {};
    if (left > 0) std::memcpy(tail, row, (size_t)left);
    c8 = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c8));
}

inline __mmask16 lanes(int64_t left) {
  return left >= kVec ? (__mmask16)0xFFFF
                      : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

// A column block's partial sums between passes over a group: its lane masks, and acc zeroed at
// the group's first pass or read back from part (rows x width floats) -> the block's place there
template <int M, int NB>
inline float* open_partial(__m512 (&acc)[M][NB], __mmask16 (&mask)[NB], float* part,
                           int64_t width, int64_t n, int64_t c0, int64_t c1, bool first) {
  for (int b = 0; b < NB; ++b) mask[b] = lanes(c1 - n - b * kVec);
  float* pn = part + (n - c0);
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b)
      acc[m][b] = first ? _mm512_setzero_ps()
                        : _mm512_maskz_loadu_ps(mask[b], pn + m * width + b * kVec);
  return pn;
}

template <int M, int NB>
inline void store_partial(const __m512 (&acc)[M][NB], const __mmask16 (&mask)[NB], float* pn,
                          int64_t width) {
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < NB; ++b)
      _mm512_mask_storeu_ps(pn + m * width + b * kVec, mask[b], acc[m][b]);
}

// A group's partial sums acc (rows x NB blocks of 16 columns from n) into y: y += acc * scale
// (- the rows' input sums * offset); the group g0 a thread starts at writes y afresh
template <int M, int NB, bool kOffset>
inline void finish_group(const __m512 (&acc)[M][NB], const __mmask16 (&mask)[NB],
                         const float* scale, const float* offset, const float* xsum, float* y,
                         int64_t N, int64_t ng, int64_t n, int64_t g, int64_t g0) {
  for (int b = 0; b < NB; ++b) {
    const int64_t nb = n + b * kVec;
    const __m512 s = _mm512_maskz_loadu_ps(mask[b], scale + g * N + nb);
    __m512 o = _mm512_setzero_ps();
    if (kOffset) o = _mm512_maskz_loadu_ps(mask[b], offset + g * N + nb);
    for (int m = 0; m < M; ++m) {
      __m512 out = g == g0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask[b], y + m * N + nb);
      out = _mm512_fmadd_ps(acc[m][b], s, out);
      if (kOffset) out = _mm512_fnmadd_ps(_mm512_set1_ps(xsum[m * ng + g]), o, out);
      _mm512_mask_storeu_ps(y + m * N + nb, mask[b], out);
    }
  }
}

// NB register blocks of 16 columns per step: independent chains, so that one or two rows do
// not wait on one fused multiply-add's latency for every code row (at NB = 1 a one-row
// product ran at ~7 GB/s of codes, latency-bound)
template <int M, int NB, bool kOffset>
void quant_columns(const float* x, const float* xsum, int64_t K, int64_t G, const int8_t* codes,
                   const float* scale, const float* offset, int64_t N, float* y, float* part,
                   int64_t c0, int64_t c1, int64_t g0, int64_t g1) {
  const int64_t ng = K / G, width = c1 - c0;
  (void)ng;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t j0 = 0; j0 < G; j0 += kQuantDepth) {
      const int64_t j1 = std::min(G, j0 + kQuantDepth);
      for (int64_t n = c0; n < c1; n += kVec * NB) {
        __mmask16 mask[NB];
        __m512 acc[M][NB];
        float* pn = open_partial<M, NB>(acc, mask, part, width, n, c0, c1, j0 == 0);
        for (int64_t j = j0; j < j1; ++j) {
          const int8_t* row = codes + (g * G + j) * N + n;
          __m512 wv[NB];
          for (int b = 0; b < NB; ++b) wv[b] = codes_ps(row + b * kVec, c1 - n - b * kVec);
          const float* xk = x + g * G + j;
          for (int m = 0; m < M; ++m) {
            const __m512 xv = _mm512_set1_ps(xk[m * K]);
            for (int b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(xv, wv[b], acc[m][b]);
          }
        }
        if (j1 < G) {  // the group goes on in the next pass
          store_partial<M, NB>(acc, mask, pn, width);
          continue;
        }
        finish_group<M, NB, kOffset>(acc, mask, scale, offset, xsum, y, N, ng, n, g, g0);
      }
    }
  }
}

using QuantFn = void (*)(const float*, const float*, int64_t, int64_t, const int8_t*,
                         const float*, const float*, int64_t, float*, float*, int64_t, int64_t,
                         int64_t, int64_t);
// rows 1-2: four register blocks, 3-4: two, 5-8: one (acc M * NB + NB codes <= 32 registers)
template <bool kOffset, int... Ms>
constexpr std::array<QuantFn, sizeof...(Ms)> quant_table(std::integer_sequence<int, Ms...>) {
  return {&quant_columns<Ms + 1, (Ms + 1 <= 2 ? 4 : Ms + 1 <= 4 ? 2 : 1), kOffset>...};
}
constexpr int64_t kMaxQuantRows = 8;  // 2 * 8 + 2 registers live: acc, the codes, x, scale
constexpr auto kQuant = quant_table<false>(std::make_integer_sequence<int, kMaxQuantRows>{});
constexpr auto kQuantOffset =
    quant_table<true>(std::make_integer_sequence<int, kMaxQuantRows>{});

// The draft's form (models/quant.py, `k4` codes): the activations quantized too, so that the
// products are integer dot products of four byte pairs (AVX512-VNNI `vpdpbusd`, 64 per
// instruction) instead of a conversion and a fused multiply-add per weight. A draft only
// proposes, so its rounding moves acceptance, never an output; the target never takes this
// form. Codes are kept as bytes biased by 128 (u8 = code + 128: vpdpbusd multiplies unsigned
// by signed bytes), every four consecutive inputs of a column side by side:
// codes[k / 4][n][k % 4] (the memory of [K / 4, N, 4]). x is quantized per row and block of
// XB inputs (XB = 32, or the group length where it is shorter): xq = round(x / sx),
// sx = max|x| / 127. Per block, the integer sum S = sum (c + 128) xq = sum c xq + 128 sum xq;
// y += (S - 128 sum xq) * sx * scale per group, less (sum x) * offset as above. A row's result
// depends on that row only (its own x blocks, one fixed order of sums).
constexpr int64_t kQ8Block = 32;  // inputs per activation scale (llama.cpp's Q8_0 block)
constexpr int64_t kQ8Blocks = 2;  // activation blocks per pass over a column block

template <int M, int NB, bool kOffset>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void q8_columns(const int32_t* xq4, const float* sx, const int32_t* corr, const float* xsum,
                int64_t K, int64_t G, int64_t XB, const uint8_t* codes, const float* scale,
                const float* offset, int64_t N, float* y, float* part, int64_t c0, int64_t c1,
                int64_t g0, int64_t g1) {
  const int64_t ng = K / G, width = c1 - c0, nxb = K / XB, quads = XB / 4;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t b0 = 0; b0 < G / XB; b0 += kQ8Blocks) {
      const int64_t b1 = std::min(G / XB, b0 + kQ8Blocks);
      for (int64_t n = c0; n < c1; n += kVec * NB) {
        __mmask16 mask[NB];
        __m512 acc[M][NB];
        float* pn = open_partial<M, NB>(acc, mask, part, width, n, c0, c1, b0 == 0);
        for (int64_t xb = b0; xb < b1; ++xb) {
          const int64_t blk = (g * G) / XB + xb;  // the activation block's index along K
          __m512i iacc[M][NB];
          for (int m = 0; m < M; ++m)
            for (int b = 0; b < NB; ++b) iacc[m][b] = _mm512_setzero_si512();
          for (int64_t q = 0; q < quads; ++q) {
            const int64_t kq = blk * quads + q;  // the quad's index along K / 4
            const uint8_t* row = codes + (kq * N + n) * 4;
            __m512i wv[NB];
            for (int b = 0; b < NB; ++b)
              wv[b] = _mm512_maskz_loadu_epi32(mask[b], row + b * kVec * 4);
            for (int m = 0; m < M; ++m) {
              const __m512i xv = _mm512_set1_epi32(xq4[m * (K / 4) + kq]);
              for (int b = 0; b < NB; ++b)
                iacc[m][b] = _mm512_dpbusd_epi32(iacc[m][b], wv[b], xv);
            }
          }
          for (int m = 0; m < M; ++m) {
            const __m512i c = _mm512_set1_epi32(corr[m * nxb + blk]);
            const __m512 s = _mm512_set1_ps(sx[m * nxb + blk]);
            for (int b = 0; b < NB; ++b)
              acc[m][b] = _mm512_fmadd_ps(
                  _mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[m][b], c)), s, acc[m][b]);
          }
        }
        if (b1 < G / XB) {  // the group goes on in the next pass
          store_partial<M, NB>(acc, mask, pn, width);
          continue;
        }
        finish_group<M, NB, kOffset>(acc, mask, scale, offset, xsum, y, N, ng, n, g, g0);
      }
    }
  }
}

using Q8Fn = void (*)(const int32_t*, const float*, const int32_t*, const float*, int64_t,
                      int64_t, int64_t, const uint8_t*, const float*, const float*, int64_t,
                      float*, float*, int64_t, int64_t, int64_t, int64_t);
template <bool kOffset, int... Ms>
constexpr std::array<Q8Fn, sizeof...(Ms)> q8_table(std::integer_sequence<int, Ms...>) {
  return {&q8_columns<Ms + 1, (Ms + 1 <= 2 ? 4 : Ms + 1 <= 4 ? 2 : 1), kOffset>...};
}
constexpr auto kQ8 = q8_table<false>(std::make_integer_sequence<int, kMaxQuantRows>{});
constexpr auto kQ8Offset = q8_table<true>(std::make_integer_sequence<int, kMaxQuantRows>{});

using ColumnsFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t);
template <int... Ms>
constexpr std::array<ColumnsFn, sizeof...(Ms)> table(std::integer_sequence<int, Ms...>) {
  return {&columns<Ms + 1>...};
}
constexpr auto kColumns = table(std::make_integer_sequence<int, kMaxRows>{});


// Helper threads kept for the life of the process: a product is ~0.1-1 ms, and starting a
// thread per call (and joining it) cost more than the second core gave back on the small
// matrices of a 0.5B model (one thread ran them 1.3x faster than two new ones each call).
// A helper spins briefly for the next job (products come back to back within a forward), then
// sleeps on a condition variable, so an idle process does not hold a core.
class Helpers {
 public:
  static Helpers& get() {
    static Helpers* h = new Helpers();  // never destroyed: helpers may outlive static teardown
    return *h;
  }

  // fn(0) on the caller and fn(1) .. fn(t - 1) on helpers; returns when all are done. One
  // job at a time (XLA may call from several threads: they queue on the mutex).
  void run(int t, const std::function<void(int)>& fn) {
    if (t <= 1) {
      fn(0);
      return;
    }
    std::lock_guard<std::mutex> one(job_mu_);
    ensure(t - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = &fn;
      want_ = t - 1;
      remaining_.store(t - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    fn(0);
    while (remaining_.load(std::memory_order_acquire) > 0) _mm_pause();
  }

 private:
  void ensure(int n) {
    if (pid_ != getpid()) {  // a forked child inherits the list but not the threads
      threads_.clear();
      pid_ = getpid();
    }
    while ((int)threads_.size() < n) {
      const int id = (int)threads_.size() + 1;
      // the generation before this job's: read here, not in the thread, which may start
      // after the job is posted and would then wait for the next one
      const uint64_t seen = generation_.load(std::memory_order_acquire);
      threads_.emplace_back([this, id, seen] { loop(id, seen); });
      threads_.back().detach();
    }
  }

  void loop(int id, uint64_t seen) {
    for (;;) {
      uint64_t now = seen;
      for (int spin = 0; spin < kSpins; ++spin) {
        now = generation_.load(std::memory_order_acquire);
        if (now != seen) break;
        _mm_pause();
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      const std::function<void(int)>* job;
      int want;
      {
        std::lock_guard<std::mutex> lock(mu_);
        job = job_;
        want = want_;
      }
      if (id <= want) {
        (*job)(id);
        remaining_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  static constexpr int kSpins = 20000;  // ~0.1-0.3 ms of pause instructions
  std::mutex job_mu_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> remaining_{0};
  const std::function<void(int)>* job_ = nullptr;
  int want_ = 0;
  pid_t pid_ = getpid();
  std::vector<std::thread> threads_;
};

}  // namespace

extern "C" void few_rows_matmul(const float* x, const float* w, float* y, int64_t M, int64_t K,
                                int64_t N, int threads) {
  ColumnsFn fn = kColumns[M - 1];
  int64_t vecs = (N + kVec - 1) / kVec;
  int t = (int)std::max<int64_t>(1, std::min<int64_t>(threads, vecs));
  int64_t per = (vecs + t - 1) / t * kVec;
  Helpers::get().run(t, [&](int i) {
    int64_t c0 = std::min(N, i * per), c1 = std::min(N, (i + 1) * per);
    if (c0 < c1) fn(x, K, w, N, y, c0, c1);
  });
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

// The quantized forms' product over threads. block(r0, rows, out, part, c0, c1, g0, g1)
// computes rows [r0, r0 + rows) (at most kMaxQuantRows) for columns [c0, c1) and groups
// [g0, g1); the columns are taken kChunk at a time, every row block before the next chunk.
// Threads split the groups when there are enough (each reads whole rows of codes, one
// contiguous stretch of memory; a narrow weight split by columns read runs of a few hundred
// bytes at a stride and ran at half the speed), each into its own partial y, summed in thread
// order; else the columns. Either way the split depends on the weight and the thread count
// only, never on M: rows stay independent.
template <typename Block>
void quant_product(float* y, int64_t M, int64_t N, int64_t ng, int threads,
                   const Block& block) {
  const int t = (int)std::max<int64_t>(1, std::min<int64_t>(threads, ng / 2));
  auto run = [&](float* out, int64_t c0, int64_t c1, int64_t g0, int64_t g1) {
    std::vector<float> part(kMaxQuantRows * std::min(c1 - c0, kChunk));
    for (int64_t a = c0; a < c1; a += kChunk) {  // see kChunk
      const int64_t b = std::min(c1, a + kChunk);
      for (int64_t r0 = 0; r0 < M; r0 += kMaxQuantRows)  // more rows: blocks of 8, in turn
        block(r0, std::min<int64_t>(kMaxQuantRows, M - r0), out, part.data(), a, b, g0, g1);
    }
  };
  if (t > 1) {
    std::vector<std::vector<float>> partial(t - 1);
    const int64_t per = (ng + t - 1) / t;
    Helpers::get().run(t, [&](int i) {
      const int64_t g0 = std::min(ng, i * per), g1 = std::min(ng, (i + 1) * per);
      float* out = y;
      if (i > 0) {
        partial[i - 1].assign(M * N, 0.f);
        out = partial[i - 1].data();
      }
      if (g0 < g1) run(out, 0, N, g0, g1);
    });
    for (int i = 1; i < t; ++i)
      for (int64_t e = 0; e < M * N; ++e) y[e] += partial[i - 1][e];
    return;
  }
  const int64_t vecs = (N + kVec - 1) / kVec;
  const int tc = (int)std::max<int64_t>(1, std::min<int64_t>(threads, vecs));
  const int64_t per = (vecs + tc - 1) / tc * kVec;
  Helpers::get().run(tc, [&](int i) {
    int64_t c0 = std::min(N, i * per), c1 = std::min(N, (i + 1) * per);
    if (c0 < c1) run(y, c0, c1, 0, ng);
  });
}

// rows [r0, r0 + rows) of x against the codes, columns split over threads; part: scratch
extern "C" void few_rows_quant_matmul(const float* x, const int8_t* codes, const float* scale,
                                      const float* offset, float* y, int64_t M, int64_t K,
                                      int64_t G, int64_t N, int threads) {
  const int64_t ng = K / G;
  std::vector<float> xsum(offset ? M * ng : 0);
  for (int64_t m = 0; m < (offset ? M : 0); ++m)
    for (int64_t g = 0; g < ng; ++g) {
      float s = 0.f;  // summed in order, as the product's own chain is
      for (int64_t j = 0; j < G; ++j) s += x[m * K + g * G + j];
      xsum[m * ng + g] = s;
    }
  quant_product(y, M, N, ng, threads,
                [&](int64_t r0, int64_t rows, float* out, float* part, int64_t a, int64_t b,
                    int64_t g0, int64_t g1) {
                  QuantFn fn = (offset ? kQuantOffset : kQuant)[rows - 1];
                  fn(x + r0 * K, offset ? xsum.data() + r0 * ng : nullptr, K, G, codes, scale,
                     offset, N, out + r0 * N, part, a, b, g0, g1);
                });
}

// x's rows quantized per block of XB inputs (see q8_columns), then the product; threads split
// as few_rows_quant_matmul's
extern "C" void few_rows_q8_matmul(const float* x, const uint8_t* codes, const float* scale,
                                   const float* offset, float* y, int64_t M, int64_t K,
                                   int64_t G, int64_t N, int threads) {
  const int64_t ng = K / G, XB = G % kQ8Block == 0 ? kQ8Block : G, nxb = K / XB;
  std::vector<int32_t> xq4(M * (K / 4)), corr(M * nxb);
  std::vector<float> sx(M * nxb), xsum(offset ? M * ng : 0);
  for (int64_t m = 0; m < M; ++m) {
    int8_t* q = reinterpret_cast<int8_t*>(xq4.data() + m * (K / 4));
    for (int64_t blk = 0; blk < nxb; ++blk) {
      const float* xb = x + m * K + blk * XB;
      float amax = 0.f;
      for (int64_t j = 0; j < XB; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t total = 0;
      for (int64_t j = 0; j < XB; ++j) {
        const int v = (int)std::nearbyint(xb[j] * inv);
        q[blk * XB + j] = (int8_t)std::max(-127, std::min(127, v));
        total += q[blk * XB + j];
      }
      sx[m * nxb + blk] = s;
      corr[m * nxb + blk] = 128 * total;
    }
    for (int64_t g = 0; g < (offset ? ng : 0); ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < G; ++j) s += x[m * K + g * G + j];
      xsum[m * ng + g] = s;
    }
  }
  quant_product(y, M, N, ng, threads,
                [&](int64_t r0, int64_t rows, float* out, float* part, int64_t a, int64_t b,
                    int64_t g0, int64_t g1) {
                  Q8Fn fn = (offset ? kQ8Offset : kQ8)[rows - 1];
                  fn(xq4.data() + r0 * (K / 4), sx.data() + r0 * nxb, corr.data() + r0 * nxb,
                     offset ? xsum.data() + r0 * ng : nullptr, K, G, XB, codes, scale, offset,
                     N, out + r0 * N, part, a, b, g0, g1);
                });
}

// The quantized forms' FFI binding: x [..., K], codes [ng, G, N] of type T (the w8a8 form:
// G a multiple of 4), scale and offset [ng, N] (offset read only with has_offset)
template <ffi::DataType T, typename C,
          void (*Product)(const float*, const C*, const float*, const float*, float*, int64_t,
                          int64_t, int64_t, int64_t, int)>
ffi::Error QuantImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<T> codes, ffi::Buffer<ffi::F32> scale,
                     ffi::Buffer<ffi::F32> offset, ffi::ResultBuffer<ffi::F32> y,
                     int64_t threads, bool has_offset) {
  constexpr bool quads = T == ffi::DataType::U8;
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (cd.size() != 3 || sd.size() != 2 || xd.size() < 1 || sd[0] != cd[0] || sd[1] != cd[2] ||
      xd.back() != cd[0] * cd[1] || (quads && cd[1] % 4 != 0))
    return ffi::Error::InvalidArgument(
        "few-row quantized product: x [..., K], codes [ng, G, N] (G % 4 == 0 for w8a8), "
        "scale [ng, N] with K = ng * G");
  int64_t M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  const int64_t G = cd[1], N = cd[2], K = cd[0] * cd[1];
  if (M < 1 || G < 1 || N < 1)
    return ffi::Error::InvalidArgument("few-row quantized product: empty operand");
  Product(x.typed_data(), codes.typed_data(), scale.typed_data(),
          has_offset ? offset.typed_data() : nullptr, y->typed_data(), M, K, G, N, (int)threads);
  return ffi::Error::Success();
}

template <ffi::DataType T>
auto quant_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int64_t>("threads")
      .template Attr<bool>("has_offset");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsQ8Matmul,
                              (QuantImpl<ffi::DataType::U8, uint8_t, few_rows_q8_matmul>),
                              quant_binding<ffi::DataType::U8>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsQuantMatmul,
                              (QuantImpl<ffi::DataType::S8, int8_t, few_rows_quant_matmul>),
                              quant_binding<ffi::DataType::S8>());



// ---------------------------------------------------------------- one layer of a stacked weight
// The same products with the weight given as its whole stack over layers (w [L, K, N]; codes
// [L, ng, G, N], scale and offset [L, ng, N]) and the layer as an int32 scalar operand: the
// kernel reads layer l's slice where it lies. A forward that scans its layers (llama.forward)
// then passes the stack to every step instead of slicing a copy of each layer's weights out of
// it, so its program holds one layer's code however deep the model is.

// the layer an int32 scalar operand names, checked against the stack's depth (-1: out of range)
static int64_t layer_of(ffi::Buffer<ffi::S32> layer, int64_t depth) {
  if (layer.element_count() != 1) return -1;
  const int64_t l = layer.typed_data()[0];
  return l >= 0 && l < depth ? l : -1;
}

static ffi::Error FewRowsAtImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                                ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                                int64_t threads) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (wd.size() != 3 || xd.size() < 1 || xd.back() != wd[1])
    return ffi::Error::InvalidArgument("few_rows_matmul_at: x [..., K] and w [L, K, N] expected");
  const int64_t l = layer_of(layer, wd[0]);
  if (l < 0) return ffi::Error::InvalidArgument("few_rows_matmul_at: layer out of range");
  int64_t K = wd[1], N = wd[2], M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  if (M < 1 || M > kMaxRows || K < 1 || N < 1)
    return ffi::Error::InvalidArgument("few_rows_matmul_at: 1 to 16 rows, K >= 1, N >= 1");
  few_rows_matmul(x.typed_data(), w.typed_data() + l * K * N, y->typed_data(), M, K, N,
                  (int)threads);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsMatmulAt, FewRowsAtImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("threads"));

template <ffi::DataType T, typename C,
          void (*Product)(const float*, const C*, const float*, const float*, float*, int64_t,
                          int64_t, int64_t, int64_t, int)>
ffi::Error QuantAtImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<T> codes,
                       ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> offset,
                       ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                       int64_t threads, bool has_offset) {
  constexpr bool quads = T == ffi::DataType::U8;
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions();
  if (cd.size() != 4 || sd.size() != 3 || xd.size() < 1 || sd[0] != cd[0] || sd[1] != cd[1] ||
      sd[2] != cd[3] || xd.back() != cd[1] * cd[2] || (quads && cd[2] % 4 != 0))
    return ffi::Error::InvalidArgument(
        "few-row quantized product at a layer: x [..., K], codes [L, ng, G, N] (G % 4 == 0 "
        "for w8a8), scale [L, ng, N] with K = ng * G");
  const int64_t l = layer_of(layer, cd[0]);
  if (l < 0) return ffi::Error::InvalidArgument("few-row quantized product: layer out of range");
  int64_t M = 1;
  for (size_t i = 0; i + 1 < xd.size(); ++i) M *= xd[i];
  const int64_t ng = cd[1], G = cd[2], N = cd[3], K = ng * G;
  if (M < 1 || G < 1 || N < 1)
    return ffi::Error::InvalidArgument("few-row quantized product: empty operand");
  Product(x.typed_data(), codes.typed_data() + l * K * N, scale.typed_data() + l * ng * N,
          has_offset ? offset.typed_data() + l * ng * N : nullptr, y->typed_data(), M, K, G, N,
          (int)threads);
  return ffi::Error::Success();
}

template <ffi::DataType T>
auto quant_at_binding() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<T>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int64_t>("threads")
      .template Attr<bool>("has_offset");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsQ8MatmulAt,
                              (QuantAtImpl<ffi::DataType::U8, uint8_t, few_rows_q8_matmul>),
                              quant_at_binding<ffi::DataType::U8>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FewRowsQuantMatmulAt,
                              (QuantAtImpl<ffi::DataType::S8, int8_t, few_rows_quant_matmul>),
                              quant_at_binding<ffi::DataType::S8>());
