// One pass of AdamW over offloaded parameters on the host: per element, read the gradient
// (bf16, fp16 or fp32), unscale and clip it, update the fp32 master and both fp32 moments in
// place, and write the updated master in the dtype the device computes in. See
// protrain/optim/host_adam_ext.py for how it is built and loaded, and docs/design.md. A second
// entry point keeps the moments in bf16 or 8 bits (optimizer_state; [Note: compact moments]).
//
// [Note: same bits as torch's fused AdamW]
// torch.optim.AdamW(fused=True) on the CPU (ATen's FusedAdamKernel.cpp, ADAMW mode) runs
// every tensor in 64-byte task units, and within a thread's range a vector loop of
// Vectorized<float> followed by a scalar loop for the last size % Vec::size() elements;
// since every range but a tensor's last is a whole number of units (a multiple of every
// vector width), only a tensor's last numel % Vec::size() elements take the scalar path.
// This file does the same per segment (one segment = one parameter's tensor), with the same
// operations in the same order on the same types: the decay as a multiply by
// float(1 - lr * wd), the first moment by a lerp (fmadd and blendv in the lanes, the
// two-branch form in the tail), the second moment as v * beta2 + (coef2 * g) * g, the
// denominator as sqrt(v) / bc2_sqrt + eps, the master as p + (-step_size * m) / denom
// (p - step_size * m / denom in the tail), every double constant rounded to float as torch
// rounds it. It is compiled for the CPU capability torch dispatches to, with the same
// defines, so Vectorized<float> and fmadd are the same instructions. Unscaling and
// clipping are one multiply each, before the update, as GradScaler's unscale_ then
// clip_grad_norm_ do: a lone multiply rounds the same in a lane or a scalar.

// Only the headers the kernel uses, and torch's operator registry (torch/library.h) rather
// than torch/extension.h's pybind11 and all of ATen's operators: the first build of a CPU
// capability takes about 10 s of one core instead of 35 (host_adam_ext.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "state_codes.h"

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kUnit = 16;    // fp32 elements of the 64-byte task unit
constexpr int64_t kBlock = 1024;  // elements handled at once by a thread (a multiple of kUnit)

// The per-segment constants, as torch derives them (in double, from the step count).
struct Coefs {
  float decay, coef1, beta2, coef2, bc2_sqrt, eps, step_size;
  bool decays;
};

Coefs coefs_for(double step, double lr, double beta1, double beta2, double wd, double eps) {
  const double bc1 = 1 - std::pow(beta1, step);
  const double bc2 = 1 - std::pow(beta2, step);
  return Coefs{float(1 - lr * wd), float(1 - beta1),    float(beta2), float(1 - beta2),
               float(std::sqrt(bc2)), float(eps), float(lr / bc1), wd != 0.f};
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kFma = true;  // torch's build of these capabilities fuses where noted below
#else
constexpr bool kFma = false;  // no fma instruction: every operation rounds on its own
#endif

// v * beta2 + (coef2 * g) * g: torch's vector loop (and its compiler-vectorized tail) runs
// this as one fma of (coef2 * g) and g onto v * beta2 where the ISA has fma.
inline Vec second_moment(const Vec& v, const Vec& g, const Coefs& c) {
  const Vec v_beta2 = v * Vec(c.beta2);
  const Vec coef_g = Vec(c.coef2) * g;
  return kFma ? at::vec::fmadd(coef_g, g, v_beta2) : v_beta2 + coef_g * g;
}

inline float second_moment(float v, float g, const Coefs& c) {
  return kFma ? std::fma(c.coef2 * g, g, v * c.beta2) : v * c.beta2 + c.coef2 * g * g;
}

// Adam over n elements whose gradients are in g (already unscaled and clipped). Lanes for
// the largest multiple of Vec::size(), scalars for the rest ([Note: same bits ...]).
void adam_block(float* p, float* m, float* v, const float* g, int64_t n, const Coefs& c) {
  const Vec w(c.coef1);
  const auto small = w.abs() < Vec(0.5f);
  const Vec lerp_coef = Vec::blendv(w - Vec(1.0f), w, small);
  int64_t d = 0;
  for (; d < n - n % Vec::size(); d += Vec::size()) {
    Vec pv = Vec::loadu(p + d);
    const Vec gv = Vec::loadu(g + d);
    if (c.decays) pv = pv * Vec(c.decay);
    Vec mv = Vec::loadu(m + d);
    mv = at::vec::fmadd(lerp_coef, gv - mv, Vec::blendv(gv, mv, small));
    const Vec vv = second_moment(Vec::loadu(v + d), gv, c);
    mv.store(m + d);
    vv.store(v + d);
    const Vec denom = vv.sqrt() / Vec(c.bc2_sqrt) + Vec(c.eps);
    pv = pv + Vec(-c.step_size) * mv / denom;
    pv.store(p + d);
  }
  // The last n % Vec::size() elements of a tensor: torch's scalar loop, whose roundings
  // depend on how torch's compiler built it (it fuses the lerp into an fma, and vectorizes
  // part of the loop with other fusions): here the lerp and the second moment are fused as
  // in the lanes. These at most 15 elements of a tensor agree with torch's to a few ulp
  // (tests/optim/test_host_adam.py), every other element bit for bit.
  const bool is_small = std::abs(c.coef1) < 0.5f;
  for (; d < n; d++) {
    const float gd = g[d];
    float pd = p[d];
    if (c.decays) pd = pd * c.decay;
    float md = m[d];
    if (is_small) {
      md = kFma ? std::fma(c.coef1, gd - md, md) : md + c.coef1 * (gd - md);
    } else {
      md = kFma ? std::fma(-(gd - md), 1.0f - c.coef1, gd) : gd - (gd - md) * (1.0f - c.coef1);
    }
    const float vd = second_moment(v[d], gd, c);
    m[d] = md;
    v[d] = vd;
    const float denom = std::sqrt(vd) / c.bc2_sqrt + c.eps;
    p[d] = pd - c.step_size * md / denom;
  }
}

// adam_block's lanes written on one element, for the compact passes' fused loops, which the
// compiler vectorizes (csrc/state_codes.h): each step is one IEEE operation (fma where the
// lanes fmadd), so an element gets the same bits in a lane of any width as in adam_block's
// vector loop, but for the sign of a NaN: where two NaN operands meet (a NaN master and a
// NaN moment of the other sign), the default build's compiler-vectorized loop may keep the
// other one's sign (no finite value differs; the AVX2 and AVX-512 builds keep torch's). The
// decay multiplies by 1.0f where there is none (exact, as skipping it).
struct Lane {
  float decay, lerp_coef, beta2, coef2, bc2_sqrt, eps, neg_step;
  bool small;
};

Lane lane_coefs(const Coefs& c) {
  const bool small = std::abs(c.coef1) < 0.5f;
  return Lane{c.decays ? c.decay : 1.0f, small ? c.coef1 : c.coef1 - 1.0f, c.beta2, c.coef2,
              c.bc2_sqrt, c.eps, -c.step_size, small};
}

inline float adam_lane(float p, float& m, float& v, float g, const Lane& c) {
  p = p * c.decay;
  const float base = c.small ? m : g;
  m = kFma ? std::fma(c.lerp_coef, g - m, base) : c.lerp_coef * (g - m) + base;
  const float coef_g = c.coef2 * g;
  v = kFma ? std::fma(coef_g, g, v * c.beta2) : v * c.beta2 + coef_g * g;
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  return p + c.neg_step * m / denom;
}

// The gradient of n elements as fp32, times the inverse loss scale, then times the clip
// coefficient (each a multiply of its own, where given).
template <typename G>
void load_grad(const G* src, float* dst, int64_t n, const float* inv_scale, const float* clip) {
  at::vec::convert(src, dst, n);
  if (inv_scale) {
    const float s = *inv_scale;
    at::vec::map([s](Vec x) { return x * Vec(s); }, dst, dst, n);
  }
  if (clip) {
    const float k = *clip;
    at::vec::map([k](Vec x) { return x * Vec(k); }, dst, dst, n);
  }
}

struct Segment {
  float* p;
  float* m;
  float* v;
  const void* g;
  void* out;  // nullptr: no copy written
  at::ScalarType g_type, out_type;
  int64_t numel;
  Coefs c;
};

// [Note: streamed copies]
// The copy the pass writes is read next by the gather's device copy (DMA), not by a core, so
// caching it buys nothing, and an ordinary store first reads each line it writes into the
// cache (the write-allocate read): 2 bytes more a bf16 parameter, 30 instead of 28 with fp32
// moments and 22 instead of 20 with bf16 ones, on a host whose step is bound by its memory
// traffic. Non-temporal stores write whole lines without that read. The values are the same:
// converted as before into a buffer that stays in L1, then streamed; the pass ends with a
// store fence, so the copy is in memory before the step is reported done.
void stream_bytes(const void* src, void* dst, int64_t bytes) {
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  int64_t i = 0;
#if defined(__AVX2__)
  const int64_t head = std::min<int64_t>((32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31, bytes);
  std::memcpy(d, s, head);
  for (i = head; i + 32 <= bytes; i += 32) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), x);
  }
#endif
  std::memcpy(d + i, s + i, bytes - i);
}

inline void fence_streamed() {
#if defined(__AVX2__)
  _mm_sfence();
#endif
}

template <typename G>
void write_out(const float* p, G* out, int64_t n) {
  G buf[kBlock];  // n <= kBlock (one block of run_range)
  at::vec::convert(p, buf, n);
  stream_bytes(buf, out, n * int64_t(sizeof(G)));
}

// Elements [lo, lo + n) of a segment's gradient into gbuf, as fp32, unscaled and clipped.
void load_segment_grad(const Segment& s, int64_t lo, int64_t n, float* gbuf,
                       const float* inv_scale, const float* clip) {
  switch (s.g_type) {
    case at::kFloat:
      load_grad(static_cast<const float*>(s.g) + lo, gbuf, n, inv_scale, clip);
      break;
    case at::kBFloat16:
      load_grad(static_cast<const c10::BFloat16*>(s.g) + lo, gbuf, n, inv_scale, clip);
      break;
    default:
      load_grad(static_cast<const c10::Half*>(s.g) + lo, gbuf, n, inv_scale, clip);
  }
}

// Elements [lo, lo + n) of a segment's master into its copy, where it has one.
void write_segment_out(const Segment& s, int64_t lo, int64_t n) {
  if (!s.out) return;
  switch (s.out_type) {
    case at::kFloat:
      write_out(s.p + lo, static_cast<float*>(s.out) + lo, n);
      break;
    case at::kBFloat16:
      write_out(s.p + lo, static_cast<c10::BFloat16*>(s.out) + lo, n);
      break;
    default:
      write_out(s.p + lo, static_cast<c10::Half*>(s.out) + lo, n);
  }
}

// Elements [a, b) of one segment, a block at a time.
void run_range(const Segment& s, int64_t a, int64_t b, const float* inv_scale, const float* clip) {
  float gbuf[kBlock];
  for (int64_t lo = a; lo < b; lo += kBlock) {
    const int64_t n = std::min(kBlock, b - lo);
    load_segment_grad(s, lo, n, gbuf, inv_scale, clip);
    adam_block(s.p + lo, s.m + lo, s.v + lo, gbuf, n, s.c);
    write_segment_out(s, lo, n);
  }
  fence_streamed();
}

void check_segment(const at::Tensor& p, const at::Tensor& m, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& out) {
  const auto n = p.numel();
  TORCH_CHECK(p.scalar_type() == at::kFloat && m.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat,
              "host_adam: masters and moments must be fp32");
  TORCH_CHECK(m.numel() == n && v.numel() == n && g.numel() == n,
              "host_adam: a segment's master, moments and gradient differ in size");
  TORCH_CHECK(out.numel() == 0 || out.numel() == n, "host_adam: the copy's size differs");
  for (const auto* t : {&p, &m, &v, &g, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(),
                "host_adam: every tensor must be contiguous and on the CPU");
  }
  const auto ok = [](at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
  };
  TORCH_CHECK(ok(g.scalar_type()) && (out.numel() == 0 || ok(out.scalar_type())),
              "host_adam: gradients and copies must be fp32, bf16 or fp16");
}


// fn(i, a, b) over every segment's elements, cut into task units of `unit` elements that
// at::parallel_for shares among the threads (each segment's own ranges, in order).
template <typename F>
void parallel_over_segments(const std::vector<int64_t>& numels, int64_t unit, const F& fn) {
  std::vector<int64_t> first_unit{0};  // prefix sums of the segments' task units
  for (const int64_t n : numels) first_unit.push_back(first_unit.back() + (n + unit - 1) / unit);
  const size_t k = numels.size();
  at::parallel_for(0, first_unit.back(), 0, [&](int64_t begin, int64_t end) {
    // the segments this range of units covers, each over its own part of the range
    size_t i = std::upper_bound(first_unit.begin(), first_unit.end(), begin) -
               first_unit.begin() - 1;
    for (; i < k && first_unit[i] < end; i++) {
      const int64_t u0 = std::max(begin, first_unit[i]) - first_unit[i];
      const int64_t u1 = std::min(end, first_unit[i + 1]) - first_unit[i];
      const int64_t a = u0 * unit, b = std::min(u1 * unit, numels[i]);
      if (a < b) fn(i, a, b);
    }
  });
}

// ---- compact moments (optimizer_state: bf16 | 8bit) -------------------------------------
//
// [Note: compact moments]
// A block's moments are decoded to fp32, stepped with the fp32 state's arithmetic (adam_lane,
// adam_block's lanes on one element; a segment's tail by adam_block itself) and encoded back;
// the master stays fp32. bf16: each moment rounded stochastically with 16 bits of a hash of
// (the parameter's seed, its step count, the element's offset), so a run and its resume draw
// the same bits on any number of threads. 8bit: per block of kQBlock elements of a parameter
// its absmax (fp32) and a byte an element (state_codes.h); threads take whole blocks (task
// units of kQBlock), since a block's absmax needs all of it.
// Decoding, the update and (bf16) encoding run in one loop that the compiler vectorizes, so
// the moments stay in registers and the integer work of the codes overlaps the update's
// divisions and square root, which bound the fp32 pass's arithmetic; 8-bit encoding is a
// second loop over the block, once its absmax is known.

enum class StateFormat : int64_t { kBf16 = 1, k8bit = 2 };

struct Compact {
  void* m;  // bf16 or uint8, as the format says
  void* v;
  float* absmax_m;  // 8bit: one per block
  float* absmax_v;
  uint32_t key;  // bf16: state_codes::step_key of this step
};

// Elements [lo, lo + n) of a bf16-moment segment, n a multiple of Vec::size(): decode, Adam
// and encode in one loop the compiler vectorizes, so the moments never leave registers.
void bf16_lanes(float* __restrict p, uint16_t* __restrict mq, uint16_t* __restrict vq,
                const float* __restrict g, int64_t n, uint32_t key, uint32_t lo, const Lane c) {
  using namespace state_codes;
  uint32_t offset = lo;  // 32-bit lanes, as the hash wraps (an int64 index would widen them)
  for (int64_t i = 0; i < n; i++, offset++) {
    float m = bf16_to_float(mq[i]), v = bf16_to_float(vq[i]);
    p[i] = adam_lane(p[i], m, v, g[i], c);
    const uint32_t r = element_bits(key, offset);
    mq[i] = round_stochastic(m, r);
    vq[i] = round_stochastic(v, r >> 16);
  }
}

// The same for the last n < Vec::size() elements of a segment: adam_block's scalar tail.
void bf16_tail(float* p, uint16_t* mq, uint16_t* vq, const float* g, int64_t n, uint32_t key,
               uint32_t lo, const Coefs& c) {
  using namespace state_codes;
  float m[kUnit], v[kUnit];
  for (int64_t i = 0; i < n; i++) m[i] = bf16_to_float(mq[i]), v[i] = bf16_to_float(vq[i]);
  adam_block(p, m, v, g, n, c);
  for (int64_t i = 0; i < n; i++) {
    const uint32_t r = element_bits(key, lo + uint32_t(i));
    mq[i] = round_stochastic(m[i], r);
    vq[i] = round_stochastic(v[i], r >> 16);
  }
}

// n elements of one 8-bit block (n <= kQBlock) at p, with n8 (a multiple of Vec::size())
// dequantized and stepped in one vectorized loop, the rest by adam_block's scalar tail; then
// the block's new absmaxes and codes.
void q8_block(float* __restrict p, uint8_t* __restrict mq, uint8_t* __restrict vq,
              float* __restrict absmax_m, float* __restrict absmax_v, const float* __restrict g,
              int64_t n, int64_t n8, const Coefs& coefs) {
  using namespace state_codes;
  alignas(64) float m[kQBlock];
  alignas(64) float v[kQBlock];
  const Lane c = lane_coefs(coefs);
  const float am = *absmax_m, av = *absmax_v;
  for (int64_t i = 0; i < n8; i++) {
    m[i] = dequantize_signed(mq[i], am);
    v[i] = dequantize_unsigned(vq[i], av);
    p[i] = adam_lane(p[i], m[i], v[i], g[i], c);
  }
  if (n8 < n) {
    for (int64_t i = n8; i < n; i++) {
      m[i] = dequantize_signed(mq[i], am);
      v[i] = dequantize_unsigned(vq[i], av);
    }
    adam_block(p + n8, m + n8, v + n8, g + n8, n - n8, coefs);
  }
  *absmax_m = quantize_signed(m, mq, n);
  *absmax_v = quantize_unsigned(v, vq, n);
}

// Elements [lo, lo + n) of one segment with compact moments, gradients in g.
void compact_block(const Segment& s, const Compact& q, StateFormat f, int64_t lo, int64_t n,
                   const float* g) {
  const int64_t end = lo + n;
  const int64_t end8 = end == s.numel ? end - end % Vec::size() : end;  // the tail's start
  if (f == StateFormat::kBf16) {
    auto* mq = static_cast<uint16_t*>(q.m);
    auto* vq = static_cast<uint16_t*>(q.v);
    bf16_lanes(s.p + lo, mq + lo, vq + lo, g, end8 - lo, q.key, uint32_t(lo), lane_coefs(s.c));
    if (end8 < end) {
      bf16_tail(s.p + end8, mq + end8, vq + end8, g + (end8 - lo), end - end8, q.key,
                uint32_t(end8), s.c);
    }
    return;
  }
  for (int64_t j = lo; j < end; j += state_codes::kQBlock) {
    const int64_t len = std::min(state_codes::kQBlock, end - j), blk = j / state_codes::kQBlock;
    q8_block(s.p + j, static_cast<uint8_t*>(q.m) + j, static_cast<uint8_t*>(q.v) + j,
             q.absmax_m + blk, q.absmax_v + blk, g + (j - lo), len,
             std::max<int64_t>(std::min(end8 - j, len), 0), s.c);
  }
}

// Elements [a, b) of one segment with compact moments ([Note: compact moments]).
void run_range_compact(const Segment& s, const Compact& q, StateFormat f, int64_t a, int64_t b,
                       const float* inv_scale, const float* clip) {
  float gbuf[kBlock];
  for (int64_t lo = a; lo < b; lo += kBlock) {
    const int64_t n = std::min(kBlock, b - lo);
    load_segment_grad(s, lo, n, gbuf, inv_scale, clip);
    compact_block(s, q, f, lo, n, gbuf);
    write_segment_out(s, lo, n);
  }
  fence_streamed();
}

void check_compact(StateFormat f, const at::Tensor& p, const at::Tensor& m, const at::Tensor& v,
                   const at::Tensor& am, const at::Tensor& av) {
  const auto n = p.numel();
  const auto want = f == StateFormat::kBf16 ? at::kBFloat16 : at::kByte;
  TORCH_CHECK(m.scalar_type() == want && v.scalar_type() == want,
              "host_adam: compact moments must be ", want, " for this format");
  TORCH_CHECK(m.numel() == n && v.numel() == n,
              "host_adam: a segment's master and moments differ in size");
  if (f == StateFormat::k8bit) {
    const int64_t blocks = (n + state_codes::kQBlock - 1) / state_codes::kQBlock;
    TORCH_CHECK(am.scalar_type() == at::kFloat && av.scalar_type() == at::kFloat &&
                    am.numel() == blocks && av.numel() == blocks,
                "host_adam: 8-bit moments need one fp32 absmax per block of ",
                state_codes::kQBlock, " elements");
  }
  for (const auto* t : {&m, &v, &am, &av}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(),
                "host_adam: every tensor must be contiguous and on the CPU");
  }
}
}  // namespace

// One AdamW step (one parameter group's hyperparameters) over every segment; steps[i] is
// segment i's step count after this step's increment. out[i] of no elements: no copy.
void adamw_step(at::TensorList params, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList grads, at::TensorList outs, at::ArrayRef<double> steps, double lr,
                double beta1, double beta2, double weight_decay, double eps, std::optional<double> inv_scale,
                std::optional<double> clip_coef) {
  const size_t k = params.size();
  TORCH_CHECK(exp_avgs.size() == k && exp_avg_sqs.size() == k && grads.size() == k &&
                  outs.size() == k && steps.size() == k,
              "host_adam: the lists differ in length");
  std::vector<Segment> segs;
  std::vector<int64_t> numels;
  for (size_t i = 0; i < k; i++) {
    check_segment(params[i], exp_avgs[i], exp_avg_sqs[i], grads[i], outs[i]);
    const bool has_out = outs[i].numel() > 0;
    segs.push_back(Segment{params[i].data_ptr<float>(), exp_avgs[i].data_ptr<float>(),
                           exp_avg_sqs[i].data_ptr<float>(), grads[i].data_ptr(),
                           has_out ? outs[i].data_ptr() : nullptr, grads[i].scalar_type(),
                           has_out ? outs[i].scalar_type() : at::kFloat, params[i].numel(),
                           coefs_for(steps[i], lr, beta1, beta2, weight_decay, eps)});
    numels.push_back(params[i].numel());
  }
  const float inv_f = inv_scale ? float(*inv_scale) : 1.0f;
  const float clip_f = clip_coef ? float(*clip_coef) : 1.0f;
  const float* inv_p = inv_scale ? &inv_f : nullptr;
  const float* clip_p = clip_coef ? &clip_f : nullptr;
  parallel_over_segments(numels, kUnit, [&](size_t i, int64_t a, int64_t b) {
    run_range(segs[i], a, b, inv_p, clip_p);
  });
}

// adamw_step with compact moments ([Note: compact moments]): format 1 (bf16: exp_avgs and
// exp_avg_sqs bf16, absmaxes unused) or 2 (8bit: uint8 codes and one fp32 absmax per block
// of each); seeds[i]: segment i's parameter's seed of the stochastic rounding.
void adamw_step_compact(at::TensorList params, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList absmax_avgs,
                        at::TensorList absmax_sqs, at::TensorList grads, at::TensorList outs,
                        at::ArrayRef<double> steps, at::ArrayRef<int64_t> seeds, int64_t format,
                        double lr, double beta1, double beta2, double weight_decay, double eps,
                        std::optional<double> inv_scale, std::optional<double> clip_coef) {
  TORCH_CHECK(format == 1 || format == 2, "host_adam: compact format ", format,
              " is neither 1 (bf16) nor 2 (8bit)");
  const auto f = static_cast<StateFormat>(format);
  const size_t k = params.size();
  TORCH_CHECK(exp_avgs.size() == k && exp_avg_sqs.size() == k && absmax_avgs.size() == k &&
                  absmax_sqs.size() == k && grads.size() == k && outs.size() == k &&
                  steps.size() == k && seeds.size() == k,
              "host_adam: the lists differ in length");
  std::vector<Segment> segs;
  std::vector<Compact> qs;
  std::vector<int64_t> numels;
  for (size_t i = 0; i < k; i++) {
    // the master stands in for the moments, whose own checks are check_compact's
    check_segment(params[i], params[i], params[i], grads[i], outs[i]);
    check_compact(f, params[i], exp_avgs[i], exp_avg_sqs[i], absmax_avgs[i], absmax_sqs[i]);
    const bool has_out = outs[i].numel() > 0;
    segs.push_back(Segment{params[i].data_ptr<float>(), nullptr, nullptr, grads[i].data_ptr(),
                           has_out ? outs[i].data_ptr() : nullptr, grads[i].scalar_type(),
                           has_out ? outs[i].scalar_type() : at::kFloat, params[i].numel(),
                           coefs_for(steps[i], lr, beta1, beta2, weight_decay, eps)});
    const bool q8 = f == StateFormat::k8bit;
    qs.push_back(Compact{exp_avgs[i].data_ptr(), exp_avg_sqs[i].data_ptr(),
                         q8 ? absmax_avgs[i].data_ptr<float>() : nullptr,
                         q8 ? absmax_sqs[i].data_ptr<float>() : nullptr,
                         state_codes::step_key(uint64_t(steps[i]), uint32_t(seeds[i]))});
    numels.push_back(params[i].numel());
  }
  const float inv_f = inv_scale ? float(*inv_scale) : 1.0f;
  const float clip_f = clip_coef ? float(*clip_coef) : 1.0f;
  const float* inv_p = inv_scale ? &inv_f : nullptr;
  const float* clip_p = clip_coef ? &clip_f : nullptr;
  parallel_over_segments(numels, state_codes::kQBlock, [&](size_t i, int64_t a, int64_t b) {
    run_range_compact(segs[i], qs[i], f, a, b, inv_p, clip_p);
  });
}

int64_t vec_size() { return Vec::size(); }

std::string capability() {
#if defined(CPU_CAPABILITY_AVX512)
  return "AVX512";
#elif defined(CPU_CAPABILITY_AVX2)
  return "AVX2";
#else
  return "DEFAULT";
#endif
}

// The operators torch.ops.<PROTRAIN_OPS>.*, PROTRAIN_OPS being the build's own name (one
// namespace a build, so that two builds never register the same operator).
#define PROTRAIN_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)  // expands PROTRAIN_OPS first

PROTRAIN_LIBRARY(PROTRAIN_OPS, m) {
  // One AdamW pass: gradient in, master and moments in place, the master's copy out.
  m.def(
      "adamw_step(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor[] grads, Tensor(d!)[] outs, float[] steps, float lr, float beta1, float beta2, "
      "float weight_decay, float eps, float? inv_scale, float? clip_coef) -> ()",
      &adamw_step);
  // adamw_step with bf16 or 8-bit moments ([Note: compact moments]).
  m.def(
      "adamw_step_compact(Tensor(a!)[] params, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] absmax_avgs, Tensor(e!)[] absmax_sqs, "
      "Tensor[] grads, Tensor(f!)[] outs, float[] steps, int[] seeds, int format, float lr, "
      "float beta1, float beta2, float weight_decay, float eps, float? inv_scale, "
      "float? clip_coef) -> ()",
      &adamw_step_compact);
  m.def("vec_size() -> int", &vec_size);      // fp32 lanes of this build's vectors
  m.def("capability() -> str", &capability);  // the CPU capability this build is for
}
