// Dense kernels of the parallel form on CPU, both made of chunked gemms per (batch, head):
// - the dense solve Y = (I - diag(g) P)^-1 Z, P the causal softmax over earlier keys (ops/dense_solve.py's DenseSolve);
// - causal attention, the direct term Z = A~ X of the dense and attention patterns (ops/attention.py), at the end.
//
// Shapes (all contiguous, one dtype: float32 or float64):
//   q, k  (B, H, n, d)     queries / keys of the B weights
//   g     (B, H, n)        row gates (the caller passes g[..., 0] = 0; any value works)
//   z, y  (B, H, n, e)     right-hand side / solution (e may differ from d)
//   lse   (B, H, n)        log-sum-exp of row i's scaled scores over keys j < i; -1e30 for row 0
//
//   p_ij = softmax_{j < i}(scale q_i . k_j),   y_i = z_i + g_i sum_{j < i} p_ij y_j
//
// Each (batch, head) is independent: at::parallel_for over them, one head per task; the gemms inside
// run on one thread (MKL goes serial inside an OpenMP region), which on few cores beats splitting
// one head's small gemms over threads. Build with -fopenmp: ATen's OpenMP parallel_for is an inline
// `omp parallel`, which without it runs every head on the calling thread (and MKL then threads each small
// gemm, mostly spinning, so that 2 threads lost to 1; see bench/NOTES.md). Rows go in chunks of C: a chunk's
// scores against all earlier keys are one gemm, the contribution of the solved rows before it a second gemm, and
// only the C x C unit lower-triangular in-chunk system is solved by substitution loops. Nothing of
// size n x n is stored: per thread, two C x n scratch buffers. This is hf_resolvent/ops/dense_solve.py's DenseSolve
// (its PyTorch twin and reference) without the row tree: the gemms see whole chunks of rows.
//
// Backward (chunks in reverse): dZ = (I - diag(g) P)^-T dY is solved by the transposed substitution,
// which needs every later row's dz complete before a chunk is used; with dz final, the chunk's
// score gradients follow as in attention, with dP_ij = dz_i . y_j and delta_i = sum_j p_ij dP_ij
// (which is also dg_i, since y = z + g o with o_i = sum_j p_ij y_j). No o needs saving.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "common_cpu.h"

extern "C" {
// Fortran BLAS exported by libtorch_cpu (MKL or OpenBLAS, whichever PyTorch was built with).
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace hf_resolvent {
namespace {

constexpr double kNeg = -1e30;  // "minus infinity" that keeps exp(a - b) finite when both are "minus infinity"

// Row-major c (m x n) = alpha op(a) op(b) + beta c, with op(x) = x^T where t* is set. Row-major matrices
// are column-major transposes, so this is the column-major c^T = op(b)^T op(a)^T: swap the operands.
template <typename T>
void gemm(bool ta, bool tb, int m, int n, int k, T alpha, const T* a, int lda, const T* b, int ldb, T beta, T* c,
          int ldc) {
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // BLAS would be fine, but its leading-dimension checks reject ld = 0 of empty operands
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) c[(int64_t)i * ldc + j] = beta == T(0) ? T(0) : beta * c[(int64_t)i * ldc + j];
    return;
  }
  const char opa = ta ? 'T' : 'N', opb = tb ? 'T' : 'N';
  if constexpr (std::is_same_v<T, float>)
    sgemm_(&opb, &opa, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
  else
    dgemm_(&opb, &opa, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

// exp for x <= ~0 (scores minus their row max or log-sum-exp), written branch-free so that the row loops
// vectorize (glibc's vector expf is only declared under -ffast-math). Cephes' expf: x = k ln2 + r,
// |r| <= ln2 / 2, degree-7 polynomial, about 1 ulp; x below -87 gives the smallest normal float, not 0,
// which is below any tolerance that matters here.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  x = std::min(x, 88.0f);
  float kf = x * 1.44269504088896341f + 12582912.0f;  // round to nearest by the 1.5 * 2^23 trick
  kf -= 12582912.0f;
  float r = x - kf * 0.693359375f;
  r -= kf * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(kf) + 127) << 23;
  float two_k;
  std::memcpy(&two_k, &bits, sizeof two_k);
  return p * two_k;
}
inline double fast_exp(double x) { return std::exp(x); }  // float64 is for checks, not speed

// Max of s[0:len), in a 64-byte GCC/Clang vector (lowered to whatever the target has): without
// -ffast-math GCC vectorizes neither `omp simd reduction(max)` nor a lane array of float maxes, and the
// scalar chain was a visible share of the forward (figures: bench/NOTES.md).
template <typename T>
T row_max(const T* s, int len) {
  constexpr int L = 64 / sizeof(T);
  typedef T V __attribute__((vector_size(64)));
  V acc;
  for (int c = 0; c < L; ++c) acc[c] = static_cast<T>(kNeg);
  int j = 0;
  for (; j + L <= len; j += L) {
    V x;
    std::memcpy(&x, s + j, sizeof x);
    acc = acc > x ? acc : x;
  }
  T m = static_cast<T>(kNeg);
  for (; j < len; ++j) m = m > s[j] ? m : s[j];
  for (int c = 0; c < L; ++c) m = m > acc[c] ? m : acc[c];
  return m;
}

// p[0:len) = exp(s - shift) in place; returns the sum.
template <typename T>
T exp_shift(T* s, int len, T shift) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < len; ++j) {
    const T p = fast_exp(s[j] - shift);
    s[j] = p;
    sum += p;
  }
  return sum;
}

template <typename T>
void fill_zero(T* x, int len) {
  if (len > 0) std::memset(x, 0, sizeof(T) * len);
}

// q, k (B, H, n, d) of one shape and values (B, H, n, e) named `vname`: one floating dtype, contiguous CPU
// tensors, sizes that fit the BLAS ints; chunk >= 1. Shared by the dense solve and causal attention.
void check_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* vname, int64_t chunk,
                const char* op) {
  TORCH_CHECK(q.dim() == 4, op, ": q must be (B, H, n, d), got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must have q's shape ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.dim() == 4 && v.sizes().slice(0, 3) == q.sizes().slice(0, 3), op, ": ", vname,
              " must be (B, H, n, e) with (B, H, n) = ", q.sizes().slice(0, 3), ", got ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, op,
              ": expected float32 or float64, got ", q.scalar_type());
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": all inputs must share q's dtype ", q.scalar_type(),
                ", got ", t->scalar_type());
    TORCH_CHECK(t->device().is_cpu(), op, ": CPU kernel got a tensor on ", t->device());
    TORCH_CHECK(t->is_contiguous(), op, ": inputs must be contiguous (call .contiguous())");
  }
  TORCH_CHECK(chunk >= 1, op, ": chunk must be >= 1, got ", chunk);
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();  // BLAS dimensions and strides are int
  TORCH_CHECK(q.size(2) < kMaxInt && q.size(3) < kMaxInt && v.size(3) < kMaxInt, op,
              ": n, d and e must fit a 32-bit BLAS int, got ", q.size(2), ", ", q.size(3), ", ", v.size(3));
}

// The dense solve's inputs: check_rows for q, k and z (or y), and the gates g (B, H, n).
void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& g, const at::Tensor& z,
                  const char* zname, int64_t chunk) {
  check_rows(q, k, z, zname, chunk, "dense_solve");
  TORCH_CHECK(g.dim() == 3 && g.sizes() == q.sizes().slice(0, 3), "dense_solve: g must be (B, H, n) = ",
              q.sizes().slice(0, 3), ", got ", g.sizes());
  TORCH_CHECK(g.scalar_type() == q.scalar_type(), "dense_solve: all inputs must share q's dtype ", q.scalar_type(),
              ", got ", g.scalar_type());
  TORCH_CHECK(g.device().is_cpu(), "dense_solve: CPU kernel got a tensor on ", g.device());
  TORCH_CHECK(g.is_contiguous(), "dense_solve: inputs must be contiguous (call .contiguous())");
}

// ------------------------------------------------------------------------------------------------
// Forward

template <typename T>
void forward_head(const T* q, const T* k, const T* g, const T* z, T* y, T* lse, int n, int d, int e, int chunk,
                  T scale, T* s) {
  std::memcpy(y, z, sizeof(T) * n * e);
  for (int r0 = 0; r0 < n; r0 += chunk) {
    const int r1 = std::min(n, r0 + chunk), rows = r1 - r0, ld = r1;
    // s (rows x r1) = scale q[r0:r1] k[0:r1]^T: every key a row of the chunk can see (and a few it can't).
    gemm<T>(false, true, rows, r1, d, scale, q + (int64_t)r0 * d, d, k, d, T(0), s, ld);
    // s -> g_i p_ij: the solve only ever uses the gated weights.
    for (int i = r0; i < r1; ++i) {
      T* si = s + (int64_t)(i - r0) * ld;
      if (i == 0) {
        lse[0] = static_cast<T>(kNeg);
        fill_zero(si, r1);
        continue;
      }
      const T m = row_max(si, i);
      const T sum = exp_shift(si, i, m);
      lse[i] = m + std::log(sum);
      const T w = g[i] / sum;
#pragma omp simd
      for (int j = 0; j < i; ++j) si[j] *= w;
      fill_zero(si + i, r1 - i);
    }
    // y_c = z_c + (g p)[:, :r0] y[0:r0]: the already solved rows.
    gemm<T>(false, false, rows, e, r0, T(1), s, ld, y, e, T(1), y + (int64_t)r0 * e, e);
    // In-chunk unit lower-triangular system by forward substitution.
    for (int i = r0 + 1; i < r1; ++i) {
      const T* si = s + (int64_t)(i - r0) * ld;
      T* yi = y + (int64_t)i * e;
      for (int j = r0; j < i; ++j) axpy(yi, si[j], y + (int64_t)j * e, e);
    }
  }
}

std::tuple<at::Tensor, at::Tensor> dense_solve_forward(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& g, const at::Tensor& z, double scale,
                                                       int64_t chunk) {
  check_inputs(q, k, g, z, "z", chunk);
  const int64_t heads = q.size(0) * q.size(1);
  const int n = q.size(2), d = q.size(3), e = z.size(3);
  const int c = static_cast<int>(std::min<int64_t>(chunk, std::max(n, 1)));
  at::Tensor y = at::empty_like(z);
  at::Tensor lse = at::empty_like(g);
  if (heads == 0 || n == 0) return {y, lse};
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dense_solve_forward", [&] {
    const scalar_t *qp = q.const_data_ptr<scalar_t>(), *kp = k.const_data_ptr<scalar_t>();
    const scalar_t *gp = g.const_data_ptr<scalar_t>(), *zp = z.const_data_ptr<scalar_t>();
    scalar_t *yp = y.mutable_data_ptr<scalar_t>(), *lp = lse.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
      std::vector<scalar_t> s((size_t)c * n);
      for (int64_t h = h0; h < h1; ++h)
        forward_head<scalar_t>(qp + h * n * d, kp + h * n * d, gp + h * n, zp + h * n * e, yp + h * n * e,
                               lp + h * n, n, d, e, c, static_cast<scalar_t>(scale), s.data());
    });
  });
  return {y, lse};
}

// ------------------------------------------------------------------------------------------------
// Backward

template <typename T>
void backward_head(const T* q, const T* k, const T* g, const T* y, const T* lse, const T* dy, T* dq, T* dk, T* dz,
                   T* dg, int n, int d, int e, int chunk, T scale, T* p, T* dp, T* gdz) {
  std::memcpy(dz, dy, sizeof(T) * n * e);
  const int last = ((n - 1) / chunk) * chunk;
  for (int r0 = last; r0 >= 0; r0 -= chunk) {
    const int r1 = std::min(n, r0 + chunk), rows = r1 - r0, ld = r1;
    const T* qc = q + (int64_t)r0 * d;
    // p (rows x r1) = exp(scale q_c k^T - lse), zero for j >= i (ungated, as dS needs it).
    gemm<T>(false, true, rows, r1, d, scale, qc, d, k, d, T(0), p, ld);
    for (int i = r0; i < r1; ++i) {
      T* pi = p + (int64_t)(i - r0) * ld;
      exp_shift(pi, i, lse[i]);
      fill_zero(pi + i, r1 - i);
    }
    // dz_c <- (I - diag(g) P_cc)^-T dz_c by backward substitution: row i is final once every later row
    // of the chunk has passed it its share g_i p_ij dz_i.
    for (int i = r1 - 1; i > r0; --i) {
      const T* pi = p + (int64_t)(i - r0) * ld;
      const T* dzi = dz + (int64_t)i * e;
      const T gi = g[i];
      for (int j = r0; j < i; ++j) axpy(dz + (int64_t)j * e, gi * pi[j], dzi, e);
    }
    // dz[0:r0] += p[:, :r0]^T (g dz_c): the chunk's share of the earlier rows' adjoints.
    for (int i = r0; i < r1; ++i) {
      const T gi = g[i];
      const T* src = dz + (int64_t)i * e;
      T* dst = gdz + (int64_t)(i - r0) * e;
#pragma omp simd
      for (int c = 0; c < e; ++c) dst[c] = gi * src[c];
    }
    gemm<T>(true, false, r0, e, rows, T(1), p, ld, gdz, e, T(1), dz, e);
    // dp (rows x r1) = dz_c y[0:r1]^T, then in place dS = scale g_i p_ij (dp_ij - delta_i).
    gemm<T>(false, true, rows, r1, e, T(1), dz + (int64_t)r0 * e, e, y, e, T(0), dp, ld);
    for (int i = r0; i < r1; ++i) {
      const T* pi = p + (int64_t)(i - r0) * ld;
      T* dpi = dp + (int64_t)(i - r0) * ld;
      const T delta = dot(pi, dpi, i);
      dg[i] = delta;
      const T w = scale * g[i];
#pragma omp simd
      for (int j = 0; j < i; ++j) dpi[j] = w * pi[j] * (dpi[j] - delta);
      fill_zero(dpi + i, r1 - i);
    }
    // dq_c = dS k[0:r1]; dk[0:r1] += dS^T q_c. The first chunk visited (the last) spans all keys, so its
    // beta = 0 initialises dk.
    gemm<T>(false, false, rows, d, r1, T(1), dp, ld, k, d, T(0), dq + (int64_t)r0 * d, d);
    gemm<T>(true, false, r1, d, rows, T(1), dp, ld, qc, d, r0 == last ? T(0) : T(1), dk, d);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dense_solve_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& g, const at::Tensor& y, const at::Tensor& lse,
    const at::Tensor& dy, double scale, int64_t chunk) {
  check_inputs(q, k, g, y, "y", chunk);
  TORCH_CHECK(dy.sizes() == y.sizes(), "dense_solve_backward: dy must have y's shape ", y.sizes(), ", got ",
              dy.sizes());
  TORCH_CHECK(lse.sizes() == g.sizes(), "dense_solve_backward: lse must be (B, H, n) = ", g.sizes(), ", got ",
              lse.sizes());
  for (const at::Tensor* t : {&lse, &dy}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "dense_solve_backward: all inputs must share q's dtype ",
                q.scalar_type(), ", got ", t->scalar_type());
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(),
                "dense_solve_backward: lse and dy must be contiguous CPU tensors");
  }
  const int64_t heads = q.size(0) * q.size(1);
  const int n = q.size(2), d = q.size(3), e = y.size(3);
  const int c = static_cast<int>(std::min<int64_t>(chunk, std::max(n, 1)));
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dz = at::empty_like(y), dg = at::empty_like(g);
  if (heads == 0 || n == 0) return {dq, dk, dz, dg};
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dense_solve_backward", [&] {
    const scalar_t *qp = q.const_data_ptr<scalar_t>(), *kp = k.const_data_ptr<scalar_t>();
    const scalar_t *gp = g.const_data_ptr<scalar_t>(), *yp = y.const_data_ptr<scalar_t>();
    const scalar_t *lp = lse.const_data_ptr<scalar_t>(), *dyp = dy.const_data_ptr<scalar_t>();
    scalar_t *dqp = dq.mutable_data_ptr<scalar_t>(), *dkp = dk.mutable_data_ptr<scalar_t>();
    scalar_t *dzp = dz.mutable_data_ptr<scalar_t>(), *dgp = dg.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
      std::vector<scalar_t> p((size_t)c * n), dp((size_t)c * n), gdz((size_t)c * e);
      for (int64_t h = h0; h < h1; ++h)
        backward_head<scalar_t>(qp + h * n * d, kp + h * n * d, gp + h * n, yp + h * n * e, lp + h * n,
                                dyp + h * n * e, dqp + h * n * d, dkp + h * n * d, dzp + h * n * e, dgp + h * n, n,
                                d, e, c, static_cast<scalar_t>(scale), p.data(), dp.data(), gdz.data());
    });
  });
  return {dq, dk, dz, dg};
}

// ------------------------------------------------------------------------------------------------
// Causal attention, the direct term Z of the dense and attention patterns: the same chunked gemms without the
// solve. o_i = softmax_{j <= i}(scale q_i . k_j) v. At n = 512 PyTorch's CPU flash kernel cannot skip the masked
// half (it walks keys in blocks of 512); whole chunks of rows against exactly the keys they see do.

// s (rows x r1, ld r1) = scale q_c k^T turned into row i's probabilities over keys j <= i (0 past them).
// The backward passes the forward's log-sum-exps (known_lse); the forward passes nullptr and gets them in new_lse.
template <typename T>
void causal_probs(const T* q, const T* k, int r0, int r1, int d, T scale, T* s, const T* known_lse, T* new_lse) {
  const int rows = r1 - r0, ld = r1;
  gemm<T>(false, true, rows, r1, d, scale, q + (int64_t)r0 * d, d, k, d, T(0), s, ld);
  for (int i = r0; i < r1; ++i) {
    T* si = s + (int64_t)(i - r0) * ld;
    const int keys = i + 1;
    if (known_lse != nullptr) {
      exp_shift(si, keys, known_lse[i]);
    } else {
      const T m = row_max(si, keys);
      const T sum = exp_shift(si, keys, m);
      new_lse[i] = m + std::log(sum);
      const T inv = T(1) / sum;
#pragma omp simd
      for (int j = 0; j < keys; ++j) si[j] *= inv;
    }
    fill_zero(si + keys, r1 - keys);
  }
}

// Row i of dS = scale p (dp - delta_i), in place over dp (len keys, zero up to ld).
template <typename T>
void attention_score_grad(const T* p, T* dp, int keys, int ld, T delta, T scale) {
#pragma omp simd
  for (int j = 0; j < keys; ++j) dp[j] = scale * p[j] * (dp[j] - delta);
  fill_zero(dp + keys, ld - keys);
}

std::tuple<at::Tensor, at::Tensor> causal_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                            const at::Tensor& v, double scale, int64_t chunk) {
  check_rows(q, k, v, "v", chunk, "causal_attention_forward");
  const int64_t heads = q.size(0) * q.size(1);
  const int n = q.size(2), d = q.size(3), e = v.size(3);
  const int c = static_cast<int>(std::min<int64_t>(chunk, std::max(n, 1)));
  at::Tensor o = at::empty_like(v);
  at::Tensor lse = at::empty(q.sizes().slice(0, 3), q.options());
  if (heads == 0 || n == 0) return {o, lse};
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_attention_forward", [&] {
    const scalar_t *qp = q.const_data_ptr<scalar_t>(), *kp = k.const_data_ptr<scalar_t>();
    const scalar_t* vp = v.const_data_ptr<scalar_t>();
    scalar_t *op = o.mutable_data_ptr<scalar_t>(), *lp = lse.mutable_data_ptr<scalar_t>();
    const scalar_t sc = static_cast<scalar_t>(scale);
    at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
      std::vector<scalar_t> s((size_t)c * n);
      for (int64_t h = h0; h < h1; ++h) {
        const scalar_t *qh = qp + h * n * d, *kh = kp + h * n * d, *vh = vp + h * n * e;
        for (int r0 = 0; r0 < n; r0 += c) {
          const int r1 = std::min(n, r0 + c);
          causal_probs<scalar_t>(qh, kh, r0, r1, d, sc, s.data(), nullptr, lp + h * n);
          gemm<scalar_t>(false, false, r1 - r0, e, r1, scalar_t(1), s.data(), r1, vh, e, scalar_t(0),
                         op + h * n * e + (int64_t)r0 * e, e);
        }
      }
    });
  });
  return {o, lse};
}

// Chunks are independent here (no solve): each adds its share to dk and dv; delta_i = do_i . o_i as in flash.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
    const at::Tensor& dout, double scale, int64_t chunk) {
  check_rows(q, k, v, "v", chunk, "causal_attention_backward");
  TORCH_CHECK(o.sizes() == v.sizes() && dout.sizes() == v.sizes() && lse.sizes() == q.sizes().slice(0, 3),
              "causal_attention_backward: o and dout must be (B, H, n, e) like v, lse (B, H, n)");
  for (const at::Tensor* t : {&o, &lse, &dout})
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->device().is_cpu() && t->is_contiguous(),
                "causal_attention_backward: o, lse and dout must be contiguous CPU tensors of q's dtype");
  const int64_t heads = q.size(0) * q.size(1);
  const int n = q.size(2), d = q.size(3), e = v.size(3);
  const int c = static_cast<int>(std::min<int64_t>(chunk, std::max(n, 1)));
  at::Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  if (heads == 0 || n == 0) return {dq, dk, dv};
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "causal_attention_backward", [&] {
    const scalar_t *qp = q.const_data_ptr<scalar_t>(), *kp = k.const_data_ptr<scalar_t>();
    const scalar_t *vp = v.const_data_ptr<scalar_t>(), *opp = o.const_data_ptr<scalar_t>();
    const scalar_t *lp = lse.const_data_ptr<scalar_t>(), *gp = dout.const_data_ptr<scalar_t>();
    scalar_t *dqp = dq.mutable_data_ptr<scalar_t>(), *dkp = dk.mutable_data_ptr<scalar_t>();
    scalar_t* dvp = dv.mutable_data_ptr<scalar_t>();
    const scalar_t sc = static_cast<scalar_t>(scale);
    at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
      std::vector<scalar_t> p((size_t)c * n), dp((size_t)c * n);
      for (int64_t h = h0; h < h1; ++h) {
        const scalar_t *qh = qp + h * n * d, *kh = kp + h * n * d, *vh = vp + h * n * e;
        const scalar_t *oh = opp + h * n * e, *gh = gp + h * n * e;
        scalar_t *dqh = dqp + h * n * d, *dkh = dkp + h * n * d, *dvh = dvp + h * n * e;
        fill_zero(dkh, n * d);
        fill_zero(dvh, n * e);
        for (int r0 = 0; r0 < n; r0 += c) {
          const int r1 = std::min(n, r0 + c), rows = r1 - r0, ld = r1;
          const scalar_t *qc = qh + (int64_t)r0 * d, *gc = gh + (int64_t)r0 * e;
          causal_probs<scalar_t>(qh, kh, r0, r1, d, sc, p.data(), lp + h * n, nullptr);
          // dv[0:r1] += p^T do_c; dp = do_c v[0:r1]^T
          gemm<scalar_t>(true, false, r1, e, rows, scalar_t(1), p.data(), ld, gc, e, scalar_t(1), dvh, e);
          gemm<scalar_t>(false, true, rows, r1, e, scalar_t(1), gc, e, vh, e, scalar_t(0), dp.data(), ld);
          for (int i = r0; i < r1; ++i)
            attention_score_grad(p.data() + (int64_t)(i - r0) * ld, dp.data() + (int64_t)(i - r0) * ld, i + 1, r1,
                                 dot(gh + (int64_t)i * e, oh + (int64_t)i * e, e), sc);
          // dq_c = dS k[0:r1]; dk[0:r1] += dS^T q_c
          gemm<scalar_t>(false, false, rows, d, r1, scalar_t(1), dp.data(), ld, kh, d, scalar_t(0),
                         dqh + (int64_t)r0 * d, d);
          gemm<scalar_t>(true, false, r1, d, rows, scalar_t(1), dp.data(), ld, qc, d, scalar_t(1), dkh, d);
        }
      }
    });
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_resolvent, m) {
  m.def("dense_solve_forward(Tensor q, Tensor k, Tensor g, Tensor z, float scale, int chunk) -> (Tensor y, Tensor lse)");
  m.def(
      "dense_solve_backward(Tensor q, Tensor k, Tensor g, Tensor y, Tensor lse, Tensor dy, float scale, int chunk)"
      " -> (Tensor dq, Tensor dk, Tensor dz, Tensor dg)");
  m.def("causal_attention_forward(Tensor q, Tensor k, Tensor v, float scale, int chunk) -> (Tensor o, Tensor lse)");
  m.def(
      "causal_attention_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor dout, float scale,"
      " int chunk) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(hf_resolvent, CPU, m) {
  m.impl("dense_solve_forward", &dense_solve_forward);
  m.impl("dense_solve_backward", &dense_solve_backward);
  m.impl("causal_attention_forward", &causal_attention_forward);
  m.impl("causal_attention_backward", &causal_attention_backward);
}

}  // namespace hf_resolvent
