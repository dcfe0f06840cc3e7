// The compact encodings of Adam's moments on the host (optimizer_state: bf16 | 8bit), as
// host_adam.cpp's compact pass reads and writes them. protrain/optim/state_format.py holds
// the same arithmetic in torch (the tests' reference and the checkpoints' conversions) and
// the reasons for each choice; every operation here is integer arithmetic or one IEEE fp32
// operation, so both give the same bits on any vector width.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace state_codes {

// ---- bf16 with stochastic rounding ----------------------------------------------------------

// Chris Wellons' lowbias32: a bijective 32-bit mix, cheap and well spread.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// The key of one parameter's step: its seed (fixed per parameter) and its step count, so a
// resumed run draws the same bits.
inline uint32_t step_key(uint64_t step, uint32_t seed) {
  return mix32((uint32_t(step) * 0x9E3779B9U) ^ seed);
}

// 32 random bits of element `offset` of the parameter: the low half rounds exp_avg, the high
// half exp_avg_sq.
inline uint32_t element_bits(uint32_t key, uint32_t offset) { return mix32(key ^ offset); }

// x rounded to bf16 up or down in magnitude with probability of its distance (16 random bits
// added below the bf16 mantissa, then truncation): unbiased. Inf stays inf; NaN stays NaN.
inline uint16_t round_stochastic(float x, uint32_t r16) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  if ((b & 0x7f800000U) == 0x7f800000U) {
    return uint16_t(b >> 16) | ((b & 0x007fffffU) ? 0x0040 : 0);
  }
  return uint16_t((b + (r16 & 0xffffU)) >> 16);
}

inline float bf16_to_float(uint16_t h) {
  const uint32_t b = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// ---- 8-bit blockwise ------------------------------------------------------------------------

constexpr int64_t kQBlock = 256;  // elements per absmax

// A floating-point code of `ebits` exponent bits and 3 mantissa bits for r = |x| / absmax in
// [0, 1]: index i = E * 8 + M is 2^(E - top) * (1 + M/8) for E >= 1 and 2^(1 - top) * M/8 for
// E = 0 (top = 2^ebits - 1: the largest binade is [1, 2), so r = 1, a block's largest
// element, is exact). exp_avg: sign and 4 exponent bits (128 magnitudes); exp_avg_sq: 5
// exponent bits (256 magnitudes).
struct Code {
  int ebits, n;
  float value[256], mid[256];  // mid[i]: halfway between value[i] and value[i + 1]
  explicit Code(int e) : ebits(e), n(8 << e) {
    const int top = (1 << e) - 1;
    for (int i = 0; i < n; i++) {
      const int E = i >> 3, M = i & 7;
      value[i] = E == 0 ? std::ldexp(float(M) / 8.0f, 1 - top)
                        : std::ldexp(1.0f + float(M) / 8.0f, E - top);
    }
    for (int i = 0; i + 1 < n; i++) mid[i] = (value[i] + value[i + 1]) / 2.0f;
  }

  // The nearest index to r (ties up): the index r truncates to from its fp32 bits, plus one
  // where r is past the midpoint to the next.
  int encode(float r) const {
    const int top = (1 << ebits) - 1;
    uint32_t b;
    std::memcpy(&b, &r, 4);
    const int exp = int(b >> 23) - 127;
    int i = exp >= 1 - top ? ((exp + top) << 3) | int((b >> 20) & 7)
                           : int(std::ldexp(r, top + 2));  // below the normals: steps of 2^(-top-2)
    i = std::min(i, n - 1);  // only a NaN gets here
    if (i < n - 1 && r >= mid[i]) i++;
    return i;
  }
};

inline const Code& signed_code() {
  static const Code c(4);
  return c;
}

inline const Code& unsigned_code() {
  static const Code c(5);
  return c;
}

inline float block_absmax(const float* x, int64_t n) {
  float a = 0.0f;
  for (int64_t i = 0; i < n; i++) a = std::max(a, std::abs(x[i]));
  return a;
}

// exp_avg of n elements (one block) to a sign bit and a 7-bit magnitude index.
inline float quantize_signed(const float* x, uint8_t* q, int64_t n) {
  const Code& c = signed_code();
  const float a = block_absmax(x, n);
  for (int64_t i = 0; i < n; i++) {
    const float r = a > 0.0f ? std::abs(x[i]) / a : 0.0f;
    q[i] = uint8_t((x[i] < 0.0f ? 0x80 : 0) | c.encode(r));
  }
  return a;
}

inline void dequantize_signed(const uint8_t* q, float a, float* x, int64_t n) {
  const Code& c = signed_code();
  for (int64_t i = 0; i < n; i++) {
    const float mag = c.value[q[i] & 0x7f] * a;
    x[i] = (q[i] & 0x80) ? -mag : mag;
  }
}

// exp_avg_sq of n elements (one block): a nonzero value never encodes to zero, whose
// denominator would be eps alone (the second moment's zero point, Li et al. 2023).
inline float quantize_unsigned(const float* x, uint8_t* q, int64_t n) {
  const Code& c = unsigned_code();
  const float a = block_absmax(x, n);
  for (int64_t i = 0; i < n; i++) {
    const float r = a > 0.0f ? std::abs(x[i]) / a : 0.0f;
    const int k = c.encode(r);
    q[i] = uint8_t(k == 0 && r > 0.0f ? 1 : k);
  }
  return a;
}

inline void dequantize_unsigned(const uint8_t* q, float a, float* x, int64_t n) {
  const Code& c = unsigned_code();
  for (int64_t i = 0; i < n; i++) x[i] = c.value[q[i]] * a;
}

}  // namespace state_codes
