// Vector helpers shared by the CPU kernels.
#pragma once

#include <cstdint>

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

// y += a x
template <typename T>
inline void axpy(T* __restrict y, T a, const T* __restrict x, int64_t len) {
#pragma omp simd
  for (int64_t c = 0; c < len; ++c) y[c] += a * x[c];
}

}  // namespace hf_resolvent
