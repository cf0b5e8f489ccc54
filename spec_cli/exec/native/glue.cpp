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
#include <atomic>
#include <type_traits>
#include <utility>
#include <vector>

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

// GPT-2's activation (transformers' NewGELUActivation) in one pass, each operation rounded to bfloat16 as torch's
// operations on bfloat16 round it: x^3 as (x x) x, the scalars in float, tanh by the Sleef function torch's AVX2
// kernels call: the same bits as the eight operations (tested against them), without their eight passes and
// dispatches (a [1, 1, 1536] row from Python: 34 us as eight operations, 8 us here; pyfam's one-row forward, eight
// layers, ~2.2 ms). AVX2 builds only (layer.cpp runs torch's operations elsewhere: on AVX-512, torch's kernels may
// call another Sleef function).
#ifdef SPEC_AVX2
extern "C" __m256 Sleef_tanhf8_u10avx2(__m256);  // (libtorch_cpu's, as its AVX2 kernels call it)

bool use_fused_gelu = true;

torch::Tensor gelu_new(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bfloat16 only");
  x = x.contiguous();
  auto y = torch::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const int64_t n = x.numel();
  const float c = static_cast<float>(0.044715), root = static_cast<float>(std::sqrt(2.0 / M_PI));
  at::parallel_for(0, (n + 15) / 16, 128, [&](int64_t begin, int64_t end) {  // (128 blocks: ~10 us of work)
    for (int64_t b = begin; b < end; ++b) {
      const __mmask16 k = lanes(n - b * 16);
      const __m512 v = load16(xp + b * 16, k);
      const __m512 cube = round16(_mm512_mul_ps(round16(_mm512_mul_ps(v, v)), v));
      const __m512 sum = round16(_mm512_add_ps(v, round16(_mm512_mul_ps(cube, _mm512_set1_ps(c)))));
      const __m512 inner = round16(_mm512_mul_ps(sum, _mm512_set1_ps(root)));
      const __m512 t = round16(__m512{Sleef_tanhf8_u10avx2(inner.lo), Sleef_tanhf8_u10avx2(inner.hi)});
      const __m512 half = round16(_mm512_mul_ps(v, _mm512_set1_ps(0.5f)));
      store16(yp + b * 16, round16(_mm512_mul_ps(half, round16(_mm512_add_ps(t, _mm512_set1_ps(1.f))))), k);
    }
  });
  return y;
}
#else
bool use_fused_gelu = false;

torch::Tensor gelu_new(torch::Tensor x) { TORCH_CHECK(false, "gelu_new: AVX2 builds only"); }
#endif

#ifdef SPEC_AVX2
constexpr bool AVX2_BUILD = true;
#else
constexpr bool AVX2_BUILD = false;
#endif

// a kernel's switch (for the tests and the benchmarks): whether it was on; `set` >= 0 turns it on (where it is
// available) or off
inline bool toggle(bool& on, int64_t set, bool available) {
  const bool before = on;
  if (set >= 0) on = set && available;
  return before;
}

bool fused_gelu(int64_t set) { return toggle(use_fused_gelu, set, AVX2_BUILD); }

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
#ifdef SPEC_AVX2
// (AVX2: the same tree on 8-lane halves, l + l+8 first, then the three folds as transposes; UNPACKED: vectors
// whose lanes lie as `widen16` puts them, [0-3, 8-11 | 4-7, 12-15], so that l + l+8 adds their halves' 128 bits)
template <bool UNPACKED = false>
inline __m512 fold16(const __m512 (&v)[16]) {
  auto eight = [](const __m512* w) {
    __m256 u[8], t[4], s[2];
    for (int k = 0; k < 8; ++k)
      u[k] = UNPACKED ? _mm256_add_ps(_mm256_permute2f128_ps(w[k].lo, w[k].hi, 0x20),
                                      _mm256_permute2f128_ps(w[k].lo, w[k].hi, 0x31))
                      : _mm256_add_ps(w[k].lo, w[k].hi);
    for (int k = 0; k < 4; ++k)  // [u2k 0-3 + 4-7 | u2k+1 0-3 + 4-7]
      t[k] = _mm256_add_ps(_mm256_permute2f128_ps(u[2 * k], u[2 * k + 1], 0x20),
                           _mm256_permute2f128_ps(u[2 * k], u[2 * k + 1], 0x31));
    for (int k = 0; k < 2; ++k)  // [u4k, u4k+2 | u4k+1, u4k+3], two lanes each
      s[k] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm256_shuffle_ps(s[0], s[1], _MM_SHUFFLE(3, 1, 3, 1)));  // [u0 u2 u4 u6 | u1 u3 u5 u7]
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  };
  return {eight(v), eight(v + 8)};
}
#else
template <bool UNPACKED = false>
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
#endif

// the cache lines of a key's or value's row, 16 keys ahead (the rows lie in slot order, but a row's keys are too
// few for the hardware's prefetcher to run ahead of them: without, the loop waits on memory at ~7 GB/s; 4 and 8
// ahead measured the same)
constexpr int64_t AHEAD = 16;

template <typename T>
inline void prefetch_row(const T* row, int64_t d) {
  for (int64_t b = 0; b < d * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
}

// 16 keys' scores for G heads from their lane-wise products `dots` (keys i0..i0+m-1; the rest zeros): each summed
// across its lanes by fold16, times scale, into scores (s_head apart), and each head's largest so far into top
thread_local float softcap_now = 0.f;  // the item under way's softcap (Gemma 2's; 0: none), set by attend_item

// cap x tanh(s / cap), as 1 - 2 / (e^(2 s / cap) + 1): each lane alone
inline __m512 softcapped(__m512 s, float cap) {
  const __m512 one = _mm512_set1_ps(1.f), e = exp16(_mm512_mul_ps(s, _mm512_set1_ps(2.f / cap)));
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

template <int G, bool UNPACKED = false>
inline void put_scores(__m512 (&dots)[G][16], int64_t i0, int64_t m, __m512 scaled, float* scores, int64_t s_head,
                       __m512 (&top)[G]) {
  const __mmask16 valid = lanes(m);
  const float cap = softcap_now;
  for (int g = 0; g < G; ++g) {
    __m512 s = _mm512_mul_ps(fold16<UNPACKED>(dots[g]), scaled);
    if (cap > 0.f) s = softcapped(s, cap);
    _mm512_mask_storeu_ps(scores + g * s_head + i0, valid, s);
    top[g] = _mm512_mask_max_ps(top[g], valid, top[g], s);
  }
}

// A head's n scores in place as e^(score - its largest, `best`'s lanes), returning 1 / their sum; with a `sink`
// (gpt-oss's: a logit of no key, in the largest and the sum, its weight dropped), 1 / (their sum + e^(sink - largest))
inline float exponentiate(float* scores, int64_t n, __m512 best, float sink = -INFINITY) {
  const float largest = std::max(_mm512_reduce_max_ps(best), sink);
  const __m512 top = _mm512_set1_ps(largest);
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, scores + i), top));
    _mm512_mask_storeu_ps(scores + i, k, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(k, e));
  }
  return 1.f / (sink == -INFINITY ? _mm512_reduce_add_ps(total) : _mm512_reduce_add_ps(total) + std::exp(sink - largest));
}

// One query row of G heads that share keys and values (grouped queries) over their attended keys (`attended`,
// n of them, in slot order): scores, softmax and the values' weighted sum, with C chunks of 16 of the head
// dimension held in registers, each key and value read once for the G heads. A head's arithmetic is the same
// whatever G is and wherever a key falls among blocks of 16 (`fold16`): its bits depend on its query and its
// attended keys alone.
template <typename T, int C, int G>
inline void attend_heads(const T* q, int64_t q_head, const T* kbase, int64_t k_slot, const T* vbase,
                         int64_t v_slot, const int32_t* attended, int64_t n, int64_t d, float scale, float* scores,
                         int64_t s_head, T* out, int64_t out_head, const float* sinks) {
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
      if (i0 + j + AHEAD < n) prefetch_row(kbase + attended[i0 + j + AHEAD] * k_slot, d);
      const T* key = kbase + attended[i0 + j] * k_slot;
      __m512 k[C];
      for (int c = 0; c < C; ++c) k[c] = load16(key + c * 16, part[c]);
      for (int g = 0; g < G; ++g) {
        __m512 dot = _mm512_mul_ps(query[g][0], k[0]);
        for (int c = 1; c < C; ++c) dot = _mm512_fmadd_ps(query[g][c], k[c], dot);
        dots[g][j] = dot;
      }
    }
    put_scores<G>(dots, i0, m, scaled, scores, s_head, best);
  }
  __m512 inverse[G];
  for (int g = 0; g < G; ++g)
    inverse[g] = _mm512_set1_ps(exponentiate(scores + g * s_head, n, best[g], sinks ? sinks[g] : -INFINITY));
  __m512 sum[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) sum[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    if (i + AHEAD < n) prefetch_row(vbase + attended[i + AHEAD] * v_slot, d);
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
                       int64_t, float, float*, int64_t, T*, int64_t, const float*);

// the kernel for C chunks and g heads, g up to MOST (what the registers hold: G x C sums besides C values)
template <typename T, int C, int MOST>
Heads<T> heads_kernel(int64_t g) {
  if constexpr (MOST >= 4) if (g >= 4) return attend_heads<T, C, 4>;
  if constexpr (MOST >= 3) if (g == 3) return attend_heads<T, C, 3>;
  if constexpr (MOST >= 2) if (g == 2) return attend_heads<T, C, 2>;
  return attend_heads<T, C, 1>;
}

#ifdef SPEC_AVX2
// 16 bfloat16 lanes widened to float by unpacking their words against zeros: lanes [0-3, 8-11 | 4-7, 12-15]
inline void widen16(const bf16* p, __m256& lo, __m256& hi) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x));
}

// attend_heads on AVX2 for bfloat16 heads of C whole chunks of 16: queries, keys and values widened by `widen16`
// (one load and two unpacks a chunk), every lane's products and sums the ones attend_heads makes for that lane, in
// the same order, the scores folded by the same tree (`fold16<true>`) and the outputs put back in order: the same
// bits, in AVX2's own registers rather than through avx2.h's 16-lane emulation. G heads of a group at once: each
// chunk of a key widened once for all of them (Qwen2.5-1.5B's 6 heads a kv head: 0.79-0.84x the time of a head a
// call); the values summed a head and 4 chunks a pass (8 sums: none spilled).
template <int C, int G>
inline void attend_heads_avx2(const bf16* q, int64_t q_head, const bf16* kbase, int64_t k_slot, const bf16* vbase,
                              int64_t v_slot, const int32_t* attended, int64_t n, int64_t d, float scale,
                              float* scores, int64_t s_head, bf16* out, int64_t out_head, const float* sinks) {
  __m256 qlo[G][C], qhi[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) widen16(q + g * q_head + c * 16, qlo[g][c], qhi[g][c]);
  __m512 best[G];
  for (int g = 0; g < G; ++g) best[g] = _mm512_set1_ps(-INFINITY);
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    __m512 dots[G][16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= m) {
        for (int g = 0; g < G; ++g) dots[g][j] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        continue;
      }
      if (i0 + j + AHEAD < n) prefetch_row(kbase + attended[i0 + j + AHEAD] * k_slot, d);
      const bf16* key = kbase + attended[i0 + j] * k_slot;
      __m256 lo[G], hi[G];  // (a chunk of the key widened once for every head, each head's sums in chunk order)
      for (int c = 0; c < C; ++c) {
        __m256 klo, khi;
        widen16(key + c * 16, klo, khi);
        for (int g = 0; g < G; ++g) {
          lo[g] = c == 0 ? _mm256_mul_ps(qlo[g][0], klo) : _mm256_fmadd_ps(qlo[g][c], klo, lo[g]);
          hi[g] = c == 0 ? _mm256_mul_ps(qhi[g][0], khi) : _mm256_fmadd_ps(qhi[g][c], khi, hi[g]);
        }
      }
      for (int g = 0; g < G; ++g) dots[g][j] = {lo[g], hi[g]};
    }
    put_scores<G, true>(dots, i0, m, scaled, scores, s_head, best);
  }
  float inverse[G];
  for (int g = 0; g < G; ++g) inverse[g] = exponentiate(scores + g * s_head, n, best[g], sinks ? sinks[g] : -INFINITY);
  constexpr int PART = C > 4 ? 4 : C;  // chunks a pass over the values sums (8 sums a head: none spilled)
  constexpr int VG = G * PART <= 8 ? G : 1;  // heads a pass over the values sums
  for (int g0 = 0; g0 < G; g0 += VG)
  for (int c0 = 0; c0 < C; c0 += PART) {
    __m256 slo[VG][PART], shi[VG][PART];
    for (int g = 0; g < VG; ++g)
      for (int c = 0; c < PART; ++c) slo[g][c] = shi[g][c] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      if (i + AHEAD < n) prefetch_row(vbase + attended[i + AHEAD] * v_slot + c0 * 16, PART * 16);
      const bf16* value = vbase + attended[i] * v_slot + c0 * 16;
      __m256 vlo[PART], vhi[PART];
      for (int c = 0; c < PART; ++c) widen16(value + c * 16, vlo[c], vhi[c]);
      for (int g = 0; g < VG; ++g) {
        const __m256 weight = _mm256_set1_ps(scores[(g0 + g) * s_head + i]);
        for (int c = 0; c < PART; ++c) {
          slo[g][c] = _mm256_fmadd_ps(weight, vlo[c], slo[g][c]);
          shi[g][c] = _mm256_fmadd_ps(weight, vhi[c], shi[g][c]);
        }
      }
    }
    for (int g = 0; g < VG; ++g) {
      const __m256 inv = _mm256_set1_ps(inverse[g0 + g]);
      for (int c = 0; c < PART; ++c) {
        const __m512 r = round16(__m512{_mm256_mul_ps(slo[g][c], inv), _mm256_mul_ps(shi[g][c], inv)});
        const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(r.lo), 16);
        const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(r.hi), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (g0 + g) * out_head + (c0 + c) * 16),
                            _mm256_packus_epi32(lo, hi));  // (each 128 bits: lo's 4 lanes, then hi's: in order)
      }
    }
  }
}
#endif

#ifdef SPEC_AVX2
// heads a call of attend_heads_avx2 takes at most: a key's chunk widened once serves them all
constexpr int64_t AVX2_HEADS = 6;

template <int C>
Heads<bf16> avx2_heads(int64_t g) {
  switch (g) {
    case 6: return attend_heads_avx2<C, 6>;
    case 5: return attend_heads_avx2<C, 5>;
    case 4: return attend_heads_avx2<C, 4>;
    case 3: return attend_heads_avx2<C, 3>;
    case 2: return attend_heads_avx2<C, 2>;
    default: return attend_heads_avx2<C, 1>;
  }
}
#endif

#ifndef SPEC_AVX2
// The same in bfloat16 on a CPU with AVX-512 BF16, as FlashAttention sums on a GPU: q.k from bfloat16 pairs into
// float (vdpbf16ps: each product exact, summed in float), the softmax in float, its weights rounded to bfloat16 and
// the values summed from bfloat16 pairs into float, normalised by the sum of the rounded weights. Half the
// instructions of the float sums above (and no widening of keys and values). A row's bits still depend on its
// query and its attended keys alone: the keys' pairs are (0, 1), (2, 3), ... of the attended ones, a missing
// second one zero.
#define SPEC_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

inline __mmask32 lanes32(int64_t left) {
  return left >= 32 ? 0xFFFFFFFFu : left <= 0 ? 0u : static_cast<__mmask32>((1u << left) - 1);
}

// Scores of G heads' queries (bfloat16, q_head apart) against the n attended keys, times scale, into scores (s_head
// apart); best: each head's largest. C chunks of 32 of the head dimension (past d: zeros).
template <int C, int G>
SPEC_BF16 void dot_scores(const bf16* q, int64_t q_head, const bf16* kbase, int64_t k_slot, const int32_t* attended,
                          int64_t n, int64_t d, float scale, float* scores, int64_t s_head, float* best) {
  __mmask32 part[C];
  __m512bh query[G][C];
  for (int c = 0; c < C; ++c) part[c] = lanes32(d - c * 32);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      query[g][c] = (__m512bh)_mm512_maskz_loadu_epi16(part[c], q + g * q_head + c * 32);
  __m512 top[G];
  for (int g = 0; g < G; ++g) top[g] = _mm512_set1_ps(-INFINITY);
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - i0);
    __m512 dots[G][16];
    for (int64_t j = 0; j < 16; ++j) {
      if (j >= m) {
        for (int g = 0; g < G; ++g) dots[g][j] = _mm512_setzero_ps();
        continue;
      }
      if (i0 + j + AHEAD < n) prefetch_row(kbase + attended[i0 + j + AHEAD] * k_slot, d);
      const bf16* key = kbase + attended[i0 + j] * k_slot;
      __m512bh k[C];
      for (int c = 0; c < C; ++c) k[c] = (__m512bh)_mm512_maskz_loadu_epi16(part[c], key + c * 32);
      for (int g = 0; g < G; ++g) {
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[g][0], k[0]);
        for (int c = 1; c < C; ++c) dot = _mm512_dpbf16_ps(dot, query[g][c], k[c]);
        dots[g][j] = dot;
      }
    }
    put_scores<G>(dots, i0, m, scaled, scores, s_head, top);
  }
  for (int g = 0; g < G; ++g) best[g] = _mm512_reduce_max_ps(top[g]);
}

// Scores -> weights: e^(s - best) rounded to bfloat16 into weights (n of them, then a zero: the last pair's second
// when n is odd); returns 1 / the sum of the rounded weights (and of e^(sink - largest), with a sink: `exponentiate`)
SPEC_BF16 inline float dot_weights(const float* scores, int64_t n, float best, bf16* weights, float sink = -INFINITY) {
  best = std::max(best, sink);
  const __m512 top = _mm512_set1_ps(best);
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lanes(n - i);
    const __m512 e = _mm512_maskz_mov_ps(k, round16(exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, scores + i), top))));
    store16(weights + i, e, k);
    total = _mm512_add_ps(total, e);
  }
  weights[n] = bf16(0.f);
  return 1.f / (sink == -INFINITY ? _mm512_reduce_add_ps(total) : _mm512_reduce_add_ps(total) + std::exp(sink - best));
}

// The values' weighted sum for G heads over channels c0..c0+63 (past d: none): pairs of attended values interleaved
// (vpunpck: channel 8l + t of the pair in dwords 4l + t of `lo`, 8l + 4 + t of `hi`, l a 128-bit lane), times each
// head's pair of weights (weights + g * w_head), then put back in channel order, times inverse[g], into out.
template <int G, typename T>
SPEC_BF16 void dot_values(const bf16* vbase, int64_t v_slot, const int32_t* attended, int64_t n, int64_t c0,
                          int64_t d, const bf16* weights, int64_t w_head, const float* inverse, T* out,
                          int64_t out_head) {
  const __mmask32 ma = lanes32(d - c0), mb = lanes32(d - c0 - 32);
  __m512 sum[G][4];
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < 4; ++t) sum[g][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 2) {
    if (c0 == 0 && i + AHEAD + 1 < n) {  // (the whole rows: the later channels' passes find them near)
      prefetch_row(vbase + attended[i + AHEAD] * v_slot, d);
      prefetch_row(vbase + attended[i + AHEAD + 1] * v_slot, d);
    }
    const bf16* v0 = vbase + attended[i] * v_slot + c0;
    const __m512i a0 = _mm512_maskz_loadu_epi16(ma, v0), b0 = _mm512_maskz_loadu_epi16(mb, v0 + 32);
    __m512i a1 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();
    if (i + 1 < n) {
      const bf16* v1 = vbase + attended[i + 1] * v_slot + c0;
      a1 = _mm512_maskz_loadu_epi16(ma, v1);
      b1 = _mm512_maskz_loadu_epi16(mb, v1 + 32);
    }
    const __m512bh x[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, a1), (__m512bh)_mm512_unpackhi_epi16(a0, a1),
                           (__m512bh)_mm512_unpacklo_epi16(b0, b1), (__m512bh)_mm512_unpackhi_epi16(b0, b1)};
    for (int g = 0; g < G; ++g) {
      int32_t pair;
      std::memcpy(&pair, weights + g * w_head + i, sizeof(pair));
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < 4; ++t) sum[g][t] = _mm512_dpbf16_ps(sum[g][t], x[t], w);
    }
  }
  static const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  static const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < G; ++g) {
    const __m512 scale = _mm512_set1_ps(inverse[g]);
    T* o = out + g * out_head + c0;
    for (int half = 0; half < 2; ++half) {
      const __m512 lo = sum[g][2 * half], hi = sum[g][2 * half + 1];
      const int64_t at = c0 + 32 * half;
      if (at < d) put16(o + 32 * half, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), scale), lanes(d - at));
      if (at + 16 < d)
        put16(o + 32 * half + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), scale), lanes(d - at - 16));
    }
  }
}

using DotScores = void (*)(const bf16*, int64_t, const bf16*, int64_t, const int32_t*, int64_t, int64_t, float,
                           float*, int64_t, float*);
using DotValues = void (*)(const bf16*, int64_t, const int32_t*, int64_t, int64_t, int64_t, const bf16*, int64_t,
                           const float*, bf16*, int64_t);

constexpr int DOT_VALUES_MOST = 6;  // heads a dot_values call sums at once (4 sums of 16 each, besides 4 values)

template <int C, int G = 1>
DotScores dot_scores_kernel(int64_t g) {
  if constexpr ((G + 1) * C + C + 1 <= 30 && G < 12)
    if (g > G) return dot_scores_kernel<C, G + 1>(g);
  return dot_scores<C, G>;
}

template <int G = 1>
DotValues dot_values_kernel(int64_t g) {
  if constexpr (G < DOT_VALUES_MOST)
    if (g > G) return dot_values_kernel<G + 1>(g);
  return dot_values<G, bf16>;
}

// heads a dot_scores call takes at once for C chunks (G x C queries held in registers, besides C keys and a sum)
inline int64_t dot_scores_most(int64_t C) { return std::min<int64_t>(12, (29 - C) / C); }

#endif

#ifdef SPEC_AVX2
bool dots_available() { return false; }
#else
bool dots_available() { return __builtin_cpu_supports("avx512bf16"); }
#endif

namespace {
bool use_dots = dots_available();
}

bool attention_dots(int64_t set) { return toggle(use_dots, set, dots_available()); }

bool use_avx2 = AVX2_BUILD;  // (the tests compare it with the emulated kernel, off)

bool attention_avx2(int64_t set) { return toggle(use_avx2, set, AVX2_BUILD); }

// One sequence's rows over its cache, as attend_item reads them: q's head h row r at q + h * q_head + r * d; keys
// and values by kv head and slot; its additive mask [rows, span] (null: every slot); row r's output at
// out + r * out_row, heads side by side.
template <typename T>
struct Sequence {
  const T* q;
  int64_t q_head, rows;
  const T* k;
  int64_t k_head, k_slot;
  const T* v;
  int64_t v_head, v_slot;
  const T* mask;
  int64_t span;
  T* out;
  int64_t out_row;
  const float* sinks = nullptr;  // each head's sink logit (gpt-oss), or none
  float softcap = 0.f;  // scores as softcap x tanh(score / softcap) (Gemma 2's), or none (0)
};

// a thread's room for one item: the attended slots, a group's scores (and in bfloat16 its weights)
template <typename T>
struct Scratch {
  std::vector<int32_t> attended;
  std::vector<float> scores;
  std::vector<bf16> weights;
  int64_t stride = 0;

  void fit(int64_t span, int64_t group) {
    if (span + 32 <= stride) return;
    stride = span + 32;  // (a head's scores and weights, each past n by up to 16, and the zero)
    attended.resize(span);
    scores.resize(group * stride);
    if (std::is_same_v<T, bf16>) weights.resize(group * stride);
  }
};

// One row r of a sequence for the `group` heads of kv head kv: its attended slots gathered in slot order, then the
// heads' attention by the dot products (bfloat16, where the CPU has them) or the float sums of attend_heads.
template <typename T>
void attend_item(const Sequence<T>& s, int64_t kv, int64_t r, int64_t group, int64_t d, float scale,
                 Scratch<T>& room) {
  room.fit(s.span, group);
  softcap_now = s.softcap;
  int32_t* attended = room.attended.data();
  int64_t n = 0;
  const T* mask = s.mask ? s.mask + r * s.span : nullptr;
  for (int64_t j = 0; j < s.span; ++j)
    if (mask == nullptr || std::isfinite(static_cast<float>(mask[j]))) attended[n++] = static_cast<int32_t>(j);
  const int64_t h0 = kv * group, stride = room.stride;
  T* out = s.out + r * s.out_row + h0 * d;
  if (n == 0) {  // (a row that attends to nothing: zeros)
    std::memset(out, 0, group * d * sizeof(T));
    return;
  }
  const T* q = s.q + h0 * s.q_head + r * d;
  const T* k = s.k + kv * s.k_head;
  const T* v = s.v + kv * s.v_head;
  float* scores = room.scores.data();
#ifndef SPEC_AVX2
  if constexpr (std::is_same_v<T, bf16>) {
    if (use_dots) {
      const int64_t C = d <= 64 ? 2 : d <= 128 ? 4 : 8, most = dot_scores_most(C);
      float best[256], inverse[256];
      for (int64_t g0 = 0; g0 < group; g0 += most) {
        const int64_t count = std::min(most, group - g0);
        const auto kernel = C == 2 ? dot_scores_kernel<2>(count) : C == 4 ? dot_scores_kernel<4>(count)
                                                                          : dot_scores_kernel<8>(count);
        kernel(q + g0 * s.q_head, s.q_head, k, s.k_slot, attended, n, d, scale, scores + g0 * stride, stride,
               best + g0);
      }
      bf16* weights = room.weights.data();
      for (int64_t g = 0; g < group; ++g)
        inverse[g] = dot_weights(scores + g * stride, n, best[g], weights + g * stride,
                                 s.sinks ? s.sinks[h0 + g] : -INFINITY);
      const int64_t passes = (group + DOT_VALUES_MOST - 1) / DOT_VALUES_MOST;
      for (int64_t c0 = 0; c0 < d; c0 += 64)
        for (int64_t p = 0, g0 = 0; p < passes; ++p) {
          const int64_t count = (group - g0) / (passes - p);  // (balanced: 7 heads as 4 and 3)
          dot_values_kernel(count)(v, s.v_slot, attended, n, c0, d, weights + g0 * stride, stride, inverse + g0,
                                   out + g0 * d, d);
          g0 += count;
        }
      return;
    }
  }
#endif
#ifdef SPEC_AVX2
  if constexpr (std::is_same_v<T, bf16>) {
    if (use_avx2 && (d == 64 || d == 128)) {
      for (int64_t g0 = 0; g0 < group;) {
        const int64_t count = std::min<int64_t>(AVX2_HEADS, group - g0);
        const auto kernel = d == 64 ? avx2_heads<4>(count) : avx2_heads<8>(count);
        kernel(q + g0 * s.q_head, s.q_head, k, s.k_slot, v, s.v_slot, attended, n, d, scale, scores, stride,
               out + g0 * d, d, s.sinks ? s.sinks + h0 + g0 : nullptr);
        g0 += count;
      }
      return;
    }
  }
#endif
  const int64_t chunks = (d + 15) / 16;
  const int64_t C = chunks == 4 ? 4 : chunks == 8 ? 8 : chunks <= 2 ? 2 : chunks <= 6 ? 6 : 16;  // (past d: masked)
  const int64_t most = C <= 4 ? 4 : C <= 8 ? 2 : 1;  // heads a call takes at once
  for (int64_t g0 = 0; g0 < group; g0 += most) {
    const int64_t count = std::min(most, group - g0);
    Heads<T> kernel;
    switch (C) {
      case 2: kernel = heads_kernel<T, 2, 4>(count); break;
      case 4: kernel = heads_kernel<T, 4, 4>(count); break;
      case 6: kernel = heads_kernel<T, 6, 2>(count); break;
      case 8: kernel = heads_kernel<T, 8, 2>(count); break;
      default: kernel = heads_kernel<T, 16, 1>(count);
    }
    kernel(q + g0 * s.q_head, s.q_head, k, s.k_slot, v, s.v_slot, attended, n, d, scale, scores, stride,
           out + g0 * d, d, s.sinks ? s.sinks + h0 + g0 : nullptr);
  }
}

// Every row of every sequence, kv head by kv head: over the threads, each taking the next item as it finishes one
// (the sequences' spans differ), or in this thread where the work would not pay for waking the others.
template <typename T>
void attend_sequences(const std::vector<Sequence<T>>& sequences, int64_t heads, int64_t kv_heads, int64_t d,
                      double scale) {
  const int64_t group = heads / kv_heads;
  std::vector<std::pair<int64_t, int64_t>> items;  // (sequence, row)
  int64_t work = 0, span = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(sequences.size()); ++i) {
    for (int64_t r = 0; r < sequences[i].rows; ++r) items.emplace_back(i, r);
    work += sequences[i].rows * sequences[i].span;
    span = std::max(span, sequences[i].span);
  }
  const int64_t count = static_cast<int64_t>(items.size()) * kv_heads;
  const float s = static_cast<float>(scale);
  auto run = [&](int64_t item, Scratch<T>& room) {
    const auto& [i, r] = items[item / kv_heads];
    attend_item(sequences[i], item % kv_heads, r, group, d, s, room);
  };
  if (!attend_spreads(work, 1, heads, d) || at::get_num_threads() == 1 || count == 1) {
    Scratch<T> room;
    room.fit(span, group);
    for (int64_t item = 0; item < count; ++item) run(item, room);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch<T> room;
    room.fit(span, group);
    for (int64_t item = next++; item < count; item = next++) run(item, room);
  });
}

// each head's sink logit (gpt-oss's `sinks`) as float32 [heads], or undefined (none)
torch::Tensor sink_logits(const c10::optional<torch::Tensor>& sinks, int64_t heads) {
  if (!sinks.has_value() || !sinks->defined()) return {};
  TORCH_CHECK(sinks->numel() == heads, "sinks: one logit a head");
  return sinks->to(at::kFloat).contiguous();
}

// Attention of q [1, heads, rows, d] over keys and values [1, kv_heads, span, d] (views of the cache: any head
// and slot strides, d contiguous) under an additive mask [rows, span] of 0 (attended) and -inf (None: all),
// -> [1, rows, heads * d], as the output projection takes it; bfloat16 or float, all in one (the mask too). A
// row's attended keys are gathered in slot order before anything is summed, so its bits depend only on its query
// and those keys, in that order: not on where they lie, nor on the keys it does not attend to (a tree's cousins
// between its ancestors), nor on other rows, nor on how many slots the forward attends.
torch::Tensor attend(torch::Tensor q, torch::Tensor keys, torch::Tensor values, c10::optional<torch::Tensor> mask,
                     double scale, c10::optional<torch::Tensor> sinks, double softcap) {
  const auto type = q.scalar_type();
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && keys.scalar_type() == type &&
              values.scalar_type() == type, "bfloat16 or float32, q, keys and values alike");
  q = q.contiguous();
  const int64_t heads = q.size(1), rows = q.size(2), d = q.size(3);
  const int64_t kv_heads = keys.size(1), span = keys.size(2), group = heads / kv_heads;
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.size(3) == d && values.size(2) == span &&
              heads == group * kv_heads, "keys and values: [1, kv heads, span, d], d contiguous");
  TORCH_CHECK(d <= 256 && group <= 256, "head dims up to 256, up to 256 heads a kv head");
  torch::Tensor m;
  if (mask.has_value() && mask->defined()) {
    m = mask->reshape({-1, mask->size(-1)}).contiguous();
    TORCH_CHECK(m.scalar_type() == type && m.size(0) == rows && m.size(1) == span, "mask: [rows, span], q's dtype");
  }
  const torch::Tensor sink = sink_logits(sinks, heads);
  auto out = torch::empty({1, rows, heads * d}, q.options());
  auto one = [&](auto* type) {
    using T = std::remove_pointer_t<decltype(type)>;
    const Sequence<T> sequence{q.data_ptr<T>(), rows * d, rows, keys.data_ptr<T>(), keys.stride(1), keys.stride(2),
                               values.data_ptr<T>(), values.stride(1), values.stride(2),
                               m.defined() ? m.data_ptr<T>() : nullptr, span, out.data_ptr<T>(), heads * d,
                               sink.defined() ? sink.data_ptr<float>() : nullptr, static_cast<float>(softcap)};
    attend_sequences<T>({sequence}, heads, kv_heads, d, scale);
  };
  if (type == at::kFloat)
    one(static_cast<float*>(nullptr));
  else
    one(static_cast<bf16*>(nullptr));
  return out;
}

// Several sequences' rows in one forward (`exec.lockstep`): q [1, heads, rows, d] and the new k and v [1, kv heads,
// rows, d] of every part's rows in order (`rows_of`: each part's count). Each part's k and v go to its own cache
// (`keys[i]`, `values[i]` [1, kv heads, slots, d]: at first[i].., or at slots[i]) and its rows attend to that
// cache's first span[i] slots under its mask [rows, span[i]], each row as `attend` sums it -> [1, rows, heads * d],
// as the output projection takes it. No tensor is made but the output: a part's work is raw pointers.
torch::Tensor attend_parts(torch::Tensor q, torch::Tensor k, torch::Tensor v, std::vector<torch::Tensor> keys,
                           std::vector<torch::Tensor> values, std::vector<int64_t> rows_of, std::vector<int64_t> first,
                           std::vector<c10::optional<torch::Tensor>> slots, std::vector<int64_t> span,
                           std::vector<c10::optional<torch::Tensor>> masks, double scale,
                           c10::optional<torch::Tensor> sinks, double softcap) {
  const size_t count = keys.size();
  TORCH_CHECK(values.size() == count && rows_of.size() == count && first.size() == count && slots.size() == count &&
              span.size() == count && masks.size() == count, "attend_parts: one entry a part");
  const auto type = q.scalar_type();
  TORCH_CHECK((type == at::kBFloat16 || type == at::kFloat) && k.scalar_type() == type && v.scalar_type() == type,
              "bfloat16 or float32, q, k and v alike");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  const int64_t heads = q.size(1), total = q.size(2), d = q.size(3), kv_heads = k.size(1);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= 256 && d <= 256 && k.size(2) == total &&
              v.size(2) == total && k.size(3) == d && v.size(3) == d, "attend_parts: q, k and v's shapes");
  const torch::Tensor sink = sink_logits(sinks, heads);
  auto out = torch::empty({1, total, heads * d}, q.options());
  std::vector<torch::Tensor> held;  // (contiguous masks, slots as int64, alive until the end)
  auto one = [&](auto* type_of) {
    using T = std::remove_pointer_t<decltype(type_of)>;
    std::vector<Sequence<T>> sequences;
    int64_t start = 0;
    for (size_t i = 0; i < count; ++i) {
      const int64_t n = rows_of[i];
      auto& cache_k = keys[i];
      auto& cache_v = values[i];
      TORCH_CHECK(cache_k.scalar_type() == type && cache_v.scalar_type() == type && cache_k.dim() == 4 &&
                  cache_k.size(1) == kv_heads && cache_k.size(3) == d && cache_k.stride(3) == 1 &&
                  cache_v.sizes() == cache_k.sizes() && cache_v.stride(3) == 1 && span[i] <= cache_k.size(2),
                  "attend_parts: caches [1, kv heads, slots, d], d contiguous");
      const int64_t slots_of = cache_k.size(2);
      const int64_t* at_slots = nullptr;
      if (slots[i].has_value() && slots[i]->defined()) {
        held.push_back(slots[i]->to(at::kLong).contiguous());
        at_slots = held.back().data_ptr<int64_t>();
        TORCH_CHECK(held.back().numel() == n, "attend_parts: a slot a row");
      }
      write_rows(cache_k, cache_v, k, v, start, n, [&](int64_t r) {  // the part's new keys and values
        const int64_t slot = at_slots ? at_slots[r] : first[i] + r;
        TORCH_CHECK(0 <= slot && slot < slots_of, "attend_parts: a slot past the cache");
        return slot;
      });
      T* kp = cache_k.data_ptr<T>();
      T* vp = cache_v.data_ptr<T>();
      const T* mask = nullptr;
      if (masks[i].has_value() && masks[i]->defined()) {
        held.push_back(masks[i]->reshape({-1, masks[i]->size(-1)}).contiguous());
        TORCH_CHECK(held.back().scalar_type() == type && held.back().size(0) == n && held.back().size(1) == span[i],
                    "attend_parts: a mask [rows, span], q's dtype");
        mask = held.back().data_ptr<T>();
      }
      sequences.push_back({q.data_ptr<T>() + start * d, total * d, n, kp, cache_k.stride(1), cache_k.stride(2), vp,
                           cache_v.stride(1), cache_v.stride(2), mask, span[i], out.data_ptr<T>() + start * heads * d,
                           heads * d, sink.defined() ? sink.data_ptr<float>() : nullptr, static_cast<float>(softcap)});
      start += n;
    }
    TORCH_CHECK(start == total, "attend_parts: the parts' rows are q's");
    attend_sequences<T>(sequences, heads, kv_heads, d, scale);
  };
  if (type == at::kFloat)
    one(static_cast<float*>(nullptr));
  else
    one(static_cast<bf16*>(nullptr));
  return out;
}
