// The small operations between a bfloat16 layer's int4 products, each one call instead of torch's several (on a
// small model on a CPU, torch's dispatch of ~1,600 small operations a token costs about what its products do).
// Each row is computed alone by the same instructions whatever else shares the call: its bits never depend on
// the other rows (exact speculation). `rope` gives torch's own bits (elementwise, each operation rounded to
// bfloat16 as torch rounds it); `rms_norm` and `silu_mul` sum and exponentiate in their own order: close to
// torch's, not bit for bit.
#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using namespace simd;

constexpr int64_t GRAIN = 16;  // rows a thread takes at least (a token's row is a few microseconds)

}  // namespace

// weight * (x * rsqrt(mean(x^2) + eps)) of one row of D values, rounded as Llama's RMSNorm rounds (the normalized
// row to bfloat16, then its product with the weight)
inline void norm_row(const bf16* row, const bf16* wp, bf16* out, int64_t D, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t j = 0; j < D; j += 16) {
    const __m512 v = load16(row + j, lanes(D - j));
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float scale = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(D) + eps);
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < D; j += 16) {
    const __mmask16 k = lanes(D - j);
    const __m512 normed = round16(_mm512_mul_ps(load16(row + j, k), s));
    store16(out + j, round16(_mm512_mul_ps(load16(wp + j, k), normed)), k);
  }
}

// x [rows, width] bfloat16, each row normed by norm_row
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
    for (int64_t m = begin; m < end; ++m) norm_row(xp + m * D, wp, yp + m * D, D, static_cast<float>(eps));
  });
  return y;
}

// One product's q, k and v [rows, (heads + 2 kv_heads) * d] with each q head normed by q_weight [d] and each k
// head by k_weight, as rms_norm norms a row (Qwen3's q_norm and k_norm); v as it was
torch::Tensor head_norms(torch::Tensor qkv, torch::Tensor q_weight, torch::Tensor k_weight, int64_t heads,
                         int64_t kv_heads, double eps) {
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && q_weight.scalar_type() == at::kBFloat16 &&
              k_weight.scalar_type() == at::kBFloat16 && q_weight.is_contiguous() && k_weight.is_contiguous(),
              "bfloat16 only");
  qkv = qkv.contiguous();
  const int64_t d = q_weight.numel(), width = qkv.size(-1), rows = qkv.numel() / width;
  TORCH_CHECK(k_weight.numel() == d && width == (heads + 2 * kv_heads) * d, "shapes");
  auto y = qkv.clone();
  const bf16* src = qkv.data_ptr<bf16>();
  bf16* dst = y.data_ptr<bf16>();
  const bf16* qw = q_weight.data_ptr<bf16>();
  const bf16* kw = k_weight.data_ptr<bf16>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < heads + kv_heads; ++h)
        norm_row(src + r * width + h * d, h < heads ? qw : kw, dst + r * width + h * d, d, static_cast<float>(eps));
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

// Each of 16 vectors summed across its lanes, lane j of the result vector j's sum: folded in halves four times,
// so every vector's lanes are added by the same tree (l + l+8, then + 4, + 2, + 1) wherever it sits among the 16
inline __m512 fold16(const __m512 (&v)[16]) {
  static const __m512i lo1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  static const __m512i hi1 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  static const __m512i lo2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  static const __m512i hi2 = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  static const __m512i lo3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  static const __m512i hi3 = _mm512_setr_epi32(2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  static const __m512i lo4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  static const __m512i hi4 = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __m512 a[8], b[4], c[2];
  for (int k = 0; k < 8; ++k)  // vectors 2k, 2k+1 -> 8 partial sums each
    a[k] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * k], lo1, v[2 * k + 1]),
                         _mm512_permutex2var_ps(v[2 * k], hi1, v[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // -> 4 each, for vectors 4k..4k+3
    b[k] = _mm512_add_ps(_mm512_permutex2var_ps(a[2 * k], lo2, a[2 * k + 1]),
                         _mm512_permutex2var_ps(a[2 * k], hi2, a[2 * k + 1]));
  for (int k = 0; k < 2; ++k)  // -> 2 each, for vectors 8k..8k+7
    c[k] = _mm512_add_ps(_mm512_permutex2var_ps(b[2 * k], lo3, b[2 * k + 1]),
                         _mm512_permutex2var_ps(b[2 * k], hi3, b[2 * k + 1]));
  return _mm512_add_ps(_mm512_permutex2var_ps(c[0], lo4, c[1]), _mm512_permutex2var_ps(c[0], hi4, c[1]));
}

// One query row of G heads that share keys and values (grouped queries) over their attended keys (`attended`,
// n of them, in slot order): scores, softmax and the values' weighted sum, with C chunks of 16 of the head
// dimension held in registers, each key and value read once for the G heads. A head's arithmetic is the same
// whatever G is and wherever a key falls among blocks of 16 (`fold16`): its bits depend on its query and its
// attended keys alone.
template <typename T, int C, int G>
inline void attend_heads(const T* q, int64_t q_head, const T* kbase, int64_t k_slot, const T* vbase,
                         int64_t v_slot, const int32_t* attended, int64_t n, int64_t d, float scale, float* scores,
                         int64_t s_head, T* out, int64_t out_head) {
  __mmask16 part[C];
  __m512 query[G][C];
  for (int c = 0; c < C; ++c) part[c] = c * 16 < d ? lanes(d - c * 16) : 0;
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) query[g][c] = load16(q + g * q_head + c * 16, part[c]);
  __m512 best[G];
  for (int g = 0; g < G; ++g) best[g] = _mm512_set1_ps(-INFINITY);
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    __m512 dots[G][16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= m) {
        for (int g = 0; g < G; ++g) dots[g][j] = _mm512_setzero_ps();
        continue;
      }
      const T* key = kbase + attended[i0 + j] * k_slot;
      __m512 k[C];
      for (int c = 0; c < C; ++c) k[c] = load16(key + c * 16, part[c]);
      for (int g = 0; g < G; ++g) {
        __m512 dot = _mm512_mul_ps(query[g][0], k[0]);
        for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(query[g][c], k[c], dot);
        dots[g][j] = dot;
      }
    }
    const __mmask16 valid = lanes(m);
    for (int g = 0; g < G; ++g) {
      const __m512 s = _mm512_mul_ps(fold16(dots[g]), scaled);
      _mm512_mask_storeu_ps(scores + g * s_head + i0, valid, s);
      best[g] = _mm512_mask_max_ps(best[g], valid, best[g], s);
    }
  }
  __m512 inverse[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * s_head;
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best[g]));
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 k = lanes(n - i);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sg + i), top));
      _mm512_mask_storeu_ps(sg + i, k, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(k, e));
    }
    inverse[g] = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  }
  __m512 sum[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sum[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* value = vbase + attended[i] * v_slot;
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(value + c * 16, part[c]);
    for (int g = 0; g < G; ++g) {
      const __m512 weight = _mm512_set1_ps(scores[g * s_head + i]);
      for (int c = 0; c < C; ++c) sum[g][c] = _mm512_fmadd_ps(weight, v[c], sum[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      put16(out + g * out_head + c * 16, _mm512_mul_ps(sum[g][c], inverse[g]), part[c]);
}

template <typename T>
using Heads = void (*)(const T*, int64_t, const T*, int64_t, const T*, int64_t, const int32_t*, int64_t,
                       int64_t, float, float*, int64_t, T*, int64_t);

// the kernel for C chunks and g heads, g up to MOST (what the registers hold: G x C sums besides C values)
template <typename T, int C, int MOST>
Heads<T> heads_kernel(int64_t g) {
  if constexpr (MOST >= 4) if (g >= 4) return attend_heads<T, C, 4>;
  if constexpr (MOST >= 3) if (g == 3) return attend_heads<T, C, 3>;
  if constexpr (MOST >= 2) if (g == 2) return attend_heads<T, C, 2>;
  return attend_heads<T, C, 1>;
}

// Attention of q [1, heads, rows, d] over keys and values [1, kv_heads, span, d] (views of the cache: any head
// and slot strides, d contiguous) under an additive mask [rows, span] of 0 (attended) and -inf (None: all),
// -> [1, rows, heads * d], as the output projection takes it; bfloat16 or float, all in one (the mask too). A
// row's attended keys are gathered in slot order before anything is summed, so its bits depend only on its query
// and those keys, in that order: not on where they lie, nor on the keys it does not attend to (a tree's cousins
// between its ancestors), nor on other rows, nor on how many slots the forward attends.
template <typename T>
void attend_rows(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values, const T* maskp,
                 double scale, torch::Tensor& out) {
  const int64_t heads = q.size(1), rows = q.size(2), d = q.size(3);
  const int64_t kv_heads = keys.size(1), span = keys.size(2), group = heads / kv_heads;
  const T* qp = q.data_ptr<T>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t k_head = keys.stride(1), k_slot = keys.stride(2), v_head = values.stride(1),
                v_slot = values.stride(2);
  const float s = static_cast<float>(scale);
  const int64_t work = kv_heads * rows;
  const int64_t grain = attend_spreads(rows, span, heads, d) ? 1 : work;
  const int64_t chunks = (d + 15) / 16;
  const int64_t C = chunks == 4 ? 4 : chunks == 8 ? 8 : chunks <= 2 ? 2 : chunks <= 6 ? 6 : 16;  // (past d: masked)
  const int64_t most = C <= 4 ? 4 : C <= 8 ? 2 : 1;  // heads a call takes at once
  auto kernel = [&](int64_t g) -> Heads<T> {
    switch (C) {
      case 2: return heads_kernel<T, 2, 4>(g);
      case 4: return heads_kernel<T, 4, 4>(g);
      case 6: return heads_kernel<T, 6, 2>(g);
      case 8: return heads_kernel<T, 8, 2>(g);
      default: return heads_kernel<T, 16, 1>(g);
    }
  };
  at::parallel_for(0, work, grain, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> attended(span);
    std::vector<float> scores(most * (span + 16));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv = item / rows, r = item % rows;
      int64_t n = 0;
      for (int64_t j = 0; j < span; ++j) {
        if (maskp == nullptr || std::isfinite(static_cast<float>(maskp[r * span + j]))) attended[n++] = j;
      }
      for (int64_t g0 = 0; g0 < group; g0 += most) {
        const int64_t h = kv * group + g0, count = std::min(most, group - g0);
        T* o = op + r * heads * d + h * d;
        if (n == 0) {  // (a row that attends to nothing: zeros)
          std::memset(o, 0, count * d * sizeof(T));
          continue;
        }
        kernel(count)(qp + (h * rows + r) * d, rows * d, kp + kv * k_head, k_slot, vp + kv * v_head, v_slot,
                      attended.data(), n, d, s, scores.data(), span + 16, o, d);
      }
    }
  });
}

torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> mask,
                     double scale) {
  const auto type = q.scalar_type();
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && keys.scalar_type() == type &&
              values.scalar_type() == type, "bfloat16 or float32, q, keys and values alike");
  q = q.contiguous();
  const int64_t heads = q.size(1), rows = q.size(2), d = q.size(3);
  const int64_t kv_heads = keys.size(1), span = keys.size(2), group = heads / kv_heads;
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.size(3) == d && values.size(2) == span &&
              heads == group * kv_heads, "keys and values: [1, kv heads, span, d], d contiguous");
  TORCH_CHECK(d <= 256, "head dims up to 256");
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = mask->reshape({-1, mask->size(-1)}).contiguous();
    TORCH_CHECK(m.scalar_type() == type && m.size(0) == rows && m.size(1) == span, "mask: [rows, span], q's dtype");
  }
  auto out = torch::empty({1, rows, heads * d}, q.options());
  if (type == at::kFloat)
    attend_rows<float>(q, keys, values, m.defined() ? m.data_ptr<float>() : nullptr, scale, out);
  else
    attend_rows<bf16>(q, keys, values, m.defined() ? m.data_ptr<bf16>() : nullptr, scale, out);
  return out;
}
