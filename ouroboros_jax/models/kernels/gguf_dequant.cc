// GGUF blocks -> float32 rows, bit-identical to the `gguf` package's numpy kernels
// (`gguf.quants.<type>.dequantize_blocks`): the same float32 operations in the same order, one
// value at a time (built with -ffp-contract=off, so no product is fused into an add), and
// half-precision scales widened exactly. Plain C ABI, called through ctypes (which releases the
// GIL, so the loader's threads dequantize at once). See ouroboros_jax/models/gguf_dequant.py.
#include <cstdint>
#include <cstring>

namespace {

float half_to_float(uint16_t h) {  // exact: every half is a float
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf, nan (payload kept)
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while ((man & 0x400) == 0);
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// each: one block at b -> its values at y (block_size floats)
void q4_0(const uint8_t* b, float* y) {  // d * (q - 8)
  const float d = half_at(b);
  for (int i = 0; i < 16; ++i) {
    y[i] = d * (float)((int)(b[2 + i] & 0x0F) - 8);
    y[i + 16] = d * (float)((int)(b[2 + i] >> 4) - 8);
  }
}

void q4_1(const uint8_t* b, float* y) {  // (d * q) + m
  const float d = half_at(b), m = half_at(b + 2);
  for (int i = 0; i < 16; ++i) {
    y[i] = d * (float)(b[4 + i] & 0x0F) + m;
    y[i + 16] = d * (float)(b[4 + i] >> 4) + m;
  }
}

void q5_0(const uint8_t* b, float* y) {  // d * (q - 16), q's fifth bit from qh
  const float d = half_at(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  for (int i = 0; i < 16; ++i) {
    const int lo = b[6 + i] & 0x0F, hi = b[6 + i] >> 4;
    y[i] = d * (float)((lo | (int)(((qh >> i) & 1) << 4)) - 16);
    y[i + 16] = d * (float)((hi | (int)(((qh >> (i + 16)) & 1) << 4)) - 16);
  }
}

void q8_0(const uint8_t* b, float* y) {  // x * d
  const float d = half_at(b);
  for (int i = 0; i < 32; ++i) y[i] = (float)(int8_t)b[2 + i] * d;
}

void q4_k(const uint8_t* b, float* y) {  // (d * sc) * q - (dmin * m), 8 sub-blocks of 32
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* s = b + 4;  // 12 bytes of 6-bit scales and mins
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    if (j < 4) {
      sc = s[j] & 0x3F;
      mn = s[j + 4] & 0x3F;
    } else {
      sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
      mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
    const float ds = d * (float)sc, dm = dmin * (float)mn;
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int i = 0; i < 32; ++i) y[32 * j + i] = ds * (float)((q[i] >> shift) & 0x0F) - dm;
  }
}

void q6_k(const uint8_t* b, float* y) {  // (d * scale) * (q - 32), 16 groups of 16
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = (const int8_t*)(b + 192);
  const float d = half_at(b + 208);
  // value v = 128 h + 64 s + 32 t + i: its low nibble is ql[64 h + 32 t + i] >> 4 s, its top two
  // bits qh[32 h + i] >> 2 (2 s + t) (gguf's reshapes), its scale sc[v / 16]
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 2; ++s)
      for (int t = 0; t < 2; ++t) {
        const int v0 = 128 * h + 64 * s + 32 * t;
        const uint8_t* lo = ql + 64 * h + 32 * t;
        const uint8_t* hi = qh + 32 * h;
        const int ls = 4 * s, hs = 2 * (2 * s + t);
        const float d0 = d * (float)sc[v0 / 16], d1 = d * (float)sc[v0 / 16 + 1];
        for (int i = 0; i < 32; ++i) {
          const int q = (int)(((lo[i] >> ls) & 0x0F) | (((hi[i] >> hs) & 0x03) << 4)) - 32;
          y[v0 + i] = (i < 16 ? d0 : d1) * (float)q;
        }
      }
}

struct Kind {
  int block_values, block_bytes;
  void (*fn)(const uint8_t*, float*);
};

// keyed by ggml's type numbers (gguf.GGMLQuantizationType)
bool kind_of(int type, Kind* k) {
  switch (type) {
    case 2: *k = {32, 18, q4_0}; return true;
    case 3: *k = {32, 20, q4_1}; return true;
    case 6: *k = {32, 22, q5_0}; return true;
    case 8: *k = {32, 34, q8_0}; return true;
    case 12: *k = {256, 144, q4_k}; return true;
    case 14: *k = {256, 210, q6_k}; return true;
    default: return false;
  }
}

}  // namespace

extern "C" {

// Whether `type` (a ggml type number) is dequantized here.
int gguf_dequant_supports(int type) {
  Kind k;
  return kind_of(type, &k) ? 1 : 0;
}

// rows x row_values values from `src` (rows of whole blocks, back to back) into `dst`, row r at
// dst + r * dst_stride (floats). Returns 0, or -1 for an unknown type or a row that is not a
// whole number of blocks.
int gguf_dequant_rows(int type, const uint8_t* src, int64_t rows, int64_t row_values, float* dst,
                      int64_t dst_stride) {
  Kind k;
  if (!kind_of(type, &k) || row_values % k.block_values) return -1;
  const int64_t blocks = row_values / k.block_values;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* b = src + r * blocks * k.block_bytes;
    float* y = dst + r * dst_stride;
    for (int64_t i = 0; i < blocks; ++i) k.fn(b + i * k.block_bytes, y + i * k.block_values);
  }
  return 0;
}

// The same rows written transposed: value (r, j) at dst[j * dst_stride + r] (a torch Linear's
// [out, in] rows into our [in, out] leaf). Rows go through a tile of kTile rows, so each column
// of the tile is one run of kTile floats in dst instead of kTile scattered writes.
int gguf_dequant_rows_t(int type, const uint8_t* src, int64_t rows, int64_t row_values,
                        float* dst, int64_t dst_stride) {
  constexpr int64_t kTile = 16;
  Kind k;
  if (!kind_of(type, &k) || row_values % k.block_values) return -1;
  const int64_t row_bytes = row_values / k.block_values * k.block_bytes;
  float* tile = new float[kTile * row_values];
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    const int64_t n = rows - r0 < kTile ? rows - r0 : kTile;
    gguf_dequant_rows(type, src + r0 * row_bytes, n, row_values, tile, row_values);
    for (int64_t j = 0; j < row_values; ++j) {
      float* y = dst + j * dst_stride + r0;
      for (int64_t r = 0; r < n; ++r) y[r] = tile[r * row_values + j];
    }
  }
  delete[] tile;
  return 0;
}

}  // extern "C"
