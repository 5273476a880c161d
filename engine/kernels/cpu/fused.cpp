// Fused elementwise ops for the CPU path: one pass over each row instead of 4-8 PyTorch ops
// (each of which reads and writes the whole activation). Math in float32 with one rounding to
// the tensor's dtype at the end, in the same order as transformers' Llama code:
//   rms_norm: w * dtype(x * rsqrt(mean(x^2) + eps));   residual add in dtype first
//   rotary:   x * cos + rotate_half(x) * sin
//   silu_and_mul: silu(gate) * up
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < n; ++j) ss += f(x[j]) * f(x[j]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(f(w[j]) * f(static_cast<T>(f(x[j]) * r)));
}

template <typename T>
void add_norm_row(T* xr, T* rr, const T* w, int64_t n, float eps) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) rr[j] = static_cast<T>(f(xr[j]) + f(rr[j]));
  norm_row(rr, w, xr, n, eps);
}

template <typename T>
void rotate_row(T* x, const T* c, const T* s, int64_t half) {
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float x1 = f(x[j]), x2 = f(x[j + half]);
    x[j] = static_cast<T>(x1 * f(c[j]) - x2 * f(s[j]));
    x[j + half] = static_cast<T>(x2 * f(c[j + half]) + x1 * f(s[j + half]));
  }
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float a = f(g[j]);
    o[j] = static_cast<T>(a / (1.f + std::exp(-a)) * f(u[j]));
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rows must be contiguous");
  TORCH_CHECK(w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(1), "weight must match the row size");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and weight dtypes differ");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) norm_row(xp + i * xs, wp, op + i * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && x.is_contiguous(), "x/residual shapes");
  const int64_t rows = x.size(0), n = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) add_norm_row(xp + i * n, rp + i * n, wp, n, static_cast<float>(eps));
    });
  });
}

// q [T, Hq*D] and k [T, Hk*D] (rows may be strided views of a fused qkv output);
// cos/sin [max_pos, D] tables; positions [T] int64.
void rotary_inplace(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t head_dim) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 2 && q.stride(1) == 1 && k.stride(1) == 1, "q/k rows must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim, "cos/sin tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(q.scalar_type() == cos.scalar_type() && k.scalar_type() == cos.scalar_type(), "dtypes differ");
  const int64_t t = q.size(0), hq = q.size(1) / head_dim, hk = k.size(1) / head_dim, half = head_dim / 2;
  const int64_t qs = q.stride(0), ks = k.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_inplace", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const scalar_t* c = cp + pos[i] * head_dim;
        const scalar_t* s = sp + pos[i] * head_dim;
        for (int64_t h = 0; h < hq; ++h) rotate_row(qp + i * qs + h * head_dim, c, s, half);
        for (int64_t h = 0; h < hk; ++h) rotate_row(kp + i * ks + h * head_dim, c, s, half);
      }
    });
  });
}

torch::Tensor silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [T, 2n] with contiguous rows");
  const int64_t t = x.size(0), n = x.size(1) / 2, xs = x.stride(0);
  auto out = torch::empty({t, n}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, t, 8, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) silu_mul_row(xp + i * xs, xp + i * xs + n, op + i * n, n);
    });
  });
  return out;
}
