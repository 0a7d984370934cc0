// RoPE on CPU: the compiled twin of hf_resolvent/ops/rope.py (rotated_heads' PyTorch code). It rotates a run of
// projected query/key parts and lays them out heads-major in one pass over the run.
//
// Why C++: in PyTorch the rotation is three passes over the run (roll, mul, addcmul) and the mixer kernels then
// copy each part from the projection's (B, n, parts, H, hd) layout into their (B, H, n, hd) one, a fourth and
// fifth pass over tensors of n x width floats per layer.
//
// Shapes: src (B, n, P, H, hd), float32, unit stride along hd; cos and sin (B, n, hd), with the sign of the
// rotate-half already in sin (its first half negated, as rope.py's signed table). out (P, B, H, n, hd):
//   out[p, b, h, i, j] = src[b, i, p, h, j] cos[b, i, j] + src[b, i, p, h, (j + hd/2) % hd] sin[b, i, j]
// The backward is the transposed map, written back into the projection's layout:
//   grad_src[b, i, p, h, j] = grad[p, b, h, i, j] cos[b, i, j] + grad[p, b, h, i, j'] sin[b, i, j'],
//   j' = (j + hd/2) % hd

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

namespace hf_resolvent {
namespace {

// Both directions: an even head width, and cos and sin tables of (B, n, hd).
void check_rotation(const char* op, const at::Tensor& cos, const at::Tensor& sin, int64_t B, int64_t n, int64_t hd) {
  TORCH_CHECK(hd % 2 == 0, op, ": the head width must be even, got ", hd);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == B && t->size(1) == n && t->size(2) == hd && t->stride(2) == 1 &&
                    t->scalar_type() == at::kFloat,
                "rope: cos and sin must be float32 (B, n, hd) = (", B, ", ", n, ", ", hd,
                ") with a unit last stride, got ", t->sizes(), " ", t->scalar_type());
  }
}

// One (b, i) row of the tables, as pointers.
struct Tables {
  const float *cos, *sin;
  int64_t cb, cn, sb, sn;
  const float* c(int64_t b, int64_t i) const { return cos + b * cb + i * cn; }
  const float* s(int64_t b, int64_t i) const { return sin + b * sb + i * sn; }
};

Tables tables(const at::Tensor& cos, const at::Tensor& sin) {
  return {cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1)};
}

// Calls f(bi, p, h, cos row, sin row) for every position bi = b * n + i (in parallel over positions) and every part
// p and head h. Positions outermost: each position's parts (contiguous in a projection) and table rows are read once.
template <typename F>
void for_each_part(int64_t B, int64_t n, int64_t P, int64_t H, const Tables& tab, const F& f) {
  at::parallel_for(0, B * n, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t bi = lo; bi < hi; ++bi) {
      const float *c = tab.c(bi / n, bi % n), *sg = tab.s(bi / n, bi % n);
      for (int64_t p = 0; p < P; ++p) {
        for (int64_t h = 0; h < H; ++h) f(bi, p, h, c, sg);
      }
    }
  });
}

at::Tensor rope_heads(const at::Tensor& src, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(src.dim() == 5 && src.scalar_type() == at::kFloat && src.stride(4) == 1,
              "rope_heads: src must be a float32 (B, n, P, H, hd) tensor with a unit last stride, got ", src.sizes(),
              " ", src.scalar_type());
  const int64_t B = src.size(0), n = src.size(1), P = src.size(2), H = src.size(3), hd = src.size(4), half = hd / 2;
  check_rotation("rope_heads", cos, sin, B, n, hd);
  at::Tensor out = at::empty({P, B, H, n, hd}, src.options());
  const float* s = src.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const Tables tab = tables(cos, sin);
  const int64_t sb = src.stride(0), sn = src.stride(1), sp = src.stride(2), sh = src.stride(3);
  for_each_part(B, n, P, H, tab, [&](int64_t bi, int64_t p, int64_t h, const float* c, const float* sg) {
    const int64_t b = bi / n, i = bi % n;
    const float* t = s + b * sb + i * sn + p * sp + h * sh;
    float* y = o + (((p * B + b) * H + h) * n + i) * hd;
    for (int64_t j = 0; j < half; ++j) y[j] = t[j] * c[j] + t[j + half] * sg[j];
    for (int64_t j = half; j < hd; ++j) y[j] = t[j] * c[j] + t[j - half] * sg[j];
  });
  return out;
}

at::Tensor rope_heads_backward(const at::Tensor& grad_in, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(grad_in.dim() == 5 && grad_in.scalar_type() == at::kFloat,
              "rope_heads_backward: grad must be a float32 (P, B, H, n, hd) tensor, got ", grad_in.sizes());
  const at::Tensor grad = grad_in.contiguous();
  const int64_t P = grad.size(0), B = grad.size(1), H = grad.size(2), n = grad.size(3), hd = grad.size(4),
                half = hd / 2;
  check_rotation("rope_heads_backward", cos, sin, B, n, hd);
  at::Tensor out = at::empty({B, n, P, H, hd}, grad.options());
  const float* g = grad.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const Tables tab = tables(cos, sin);
  for_each_part(B, n, P, H, tab, [&](int64_t bi, int64_t p, int64_t h, const float* c, const float* sg) {
    const int64_t b = bi / n, i = bi % n;
    const float* gy = g + (((p * B + b) * H + h) * n + i) * hd;
    float* x = o + ((bi * P + p) * H + h) * hd;
    for (int64_t j = 0; j < half; ++j) x[j] = gy[j] * c[j] + gy[j + half] * sg[j + half];
    for (int64_t j = half; j < hd; ++j) x[j] = gy[j] * c[j] + gy[j - half] * sg[j - half];
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hf_resolvent, m) {
  m.def("rope_heads(Tensor src, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_heads_backward(Tensor grad, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(hf_resolvent, CPU, m) {
  m.impl("rope_heads", &rope_heads);
  m.impl("rope_heads_backward", &rope_heads_backward);
}

}  // namespace hf_resolvent
