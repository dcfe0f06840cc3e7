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

inline uint32_t float_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float bits_float(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// x rounded to bf16 up or down in magnitude with probability of its distance (16 random bits
// added below the bf16 mantissa, then truncation): unbiased. Inf stays inf (its low 16 bits
// are zero: no carry); NaN stays NaN, quiet, its payload's top bits kept (the quiet bit set
// and nothing added). Branch-free, one compare and a few integer operations, so that the
// compiler vectorizes the loops that call it.
inline uint16_t round_stochastic(float x, uint32_t r16) {
  const uint32_t nan = x != x ? 0xffffffffU : 0U;
  const uint32_t b = float_bits(x) | (nan & 0x00400000U);
  return uint16_t((b + (r16 & ~nan & 0xffffU)) >> 16);
}

inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

// ---- 8-bit blockwise ------------------------------------------------------------------------

constexpr int64_t kQBlock = 256;  // elements per absmax

// A floating-point code of EBITS exponent bits and 3 mantissa bits for r = |x| / absmax in
// [0, 1]: index i = E * 8 + M is 2^(E - top) * (1 + M/8) for E >= 1 and 2^(1 - top) * M/8 for
// E = 0 (top = 2^EBITS - 1: the largest binade is [1, 2), so r = 1, a block's largest
// element, is exact). exp_avg: sign and 4 exponent bits (128 magnitudes); exp_avg_sq: 5
// exponent bits (256 magnitudes). Encoding rounds to the nearest index, ties up (as
// state_format.py's comparison with the midpoints), with integer operations on r's bits.
template <int EBITS>
struct Code {
  static constexpr int kTop = (1 << EBITS) - 1;
  static constexpr int kN = 8 << EBITS;
  static constexpr uint32_t kBias = uint32_t(127 - kTop) << 3;  // fp32 exponent bias - top
  static constexpr float kSubScale = float(1ull << (kTop + 2));  // r / (step below the normals)
  static constexpr float kMinNormal = 8.0f / kSubScale;         // 2^(1 - top)

  // r in [kMinNormal, 2): round half up to 3 mantissa bits by adding half the last kept
  // bit's unit, and rebias the exponent.
  static int normal_index(float r) {
    return int((float_bits(r) + 0x80000U - (kBias << 20)) >> 20);
  }

  static int encode(float r) {
    const int normal = int((float_bits(r) + 0x80000U) >> 20) - int(kBias);  // normal_index
    // below: steps of 2^(-top-2); y = r * kSubScale (exact) in [0, 8) rounded to the nearest
    // integer by adding 2^23 (ties to even; exact), a tie then moved up. Only fp32 additions
    // and integer operations (a float-to-int conversion would keep the loop from vectorizing)
    const float y = r * kSubScale;
    const float t = y + 8388608.0f;
    const int nearest = int(float_bits(t) - 0x4b000000U);
    const int sub = nearest + int(y - (t - 8388608.0f) == 0.5f);
    const int i = r < kMinNormal ? sub : normal;
    return uint32_t(i) < uint32_t(kN - 1) ? i : kN - 1;  // a NaN's bits: the last
  }

  static float decode(uint32_t i) {
    // normals: the index's exponent and mantissa bits are an fp32's, rebiased; below: m
    // steps of 2^(-top-2) (exact)
    const float normal = bits_float((i + kBias) << 20);
    const float sub = float(int(i)) * (1.0f / kSubScale);
    return i < 8 ? sub : normal;
  }
};

using SignedCode = Code<4>;
using UnsignedCode = Code<5>;

// The largest and smallest |x| of a block, from the bits (an integer max and min vectorize; a
// NaN's bits exceed every number's, as torch's amax propagates it).
struct Range {
  float lo, hi;
};

inline Range block_range(const float* x, int64_t n) {
  uint32_t lo = 0xffffffffU, hi = 0;
  for (int64_t i = 0; i < n; i++) {
    const uint32_t b = float_bits(x[i]) & 0x7fffffffU;
    lo = std::min(lo, b);
    hi = std::max(hi, b);
  }
  return Range{bits_float(lo), bits_float(hi)};
}

// Whether every r = |x| / d of a block is a normal of the code (r >= kMinNormal, and r <= 1
// as d is its largest |x|, no NaN): then encode() is normal_index() alone, about half the
// operations. Division is monotone, so the smallest |x| gives the smallest r.
template <typename C>
inline bool all_normal(Range r, float d) {
  return r.hi <= d && r.lo / d >= C::kMinNormal;
}

// exp_avg of n elements (one block) to a sign bit and a 7-bit magnitude index; its absmax.
inline float quantize_signed(const float* x, uint8_t* q, int64_t n) {
  const Range range = block_range(x, n);
  const float a = range.hi;
  const float d = a > 0.0f ? a : 1.0f;  // a block of zeros: every r is 0
  if (all_normal<SignedCode>(range, d)) {
    for (int64_t i = 0; i < n; i++) {  // no zero (nor -0.0): the sign bit is x < 0
      const float r = std::abs(x[i]) / d;
      q[i] = uint8_t(((float_bits(x[i]) >> 24) & 0x80U) | uint32_t(SignedCode::normal_index(r)));
    }
    return a;
  }
  for (int64_t i = 0; i < n; i++) {
    const float r = std::abs(x[i]) / d;
    q[i] = uint8_t((x[i] < 0.0f ? 0x80 : 0) | SignedCode::encode(r));
  }
  return a;
}

inline float dequantize_signed(uint8_t q, float a) {
  const float mag = SignedCode::decode(q & 0x7fU) * a;
  return bits_float(float_bits(mag) | (uint32_t(q & 0x80U) << 24));  // the sign bit
}

// exp_avg_sq of n elements (one block): a nonzero value never encodes to zero, whose
// denominator would be eps alone (the second moment's zero point, Li et al. 2023).
inline float quantize_unsigned(const float* x, uint8_t* q, int64_t n) {
  const Range range = block_range(x, n);
  const float a = range.hi;
  const float d = a > 0.0f ? a : 1.0f;  // a block of zeros: every r is 0
  if (all_normal<UnsignedCode>(range, d)) {
    for (int64_t i = 0; i < n; i++) q[i] = uint8_t(UnsignedCode::normal_index(x[i] / d));
    return a;
  }
  for (int64_t i = 0; i < n; i++) {
    const float r = std::abs(x[i]) / d;
    const int k = UnsignedCode::encode(r);
    q[i] = uint8_t(k | int((k == 0) & (r > 0.0f)));
  }
  return a;
}

inline float dequantize_unsigned(uint8_t q, float a) { return UnsignedCode::decode(q) * a; }

}  // namespace state_codes
