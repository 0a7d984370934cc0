// GPT-2's GELU (the tanh approximation) on CPU: the compiled twin of hf_resolvent/ops/gelu.py, whose reference is
// PyTorch's own F.gelu(approximate="tanh").
//
// Why C++: PyTorch's CPU kernel for the tanh form is compute-bound, several times slower than one pass over the
// activations, and the MLP's activations (n x 4 width floats per layer) are the largest tensor of a prefill. Here the
// tanh is written through an exponential that the compiler vectorises, so the pass is bound by memory again.
//
//   gelu(x) = x (1 + tanh(u)) / 2 = x sigmoid(2u) = x / (1 + e^(-2u)),   u = c (x + a x^3),  c = sqrt(2/pi), a = 0.044715
//   gelu'(x) = s + x s (1 - s) 2 c (1 + 3 a x^2),                            s = sigmoid(2u)
//
// float32 takes the vectorised exponential of common_cpu.h; float64 takes std::exp. NaN stays NaN.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cstdint>

#include "common_cpu.h"

namespace hf_resolvent {
namespace {

constexpr double kC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kA = 0.044715;
constexpr int64_t kGrain = 1 << 14;  // elements per task of the intra-op threads

// sigmoid(2u) for the x given: 1 / (1 + e^(-2u)).
template <typename T>
inline T gate(T x) {
  const T u = static_cast<T>(kC) * (x + static_cast<T>(kA) * x * x * x);
  return T(1) / (T(1) + exp_of(T(-2) * u));
}

// The element loops, outside the dispatch macro (a pragma cannot sit in a macro's argument).
template <typename T>
void forward_range(const T* x, T* out, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) out[i] = x[i] * gate(x[i]);
}

template <typename T>
void backward_range(const T* grad, const T* x, T* out, int64_t begin, int64_t end) {
  const T two_c = static_cast<T>(2 * kC), three_a = static_cast<T>(3 * kA);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const T v = x[i], s = gate(v), slope = s * (T(1) - s);
    // where the gate is saturated, its slope is 0 and v^3 may be infinite: the term is 0, not 0 * inf
    out[i] = grad[i] * (s + (slope > T(0) ? v * slope * two_c * (T(1) + three_a * v * v) : T(0)));
  }
}

void check_input(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.is_contiguous() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble), op, ": ", name,
              " must be a contiguous float32 or float64 tensor, got ", t.scalar_type(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

at::Tensor gelu_tanh(const at::Tensor& x) {
  check_input(x, "x", "gelu_tanh");
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gelu_tanh", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGrain,
                     [&](int64_t begin, int64_t end) { forward_range(xp, op, begin, end); });
  });
  return out;
}

at::Tensor gelu_tanh_backward(const at::Tensor& grad, const at::Tensor& x) {
  check_input(x, "x", "gelu_tanh_backward");
  check_input(grad, "grad", "gelu_tanh_backward");
  TORCH_CHECK(grad.sizes() == x.sizes() && grad.scalar_type() == x.scalar_type(),
              "gelu_tanh_backward: grad must match x, got ", grad.sizes(), " and ", x.sizes());
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gelu_tanh_backward", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), kGrain,
                     [&](int64_t begin, int64_t end) { backward_range(gp, xp, op, begin, end); });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_resolvent, m) {
  m.def("gelu_tanh(Tensor x) -> Tensor");
  m.def("gelu_tanh_backward(Tensor grad, Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_resolvent, CPU, m) {
  m.impl("gelu_tanh", &gelu_tanh);
  m.impl("gelu_tanh_backward", &gelu_tanh_backward);
}

}  // namespace hf_resolvent
