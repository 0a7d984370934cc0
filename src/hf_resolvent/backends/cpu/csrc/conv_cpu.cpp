// The short causal convolution (conv_size) on CPU: the compiled twin of hf_resolvent/ops/conv.py, whose reference is
// SiLU of PyTorch's depthwise F.conv1d.
//
// Why C++: the mixer's projected rows are (batch, positions, channels) with the channels contiguous, and F.conv1d
// wants (batch, channels, positions): the reference pays two transposed copies each way, and its depthwise backward
// is slow beside the few multiply-adds per element the convolution is. Here each pass walks the rows in their own
// layout, every loop running along the contiguous channels.
//
//   pre[b, t, c] = bias[c] + sum_j weight[c, j] window[b, t + j, c]        j < K, t < n = L - K + 1
//   out = pre sigmoid(pre)
//   g = grad (s + pre s (1 - s)),  s = sigmoid(pre)
//   d_window[b, t + j, c] += g[b, t, c] weight[c, j];  d_weight[c, j] = sum_(b, t) g window[b, t + j, c];
//   d_bias[c] = sum_(b, t) g
//
// The backward splits the channels among the threads, so that each owns its weights' sums and its columns of
// d_window. float32 takes the vectorised exponential of common_cpu.h; float64 takes std::exp.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "common_cpu.h"

namespace hf_resolvent {
namespace {

constexpr int64_t kRowGrain = 16;       // rows per task of the forward
constexpr int64_t kChannelGrain = 256;  // channels per task of the backward

template <typename T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + exp_of(-x));
}

// pre[c] = bias[c] + sum_j wt[j, c] rows[j, c] for the channels [c0, c1) of one output row; rows points at window row t.
template <typename T>
inline void pre_activation(const T* rows, const T* wt, const T* bias, T* pre, int64_t K, int64_t C, int64_t c0,
                           int64_t c1) {
#pragma omp simd
  for (int64_t c = c0; c < c1; ++c) pre[c - c0] = bias[c];
  for (int64_t j = 0; j < K; ++j) {
    const T* r = rows + j * C;
    const T* w = wt + j * C;
#pragma omp simd
    for (int64_t c = c0; c < c1; ++c) pre[c - c0] += w[c] * r[c];
  }
}

void check_inputs(const at::Tensor& window, const at::Tensor& weight, const at::Tensor& bias, const char* op) {
  TORCH_CHECK(window.dim() == 3 && window.is_contiguous(), op,
              ": window must be a contiguous (batch, positions, channels) tensor, got ", window.sizes(),
              window.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(window.scalar_type() == at::kFloat || window.scalar_type() == at::kDouble, op,
              ": window must be float32 or float64, got ", window.scalar_type());
  const int64_t C = window.size(2);
  TORCH_CHECK(weight.dim() == 3 && weight.size(0) == C && weight.size(1) == 1 && weight.size(2) >= 1, op,
              ": weight must be (channels, 1, K) as nn.Conv1d(groups=channels) holds it, got ", weight.sizes(),
              " for ", C, " channels");
  TORCH_CHECK(window.size(1) >= weight.size(2), op, ": window must hold at least K = ", weight.size(2),
              " rows (each output row reads K), got ", window.size(1));
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == C, op, ": bias must be (channels,), got ", bias.sizes());
  TORCH_CHECK(weight.scalar_type() == window.scalar_type() && bias.scalar_type() == window.scalar_type(), op,
              ": weight and bias must have the window's dtype ", window.scalar_type(), ", got ", weight.scalar_type(),
              " and ", bias.scalar_type());
}

// weight (C, 1, K) as (K, C): tap j of every channel contiguous.
at::Tensor taps_by_channel(const at::Tensor& weight) { return weight.squeeze(1).t().contiguous(); }

// The loops, outside the dispatch macro (a pragma cannot sit in a macro's argument).
template <typename T>
void forward_rows(const T* window, const T* wt, const T* bias, T* out, int64_t L, int64_t n, int64_t C, int64_t K,
                  int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t b = row / n, t = row % n;
    T* o = out + row * C;
    pre_activation(window + (b * L + t) * C, wt, bias, o, K, C, 0, C);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) o[c] = o[c] * sigmoid(o[c]);
  }
}

// The channels [c0, c1) of every row: g, then its sums into d_bias and d_taps and its shares of d_window.
template <typename T>
void backward_channels(const T* grad, const T* window, const T* wt, const T* bias, T* d_window, T* d_taps, T* d_bias,
                       int64_t B, int64_t L, int64_t n, int64_t C, int64_t K, int64_t c0, int64_t c1) {
  std::vector<T> g(c1 - c0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < n; ++t) {
      const T* rows = window + (b * L + t) * C;
      const T* gr = grad + (b * n + t) * C;
      pre_activation(rows, wt, bias, g.data(), K, C, c0, c1);
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) {
        const T p = g[c - c0], s = sigmoid(p);
        g[c - c0] = gr[c] * (s + p * s * (T(1) - s));
        d_bias[c] += g[c - c0];
      }
      for (int64_t j = 0; j < K; ++j) {
        const T* r = rows + j * C;
        const T* w = wt + j * C;
        T* dw = d_taps + j * C;
        T* dx = d_window + (b * L + t + j) * C;
#pragma omp simd
        for (int64_t c = c0; c < c1; ++c) {
          dw[c] += g[c - c0] * r[c];
          dx[c] += g[c - c0] * w[c];
        }
      }
    }
  }
}

at::Tensor causal_conv_silu(const at::Tensor& window, const at::Tensor& weight, const at::Tensor& bias) {
  check_inputs(window, weight, bias, "causal_conv_silu");
  const int64_t B = window.size(0), L = window.size(1), C = window.size(2), K = weight.size(2), n = L - K + 1;
  at::Tensor out = at::empty({B, n, C}, window.options());
  const at::Tensor wt = taps_by_channel(weight), b = bias.contiguous();
  AT_DISPATCH_FLOATING_TYPES(window.scalar_type(), "causal_conv_silu", [&] {
    const scalar_t* xp = window.data_ptr<scalar_t>();
    const scalar_t* wp = wt.data_ptr<scalar_t>();
    const scalar_t* bp = b.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * n, kRowGrain,
                     [&](int64_t begin, int64_t end) { forward_rows(xp, wp, bp, op, L, n, C, K, begin, end); });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_conv_silu_backward(const at::Tensor& grad,
                                                                          const at::Tensor& window,
                                                                          const at::Tensor& weight,
                                                                          const at::Tensor& bias) {
  check_inputs(window, weight, bias, "causal_conv_silu_backward");
  const int64_t B = window.size(0), L = window.size(1), C = window.size(2), K = weight.size(2), n = L - K + 1;
  TORCH_CHECK(grad.is_contiguous() && grad.dim() == 3 && grad.size(0) == B && grad.size(1) == n && grad.size(2) == C &&
                  grad.scalar_type() == window.scalar_type(),
              "causal_conv_silu_backward: grad must be a contiguous (", B, ", ", n, ", ", C, ") tensor of the window's ",
              "dtype, got ", grad.sizes(), " ", grad.scalar_type());
  at::Tensor d_window = at::zeros_like(window);
  at::Tensor d_taps = at::zeros({K, C}, window.options());  // (K, C), returned as (C, 1, K)
  at::Tensor d_bias = at::zeros({C}, window.options());
  const at::Tensor wt = taps_by_channel(weight), b = bias.contiguous();
  AT_DISPATCH_FLOATING_TYPES(window.scalar_type(), "causal_conv_silu_backward", [&] {
    const scalar_t* xp = window.data_ptr<scalar_t>();
    const scalar_t* wp = wt.data_ptr<scalar_t>();
    const scalar_t* bp = b.data_ptr<scalar_t>();
    const scalar_t* gp = grad.data_ptr<scalar_t>();
    scalar_t* dxp = d_window.data_ptr<scalar_t>();
    scalar_t* dwp = d_taps.data_ptr<scalar_t>();
    scalar_t* dbp = d_bias.data_ptr<scalar_t>();
    at::parallel_for(0, C, kChannelGrain, [&](int64_t c0, int64_t c1) {
      backward_channels(gp, xp, wp, bp, dxp, dwp, dbp, B, L, n, C, K, c0, c1);
    });
  });
  return {d_window, d_taps.t().unsqueeze(1).contiguous(), d_bias};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_resolvent, m) {
  m.def("causal_conv_silu(Tensor window, Tensor weight, Tensor bias) -> Tensor");
  m.def(
      "causal_conv_silu_backward(Tensor grad, Tensor window, Tensor weight, Tensor bias) -> (Tensor, Tensor, "
      "Tensor)");
}

TORCH_LIBRARY_IMPL(hf_resolvent, CPU, m) {
  m.impl("causal_conv_silu", &causal_conv_silu);
  m.impl("causal_conv_silu_backward", &causal_conv_silu_backward);
}

}  // namespace hf_resolvent
