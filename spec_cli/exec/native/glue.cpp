// The small operations between a bfloat16 layer's int4 products, each one call instead of torch's several (on a
// small model on a CPU, torch's dispatch of ~1,600 small operations a token costs about what its products do).
// Each row is computed alone by the same instructions whatever else shares the call: its bits never depend on
// the other rows (exact speculation). `rope` gives torch's own bits (elementwise, each operation rounded to
// bfloat16 as torch rounds it); `rms_norm` and `silu_mul` sum and exponentiate in their own order: close to
// torch's, not bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using bf16 = at::BFloat16;

inline __m512 load16(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline __m512 round16(__m512 f) {  // to the nearest bfloat16, kept as float
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline void store16(bf16* p, __m512 rounded, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}

inline __mmask16 lanes(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

// e^x for x in float, ~1 ulp: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-6 polynomial in r, scaled by 2^n
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

constexpr int64_t GRAIN = 16;  // rows a thread takes at least (a token's row is a few microseconds)

}  // namespace

// weight * (x * rsqrt(mean(x^2) + eps)), x [rows, width] bfloat16: as Llama's RMSNorm rounds (the normalized
// row to bfloat16, then its product with the weight)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16, "bfloat16 only");
  x = x.contiguous();
  const int64_t D = x.size(-1), M = x.numel() / D;
  TORCH_CHECK(weight.numel() == D && weight.is_contiguous(), "weight: [width]");
  auto y = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  at::parallel_for(0, M, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const bf16* row = xp + m * D;
      __m512 squares = _mm512_setzero_ps();
      for (int64_t j = 0; j < D; j += 16) {
        const __m512 v = load16(row + j, lanes(D - j));
        squares = _mm512_fmadd_ps(v, v, squares);
      }
      const float scale = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(D) +
                                          static_cast<float>(eps));
      const __m512 s = _mm512_set1_ps(scale);
      for (int64_t j = 0; j < D; j += 16) {
        const __mmask16 k = lanes(D - j);
        const __m512 normed = round16(_mm512_mul_ps(load16(row + j, k), s));
        store16(yp + m * D + j, round16(_mm512_mul_ps(load16(wp + j, k), normed)), k);
      }
    }
  });
  return y;
}

// silu(gate) * up of gate_up [rows, 2 * width] (gate first): each rounded to bfloat16 as torch rounds them
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "bfloat16 only");
  gate_up = gate_up.contiguous();
  const int64_t W = gate_up.size(-1) / 2, M = gate_up.numel() / (2 * W);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = W;
  auto y = torch::empty(sizes, gate_up.options());
  const bf16* gp = gate_up.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const __m512 one = _mm512_set1_ps(1.f);
  at::parallel_for(0, M, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const bf16* gate = gp + m * 2 * W;
      const bf16* up = gate + W;
      for (int64_t j = 0; j < W; j += 16) {
        const __mmask16 k = lanes(W - j);
        const __m512 g = load16(gate + j, k);
        const __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        store16(yp + m * W + j, round16(_mm512_mul_ps(silu, load16(up + j, k))), k);
      }
    }
  });
  return y;
}

// One product's q, k and v [rows, (heads + 2 kv_heads) * d] -> q [1, heads, rows, d], k and v [1, kv_heads, rows,
// d], q and k rotated: x * cos + rotate_half(x) * sin, cos and sin [rows, d], each product and the sum rounded to
// bfloat16 as torch's operations round them (the same bits)
std::vector<torch::Tensor> rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                                int64_t kv_heads) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kBFloat16 &&
              sin.scalar_type() == at::kBFloat16, "bfloat16 only");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  const int64_t d = cos.size(-1), rows = cos.numel() / d, width = qkv.size(-1), half = d / 2;
  TORCH_CHECK(width == (heads + 2 * kv_heads) * d && qkv.numel() == rows * width && d % 2 == 0, "shapes");
  auto q = torch::empty({1, heads, rows, d}, qkv.options());
  auto k = torch::empty({1, kv_heads, rows, d}, qkv.options());
  auto v = torch::empty({1, kv_heads, rows, d}, qkv.options());
  const bf16* src = qkv.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = sin.data_ptr<bf16>();
  bf16* qp = q.data_ptr<bf16>();
  bf16* kp = k.data_ptr<bf16>();
  bf16* vp = v.data_ptr<bf16>();
  const int64_t all = heads + 2 * kv_heads;
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* c = cp + r * d;
      const bf16* s = sp + r * d;
      for (int64_t h = 0; h < all; ++h) {
        const bf16* x = src + r * width + h * d;
        bf16* out = h < heads ? qp + (h * rows + r) * d
                  : h < heads + kv_heads ? kp + ((h - heads) * rows + r) * d
                  : vp + ((h - heads - kv_heads) * rows + r) * d;
        if (h >= heads + kv_heads) {
          std::memcpy(out, x, d * sizeof(bf16));
          continue;
        }
        for (int64_t j = 0; j < half; j += 16) {  // the first half: x * cos - x[j + half] * sin
          const __mmask16 m = lanes(half - j);
          const __m512 a = round16(_mm512_mul_ps(load16(x + j, m), load16(c + j, m)));
          const __m512 b = round16(_mm512_mul_ps(load16(x + half + j, m), load16(s + j, m)));
          store16(out + j, round16(_mm512_sub_ps(a, b)), m);
        }
        for (int64_t j = 0; j < half; j += 16) {  // the second: x * cos + x[j - half] * sin
          const __mmask16 m = lanes(half - j);
          const __m512 a = round16(_mm512_mul_ps(load16(x + half + j, m), load16(c + half + j, m)));
          const __m512 b = round16(_mm512_mul_ps(load16(x + j, m), load16(s + half + j, m)));
          store16(out + half + j, round16(_mm512_add_ps(a, b)), m);
        }
      }
    }
  });
  return {q, k, v};
}
