// Vector helpers shared by the CPU kernels.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace hf_resolvent {

// Dot product in 16 independent lanes: without -ffast-math GCC keeps `omp simd reduction(+)` (and a plain loop)
// a scalar, latency-bound chain, a visible share of the dense backward; the lane array vectorizes
// (figures: bench/NOTES.md).
template <typename T>
inline T dot(const T* __restrict x, const T* __restrict y, int64_t len) {
  constexpr int L = 16;
  T lane[L] = {};
  int64_t j = 0;
  for (; j + L <= len; j += L)
    for (int c = 0; c < L; ++c) lane[c] += x[j + c] * y[j + c];
  for (int c = 0; j + c < len; ++c) lane[c] += x[j + c] * y[j + c];
  for (int w = L / 2; w > 0; w /= 2)
    for (int c = 0; c < w; ++c) lane[c] += lane[c + w];
  return lane[0];
}

// e^y in float32 without a library call, so that a loop of it vectorises: y = k ln2 + r with |r| <= ln2 / 2 (ln 2
// split in two parts so that k ln2 is exact), e^r by its Taylor series to r^7 (relative error below 1e-8 there),
// and 2^k written into the exponent bits. Past 88, e^y overflows to infinity as std::exp does; below -87 it is 0
// (std::exp gives subnormals there, below 1.2e-38), so that e^-inf = 0. The bounds are compares, which the
// compiler turns into vector min, max and blend (std::fmin would not vectorise); a NaN passes them and stays NaN.
inline float exp_f32(float y) {
  float c = y < -87.f ? -87.f : y;
  c = c > 88.f ? 88.f : c;
  const float k = std::nearbyint(c * 1.44269504088896341f);
  const float r = (c - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  const float e = y > 88.f ? std::numeric_limits<float>::infinity() : p * two_k;
  return y < -87.f ? 0.f : e;
}

// e^y: the vectorised float32 form above, std::exp in float64 (where the kernels serve as references in tests).
inline float exp_of(float y) { return exp_f32(y); }
inline double exp_of(double y) { return std::exp(y); }

// y += a x
template <typename T>
inline void axpy(T* __restrict y, T a, const T* __restrict x, int64_t len) {
#pragma omp simd
  for (int64_t c = 0; c < len; ++c) y[c] += a * x[c];
}

}  // namespace hf_resolvent
