// bfloat16 weights x bfloat16 rows, summed in float (`mm16`): a float model in bfloat16 on a CPU where oneDNN has
// no bfloat16 path (AVX2: Zen 2 and 3, Intel's client chips). There torch's bfloat16 product reads the weights again
// for every row (4 rows cost 4 one-row products) and GPT-2's Conv1D layout ([in, out]) costs ~15x its bytes' time.
// Here the weights ([out, in], as a Linear holds them) are read once for every pass of up to 6 rows, widened to float
// 8 at a time (a shift), and multiply-added into each (row, output)'s 8 lanes in input order, then the lanes summed
// by one fixed tree: a row's bits depend on its own values alone, whatever the rows beside it (the rule every spec
// product keeps). Plain AVX2 and FMA, so both builds compile it.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

namespace {

using bf16 = at::BFloat16;

inline __m256 widen8(const bf16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float sum8(__m256 v) {  // (lanes l + l+4, then + 2, then + 1)
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}

// R rows (float, K apart) times NB outputs' weights (K apart) into y (rows ldy apart); K a multiple of 8. Up to 3 rows
// each step holds the rows in registers and widens the weights in turn; 4 to 6 rows it widens the NB weights first,
// then reads each row once for its NB multiply-adds (fewer widenings a multiply-add). The same sums either way.
template <int R, int NB>
inline void tile(const float* x, const bf16* w, int64_t K, bf16* y, int64_t ldy) {
  __m256 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    if constexpr (R <= 3) {
      __m256 xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
      for (int j = 0; j < NB; ++j) {
        const __m256 wv = widen8(w + j * K + k);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm256_fmadd_ps(wv, xv[r], acc[r][j]);
      }
    } else {
      __m256 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = widen8(w + j * K + k);
      for (int r = 0; r < R; ++r) {
        __m256 xv = _mm256_loadu_ps(x + r * K + k);
        asm("" : "+x"(xv));  // (one load a row: folded into each multiply-add it would be NB loads)
        for (int j = 0; j < NB; ++j) acc[r][j] = _mm256_fmadd_ps(wv[j], xv, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NB; ++j) y[r * ldy + j] = bf16(sum8(acc[r][j]));  // (to the nearest, ties even)
}

// outputs first..last for R rows: NB a tile (what AVX2's 16 registers hold: R x NB sums, the rows or the weights, one
// more), then one at a time
template <int R, int NB>
inline void outputs(const float* x, const bf16* w, int64_t K, bf16* y, int64_t N, int64_t first, int64_t last) {
  int64_t n = first;
  for (; n + NB <= last; n += NB) tile<R, NB>(x, w + n * K, K, y + n, N);
  for (; n < last; ++n) tile<R, 1>(x, w + n * K, K, y + n, N);
}

}  // namespace

torch::Tensor mm16(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "mm16: bfloat16 x and w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1) && x.size(1) % 8 == 0,
              "mm16: x [M, K], w [N, K], K a multiple of 8");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  std::vector<float> xf(M * K);  // (the rows widened once, not once a tile)
  const bf16* xp = x.data_ptr<bf16>();
  for (int64_t i = 0; i < M * K; i += 8) _mm256_storeu_ps(xf.data() + i, widen8(xp + i));
  const bf16* wp = w.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  // a thread's outputs a piece at a time (~192 KB of weights: they stay in L2), every pass of rows over the piece
  const int64_t piece = std::max<int64_t>(8, (192 << 10) / (2 * K) / 8 * 8);
  const int64_t grain = std::max<int64_t>(8, (64 << 10) / (2 * K));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t first = begin; first < end; first += piece) {
      const int64_t last = std::min(end, first + piece);
      for (int64_t m = 0, rows; m < M; m += rows) {
        const float* xm = xf.data() + m * K;
        bf16* ym = yp + m * N;
        const int64_t left = M - m;
        rows = left >= 9 || left == 6 ? 6 : left >= 7 ? 4 : left;  // (7: 4 + 3, 8: 4 + 4, never a lone row)
        switch (rows) {
          case 6: outputs<6, 2>(xm, wp, K, ym, N, first, last); break;
          case 5: outputs<5, 2>(xm, wp, K, ym, N, first, last); break;
          case 4: outputs<4, 3>(xm, wp, K, ym, N, first, last); break;
          case 3: outputs<3, 4>(xm, wp, K, ym, N, first, last); break;
          case 2: outputs<2, 6>(xm, wp, K, ym, N, first, last); break;
          default: outputs<1, 8>(xm, wp, K, ym, N, first, last); break;
        }
      }
    }
  });
  return y;
}
