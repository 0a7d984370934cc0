// Decode step on CPU: the compiled twin of hf_resolvent/ops/recurrent.py (recurrent_step and
// recurrent_step_tied): one token per sequence mixed against the rows a layer's DecodeState holds.
// Which held rows the token reads is the state's read rule, evaluated by DecodeState.read_mask and
// passed in as `read`; the state advances in Python through the same DecodeState.advance. This file only
// does the arithmetic between the two.
//
// Why C++: the step is a few dot products per held row (12 rows per layer for exp2:ce after 2k tokens),
// but written with PyTorch ops it is ~40 small ops per layer, each costing more to dispatch than to compute.
//
// Shapes: B batch, H heads, S rows held, d key width, e value width. The token's tensors are (B, H, d) or
// (B, H, e), g and d (B, H); held rows (B, H, S, .) (strided: the growing state appends into a larger
// buffer); read (B, S) bool; r (B,) int64 positions, negative inside the left padding. A tensor of rows without a
// unit stride along its last dimension is copied first.
//
//   untied: y = (1 - g') softmax(qa . [ka_held, ka]) [values, x] + g' softmax(qb . kb_held) outputs_held
//   tied:   z = g' softmax(qb . kb_held) outputs_held + (1 - g') x,  y = z - d x
// with g' = g where the token reads any held row, else 0; y (and the tied z) are 0 where r < 0. The second
// result is the row the state stores as `outputs`: y before the padding mask (untied), z (tied).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "common_cpu.h"

namespace hf_resolvent {
namespace {

// A (B, H, ...) tensor seen as rows: base pointer and the strides of its batch, head and row dimensions.
template <typename T>
struct Rows {
  const T* p = nullptr;
  int64_t sb = 0, sh = 0, ss = 0;
  const T* at(int64_t b, int64_t h, int64_t s = 0) const { return p + b * sb + h * sh + s * ss; }
};

template <typename T>
Rows<T> rows(const std::optional<at::Tensor>& t, int64_t dims, const char* name) {
  Rows<T> v;
  if (!t.has_value() || !t->defined()) return v;
  TORCH_CHECK(t->dim() == dims && (dims == 2 || t->stride(-1) == 1), "decode_step: ", name, " must be a ", dims,
              "-d tensor", dims == 2 ? "" : " with a unit stride along its last dimension", ", got ", t->sizes(),
              " strides ", t->strides());
  TORCH_CHECK(t->scalar_type() == c10::CppTypeToScalarType<T>::value, "decode_step: ", name,
              " must have x's dtype ", c10::CppTypeToScalarType<T>::value, ", got ", t->scalar_type());
  v.p = t->data_ptr<T>();
  v.sb = t->stride(0);
  v.sh = t->stride(1);
  if (dims == 4) v.ss = t->stride(2);
  return v;
}

// softmax over the held rows that `rd` lets through (scores q . keys[s] * scale) and, when own_key is given, the
// token's own row; acc = the weighted sum of vals (and own_val). Returns false, with acc = 0, when no row at all
// was weighed (a NaN score is weighed and spreads, as in PyTorch).
template <typename T>
bool attend(const T* q, const Rows<T>& keys, const Rows<T>& vals, int64_t b, int64_t h, const bool* rd,
            int64_t rstride, int64_t S, int64_t dk, int64_t e, T scale, const T* own_key, const T* own_val,
            std::vector<T>& score, std::vector<T>& acc) {
  std::fill(acc.begin(), acc.end(), T(0));
  T m = -std::numeric_limits<T>::infinity();
  T own = 0;
  bool any = own_key != nullptr;
  if (own_key != nullptr) {
    own = dot(q, own_key, dk) * scale;
    m = own;
  }
  for (int64_t s = 0; s < S; ++s) {
    if (!rd[s * rstride]) continue;
    any = true;
    score[s] = dot(q, keys.at(b, h, s), dk) * scale;
    m = std::isnan(score[s]) ? score[s] : std::max(m, score[s]);
  }
  if (!any) return false;
  T total = 0;
  if (own_key != nullptr) {
    const T p = std::exp(own - m);
    total += p;
    axpy(acc.data(), p, own_val, e);
  }
  for (int64_t s = 0; s < S; ++s) {
    if (!rd[s * rstride]) continue;
    const T p = std::exp(score[s] - m);
    total += p;
    axpy(acc.data(), p, vals.at(b, h, s), e);
  }
  for (int64_t c = 0; c < e; ++c) acc[c] /= total;
  return true;
}

// t itself when its last dimension has a unit stride (the model's views do), else a contiguous copy
std::optional<at::Tensor> unit_stride(const std::optional<at::Tensor>& t) {
  if (!t.has_value() || !t->defined() || t->dim() < 3 || t->stride(-1) == 1) return t;
  return t->contiguous();
}

std::tuple<at::Tensor, at::Tensor> decode_step(
    const std::optional<at::Tensor>& qa_in, const std::optional<at::Tensor>& ka_in,
    const std::optional<at::Tensor>& qb_in, const std::optional<at::Tensor>& kb_in, const at::Tensor& x_in,
    const std::optional<at::Tensor>& g, const std::optional<at::Tensor>& d,
    const std::optional<at::Tensor>& keys_a_in, const std::optional<at::Tensor>& values_in,
    const std::optional<at::Tensor>& keys_b_in, const std::optional<at::Tensor>& outputs_in, const at::Tensor& read,
    const at::Tensor& r, double scale) {
  const auto qa = unit_stride(qa_in), ka = unit_stride(ka_in), qb = unit_stride(qb_in), kb = unit_stride(kb_in);
  const auto keys_a = unit_stride(keys_a_in), values = unit_stride(values_in), keys_b = unit_stride(keys_b_in),
             outputs = unit_stride(outputs_in);
  const at::Tensor x = x_in.dim() == 3 && x_in.stride(-1) != 1 ? x_in.contiguous() : x_in;
  TORCH_CHECK(x.dim() == 3, "decode_step: x must be (B, H, e), got ", x.sizes());
  const int64_t B = x.size(0), H = x.size(1), e = x.size(2);
  const bool has_a = qa.has_value() && qa->defined();
  const bool has_b = qb.has_value() && qb->defined();
  const bool tied = d.has_value() && d->defined();
  TORCH_CHECK(has_a || has_b, "decode_step: give qa and ka (direct channel) or qb and kb (recurrent channel)");
  TORCH_CHECK(!tied || (!has_a && has_b), "decode_step: the tied variant takes qb, kb and d, not qa");
  TORCH_CHECK(!has_b || (g.has_value() && g->defined()), "decode_step: the recurrent channel needs the gate g");
  TORCH_CHECK(read.dim() == 2 && read.size(0) == B && read.scalar_type() == at::kBool,
              "decode_step: read must be a (B, S) bool tensor with B = ", B, ", got ", read.sizes(), " ",
              read.scalar_type());
  TORCH_CHECK(r.dim() == 1 && r.size(0) == B && r.scalar_type() == at::kLong && r.is_contiguous(),
              "decode_step: r must be a contiguous (B,) int64 tensor");
  const int64_t S = read.size(1);
  const auto given = [](const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); };
  TORCH_CHECK(!has_a || given(ka), "decode_step: qa needs its key ka");
  TORCH_CHECK(!has_b || given(kb), "decode_step: qb needs its key kb");
  TORCH_CHECK(S == 0 || !has_a || (given(keys_a) && given(values)),
              "decode_step: the direct channel needs the held keys_a and values");
  TORCH_CHECK(S == 0 || !has_b || (given(keys_b) && given(outputs)),
              "decode_step: the recurrent channel needs the held keys_b and outputs");
  const int64_t da = has_a ? qa->size(-1) : 0, db = has_b ? qb->size(-1) : 0;
  // every tensor's shape: (B, H, width) for the token, (B, H) for g and d, (B, H, S, width) for held rows
  const auto check = [&](const std::optional<at::Tensor>& t, const char* name, int64_t rows, int64_t width) {
    if (!given(t)) return;
    std::vector<int64_t> want = {B, H};
    if (rows >= 0) want.push_back(rows);
    if (width >= 0) want.push_back(width);
    TORCH_CHECK(t->sizes().vec() == want, "decode_step: ", name, " must be ", c10::IntArrayRef(want), ", got ",
                t->sizes());
  };
  check(qa, "qa", -1, da);
  check(ka, "ka", -1, da);
  check(qb, "qb", -1, db);
  check(kb, "kb", -1, db);
  check(g, "g", -1, -1);
  check(d, "d", -1, -1);
  check(keys_a, "keys_a", S, da);
  check(values, "values", S, e);
  check(keys_b, "keys_b", S, db);
  check(outputs, "outputs", S, e);

  at::Tensor y = at::empty({B, H, e}, x.options());
  at::Tensor z = at::empty({B, H, e}, x.options());
  const bool* rd = read.data_ptr<bool>();
  const int64_t rs0 = read.stride(0), rs1 = read.stride(1);
  const int64_t* rp = r.data_ptr<int64_t>();

  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "decode_step", [&] {
    using T = scalar_t;
    const auto Qa = rows<T>(qa, 3, "qa"), Ka = rows<T>(ka, 3, "ka"), Qb = rows<T>(qb, 3, "qb"),
               Kb = rows<T>(kb, 3, "kb"), X = rows<T>(x, 3, "x");
    const auto KA = rows<T>(keys_a, 4, "keys_a"), V = rows<T>(values, 4, "values"),
               KB = rows<T>(keys_b, 4, "keys_b"), O = rows<T>(outputs, 4, "outputs");
    const auto G = rows<T>(g, 2, "g"), D = rows<T>(d, 2, "d");
    T* yp = y.data_ptr<T>();
    T* zp = z.data_ptr<T>();
    // one (batch, head) pair is S dot products: run pairs on the intra-op threads only when there is work to share
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, S * (da + db + 2 * e)));
    at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
      std::vector<T> score(S), direct(e), recur(e);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / H, h = i % H;
        const bool* rb = rd + b * rs0;
        const T* xv = X.at(b, h);
        if (has_a) attend<T>(Qa.at(b, h), KA, V, b, h, rb, rs1, S, da, e, scale, Ka.at(b, h), xv, score, direct);
        T geff = 0;  // g where the token reads a held row, else 0
        if (has_b && attend<T>(Qb.at(b, h), KB, O, b, h, rb, rs1, S, db, e, scale, nullptr, nullptr, score, recur))
          geff = *G.at(b, h);
        const bool valid = rp[b] >= 0;
        T* yo = yp + i * e;
        T* zo = zp + i * e;
        for (int64_t c = 0; c < e; ++c) {
          if (tied) {
            const T zc = geff * recur[c] + (1 - geff) * xv[c];
            zo[c] = valid ? zc : T(0);
            yo[c] = valid ? zc - *D.at(b, h) * xv[c] : T(0);
          } else {
            const T yc = has_b ? (1 - geff) * direct[c] + geff * recur[c] : direct[c];
            zo[c] = yc;
            yo[c] = valid ? yc : T(0);
          }
        }
      }
    });
  });
  return {y, z};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_resolvent, m) {
  m.def(
      "decode_step(Tensor? qa, Tensor? ka, Tensor? qb, Tensor? kb, Tensor x, Tensor? g, Tensor? d, Tensor? keys_a, "
      "Tensor? values, Tensor? keys_b, Tensor? outputs, Tensor read, Tensor r, float scale) -> (Tensor y, Tensor z)");
}

TORCH_LIBRARY_IMPL(hf_resolvent, CPU, m) { m.impl("decode_step", &decode_step); }

}  // namespace hf_resolvent
