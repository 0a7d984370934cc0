// Slot kernels of the sparse patterns on CPU: the compiled twins of hf_resolvent/ops/slots.py (scores and
// weighted sums over each row's slots) and hf_resolvent/ops/sparse_solve.py (the forward substitution Y = Z + B Y
// and its transpose). The maths and the PyTorch versions live there; this file only makes them fast.
//
// Why C++: a sparse mixer is O(n K d) arithmetic, tiny next to a matmul, but written with PyTorch ops it
// is thousands of small strided ops per layer, each costing more to dispatch than to compute. Here every
// (batch, head) row runs one plain loop over positions and slots, and the rows run on the intra-op threads.
//
// Shapes (all contiguous): q, k, u, v, z, y (B, H, n, D); w, scores (B, H, K, n), slot-major as in slots.py;
// src (K, n) int64, src[s][t] = the 0-indexed source row of slot s at row t, or -1 where the slot is empty.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "common_cpu.h"

namespace hf_resolvent {
namespace {

// src (K, n) must index rows before `bound` (before t itself for the solves, whose sources must be solved already).
void check_layout(const at::Tensor& src, int64_t n, int64_t bound, bool strictly_causal, const char* op) {
  TORCH_CHECK(src.dim() == 2 && src.size(1) == n && src.scalar_type() == at::kLong && src.is_contiguous(), op,
              ": src must be a contiguous (K, n) int64 tensor with n = ", n, ", got ", src.sizes(), " ",
              src.scalar_type());
  const int64_t* s = src.data_ptr<int64_t>();
  for (int64_t slot = 0; slot < src.size(0); ++slot) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t j = s[slot * n + t];
      TORCH_CHECK(j < (strictly_causal ? t : bound), op, ": slot ", slot, " of row ", t, " reads row ", j,
                  strictly_causal ? ", not an earlier row" : ", past the sequence");
    }
  }
}

// t must be a contiguous (B, H, n, D) tensor; returns its number of (batch x head) rows.
int64_t rows_of(const at::Tensor& t, const char* name, const char* op) {
  TORCH_CHECK(t.dim() == 4 && t.is_contiguous(), op, ": ", name, " must be a contiguous (B, H, n, D) tensor, got ",
              t.sizes());
  return t.size(0) * t.size(1);
}

void check_weights(const at::Tensor& w, const at::Tensor& src, const at::Tensor& like, const char* op) {
  TORCH_CHECK(w.dim() == 4 && w.size(0) == like.size(0) && w.size(1) == like.size(1) && w.size(2) == src.size(0) &&
                  w.size(3) == src.size(1) && w.is_contiguous(),
              op, ": weights must be a contiguous (B, H, K, n) tensor matching the layout, got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == like.scalar_type(), op, ": weights and rows need the same dtype");
}

// scores[s, t] = q_t . k_{src_s(t)}; 0 where the slot is empty.
at::Tensor slot_dot(const at::Tensor& q, const at::Tensor& k, const at::Tensor& src) {
  const int64_t bh = rows_of(q, "q", "slot_dot");
  const int64_t n = q.size(2), d = q.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && k.scalar_type() == q.scalar_type(), "slot_dot: k must match q");
  rows_of(k, "k", "slot_dot");
  check_layout(src, n, n, false, "slot_dot");
  const int64_t slots = src.size(0);
  at::Tensor out = at::empty({q.size(0), q.size(1), slots, n}, q.options());
  const int64_t* s = src.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "slot_dot", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* qr = qp + r * n * d;
        const scalar_t* kr = kp + r * n * d;
        scalar_t* o = op + r * slots * n;
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t slot = 0; slot < slots; ++slot) {
            const int64_t j = s[slot * n + t];
            o[slot * n + t] = j >= 0 ? dot(qr + t * d, kr + j * d, d) : scalar_t(0);
          }
        }
      }
    });
  });
  return out;
}

// row[s] = e^(row[s] - top), in one vector loop for float32.
template <typename T>
void exp_row(T* __restrict row, T top, int64_t len) {
#pragma omp simd
  for (int64_t i = 0; i < len; ++i) row[i] = exp_of(row[i] - top);
}

// probs[s, t] = softmax over the row's non-empty slots of scale * q_t . k_{src_s(t)}; 0 on empty slots (and on
// rows without any). One pass per row instead of scores, mask, softmax and mask as separate tensors. k may hold
// more rows than q (rows that are read but ask nothing: the held rows of hf_resolvent/ops/extend.py).
at::Tensor slot_probs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& src, double scale) {
  const int64_t bh = rows_of(q, "q", "slot_probs");
  const int64_t n = q.size(2), d = q.size(3), nk = k.size(2);
  rows_of(k, "k", "slot_probs");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && k.size(3) == d && k.scalar_type() == q.scalar_type(),
              "slot_probs: k must match q but for its rows, got ", k.sizes(), " and ", q.sizes());
  check_layout(src, n, nk, false, "slot_probs");
  const int64_t slots = src.size(0);
  at::Tensor out = at::empty({q.size(0), q.size(1), slots, n}, q.options());
  const int64_t* s = src.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "slot_probs", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const scalar_t sc = static_cast<scalar_t>(scale);
    at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
      // A row's scores live in `row` until written: the output's slot stride is n elements, and with many
      // slots several passes over those strided entries thrash the cache (figures: bench/NOTES.md).
      std::vector<scalar_t> row(slots);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* qr = qp + r * n * d;
        const scalar_t* kr = kp + r * nk * d;
        scalar_t* o = op + r * slots * n;
        for (int64_t t = 0; t < n; ++t) {
          scalar_t top = -std::numeric_limits<scalar_t>::infinity();
          for (int64_t slot = 0; slot < slots; ++slot) {
            const int64_t j = s[slot * n + t];
            row[slot] = j >= 0 ? sc * dot(qr + t * d, kr + j * d, d) : -std::numeric_limits<scalar_t>::infinity();
            top = std::max(top, row[slot]);
          }
          if (top == -std::numeric_limits<scalar_t>::infinity()) {  // no slot: a row of zeros
            for (int64_t slot = 0; slot < slots; ++slot) o[slot * n + t] = scalar_t(0);
            continue;
          }
          exp_row(row.data(), top, slots);  // empty slots hold -inf: their e^(s - top) is 0
          scalar_t total = 0;
          for (int64_t slot = 0; slot < slots; ++slot) total += row[slot];
          const scalar_t inv = scalar_t(1) / total;
          for (int64_t slot = 0; slot < slots; ++slot) o[slot * n + t] = row[slot] * inv;
        }
      }
    });
  });
  return out;
}

// (dq, dk) of slot_probs given dprobs: ds = p (dp - sum_s p dp) scale, dq_t = sum_s ds k_src, dk_src += ds q_t.
std::tuple<at::Tensor, at::Tensor> slot_probs_backward(const at::Tensor& dprobs, const at::Tensor& probs,
                                                       const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& src, double scale) {
  const int64_t bh = rows_of(q, "q", "slot_probs_backward");
  const int64_t n = q.size(2), d = q.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && k.scalar_type() == q.scalar_type(), "slot_probs_backward: k must match q");
  rows_of(k, "k", "slot_probs_backward");
  check_layout(src, n, n, false, "slot_probs_backward");
  const int64_t slots = src.size(0);
  check_weights(probs, src, q, "slot_probs_backward");
  check_weights(dprobs, src, q, "slot_probs_backward");
  at::Tensor dq = at::zeros(q.sizes(), q.options()), dk = at::zeros(k.sizes(), k.options());
  const int64_t* s = src.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "slot_probs_backward", [&] {
    const scalar_t* gp = dprobs.data_ptr<scalar_t>();
    const scalar_t* pp = probs.data_ptr<scalar_t>();
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k.data_ptr<scalar_t>();
    scalar_t* dqp = dq.data_ptr<scalar_t>();
    scalar_t* dkp = dk.data_ptr<scalar_t>();
    const scalar_t sc = static_cast<scalar_t>(scale);
    at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> p_row(slots), g_row(slots);  // strided entries read once (see slot_probs)
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gr = gp + r * slots * n;
        const scalar_t* pr = pp + r * slots * n;
        const scalar_t* qr = qp + r * n * d;
        const scalar_t* kr = kp + r * n * d;
        scalar_t* dqr = dqp + r * n * d;
        scalar_t* dkr = dkp + r * n * d;
        for (int64_t t = 0; t < n; ++t) {
          scalar_t mean = 0;  // sum_s p dp: the row's expected dp
          for (int64_t slot = 0; slot < slots; ++slot) {
            p_row[slot] = pr[slot * n + t];
            g_row[slot] = gr[slot * n + t];
            mean += p_row[slot] * g_row[slot];
          }
          for (int64_t slot = 0; slot < slots; ++slot) {
            const int64_t j = s[slot * n + t];
            if (j < 0) continue;
            const scalar_t ds = p_row[slot] * (g_row[slot] - mean) * sc;
            axpy(dqr + t * d, ds, kr + j * d, d);
            axpy(dkr + j * d, ds, qr + t * d, d);
          }
        }
      }
    });
  });
  return {dq, dk};
}

// The four weighted sums below, in one loop: for each position t < n (ascending, or descending with `reverse`) and
// each non-empty slot s of it, with source j: out_t += w[s, t] in_j (gather), or out_j += w[s, t] in_t
// (scatter, the transpose). The caller initialises out. For the solves `in` is `out`: sources precede their rows,
// so ascending gathers read rows already solved, and descending scatters push a row only once it is complete.
void weighted_sums(const at::Tensor& w, const at::Tensor& in, at::Tensor& out, const at::Tensor& src, bool scatter,
                   bool reverse) {
  const int64_t n = src.size(1), n_in = in.size(2), n_out = out.size(2), e = out.size(3), slots = src.size(0),
                bh = out.size(0) * out.size(1);
  const int64_t* s = src.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "weighted_sums", [&] {
    const scalar_t* wp = w.data_ptr<scalar_t>();
    const scalar_t* ip = in.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* wr = wp + r * slots * n;
        const scalar_t* ir = ip + r * n_in * e;
        scalar_t* o = op + r * n_out * e;
        for (int64_t step = 0; step < n; ++step) {
          const int64_t t = reverse ? n - 1 - step : step;
          for (int64_t slot = 0; slot < slots; ++slot) {
            const int64_t j = s[slot * n + t];
            if (j < 0) continue;
            if (scatter)
              axpy(o + j * e, wr[slot * n + t], ir + t * e, e);
            else
              axpy(o + t * e, wr[slot * n + t], ir + j * e, e);
          }
        }
      }
    });
  });
}

// out_t = sum_s w[s, t] v_{src_s(t)}, for the n = src.size(1) rows of the layout; v may hold more rows (see
// slot_probs).
at::Tensor slot_combine(const at::Tensor& w, const at::Tensor& v, const at::Tensor& src) {
  rows_of(v, "v", "slot_combine");
  TORCH_CHECK(src.dim() == 2, "slot_combine: src must be (K, n), got ", src.sizes());
  check_layout(src, src.size(1), v.size(2), false, "slot_combine");
  check_weights(w, src, v, "slot_combine");
  at::Tensor out = at::zeros({v.size(0), v.size(1), src.size(1), v.size(3)}, v.options());
  weighted_sums(w, v, out, src, false, false);
  return out;
}

// The transpose of slot_combine: out_j = sum over (s, t) with src_s(t) = j of w[s, t] u_t.
at::Tensor slot_scatter(const at::Tensor& w, const at::Tensor& u, const at::Tensor& src) {
  rows_of(u, "u", "slot_scatter");
  check_layout(src, u.size(2), u.size(2), false, "slot_scatter");
  check_weights(w, src, u, "slot_scatter");
  at::Tensor out = at::zeros(u.sizes(), u.options());
  weighted_sums(w, u, out, src, true, false);
  return out;
}

// y = (I - B)^-1 z with B[t, src_s(t)] = w[s, t]: rows in order, each reading only rows already solved.
at::Tensor slot_solve(const at::Tensor& w, const at::Tensor& z, const at::Tensor& src) {
  rows_of(z, "z", "slot_solve");
  check_layout(src, z.size(2), z.size(2), true, "slot_solve");
  check_weights(w, src, z, "slot_solve");
  at::Tensor y = z.clone();
  weighted_sums(w, y, y, src, false, false);
  return y;
}

// dz = (I - B)^-T dy: rows from the last, each pushing its share back to its sources once complete.
at::Tensor slot_solve_transpose(const at::Tensor& w, const at::Tensor& dy, const at::Tensor& src) {
  rows_of(dy, "dy", "slot_solve_transpose");
  check_layout(src, dy.size(2), dy.size(2), true, "slot_solve_transpose");
  check_weights(w, src, dy, "slot_solve_transpose");
  at::Tensor dz = dy.clone();
  weighted_sums(w, dz, dz, src, true, true);
  return dz;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_resolvent, m) {
  m.def("slot_dot(Tensor q, Tensor k, Tensor src) -> Tensor");
  m.def("slot_probs(Tensor q, Tensor k, Tensor src, float scale) -> Tensor");
  m.def("slot_probs_backward(Tensor dprobs, Tensor probs, Tensor q, Tensor k, Tensor src, float scale) -> (Tensor, Tensor)");
  m.def("slot_combine(Tensor w, Tensor v, Tensor src) -> Tensor");
  m.def("slot_scatter(Tensor w, Tensor u, Tensor src) -> Tensor");
  m.def("slot_solve(Tensor w, Tensor z, Tensor src) -> Tensor");
  m.def("slot_solve_transpose(Tensor w, Tensor dy, Tensor src) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_resolvent, CPU, m) {
  m.impl("slot_dot", &slot_dot);
  m.impl("slot_probs", &slot_probs);
  m.impl("slot_probs_backward", &slot_probs_backward);
  m.impl("slot_combine", &slot_combine);
  m.impl("slot_scatter", &slot_scatter);
  m.impl("slot_solve", &slot_solve);
  m.impl("slot_solve_transpose", &slot_solve_transpose);
}

}  // namespace hf_resolvent
