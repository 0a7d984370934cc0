// Vector helpers shared by the CPU kernels. `omp simd` (built with -fopenmp-simd, no OpenMP runtime) lets the
// compiler reorder the dot product's sum into SIMD lanes, which strict IEEE order would forbid.
#pragma once

#include <cstdint>

namespace hf_resolvent {

template <typename T>
inline T dot(const T* a, const T* b, int64_t d) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < d; ++i) acc += a[i] * b[i];
  return acc;
}

// y += a x
template <typename T>
inline void axpy(T* y, T a, const T* x, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) y[i] += a * x[i];
}

}  // namespace hf_resolvent
