// What the host reads of a forward's float32 logits [rows, V], each row in one pass or two on one thread: the
// token each row decides (argmax), and the draft's few most likely tokens with their probabilities (top_probs);
// and coupled sampling's scores with top-k (coupled_top_k), without it (coupled_nucleus), and its Gumbel noise
// (coupled_noise).
// torch's max, softmax and topk over a few rows each start a parallel region and write a V-wide result; a
// speculative step reads a handful of numbers a row, and each of those calls cost it tens of microseconds.
#include "kernels.h"
#include "simd.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

namespace {

using namespace simd;

constexpr int64_t LOGIT_GRAIN = 1 << 16;  // values a thread takes at least (a thread's start costs ~10 us)

// the index torch's max(-1) gives: the first of equal maxima; a NaN counts above everything (its first one)
int64_t argmax_row(const float* x, int64_t V) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = lowest;
  __mmask16 nan = 0;
  for (int64_t j = 0; j < V; j += 16) {
    const __m512 v = _mm512_mask_loadu_ps(lowest, lanes(V - j), x + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  if (nan) {
    for (int64_t j = 0; j < V; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 m = lanes(V - j);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, x + j), top, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;
}

// the k largest of a row, largest first (of equal values the lower index first), as (value, index); then the
// softmax's probabilities of them
void top_row(const float* x, int64_t V, int64_t k, float* probs, float* tokens) {
  float value[64];
  int64_t index[64];
  int64_t filled = 0;
  auto insert = [&](float v, int64_t i) {  // v above the k-th (or fewer than k so far)
    int64_t at = filled < k ? filled++ : k - 1;
    while (at > 0 && value[at - 1] < v) {
      value[at] = value[at - 1];
      index[at] = index[at - 1];
      --at;
    }
    value[at] = v;
    index[at] = i;
  };
  int64_t j = 0;
  for (; j < V && filled < k; ++j)
    if (!std::isnan(x[j])) insert(x[j], j);
  for (; j < V; j += 16) {
    const __mmask16 m = lanes(V - j);
    __mmask16 above = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, x + j), _mm512_set1_ps(value[k - 1]),
                                              _CMP_GT_OQ);
    while (above) {
      const int lane = __builtin_ctz(above);
      above &= above - 1;
      if (x[j + lane] > value[k - 1]) insert(x[j + lane], j + lane);
    }
  }
  const float top = filled ? value[0] : 0.f;
  __m512 sum = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(top);
  for (int64_t i = 0; i < V; i += 16) {
    const __mmask16 m = lanes(V - i);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
    const __mmask16 live = _mm512_mask_cmp_ps_mask(m, v, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                                   _CMP_NEQ_UQ);  // (exp16 clamps: -inf would add e^-87)
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(v, shift))));
  }
  const float total = _mm512_reduce_add_ps(sum);
  for (int64_t i = 0; i < k; ++i) {
    const bool real = i < filled;
    probs[i] = real ? std::exp(value[i] - top) / total : 0.f;
    tokens[i] = static_cast<float>(real ? index[i] : 0);
  }
}

// the noise for a hash's top 23 bits, `bits`: a uniform strictly inside (0, 1) through -log(-log u) (each step the
// float32 operation torch's way takes, logf for its log); its least at 0, its largest at 2^23 - 1
inline float noise_of_bits(uint32_t bits) {
  const float u = (static_cast<float>(bits) + 0.5f) * 0x1p-23f;
  return -std::log(-std::log(u));
}

// coupling.py's noise for one counter: splitmix64 of `key` and the counter, its top 23 bits' noise
inline float noise_at(uint64_t key, uint64_t counter) {
  uint64_t z = (counter + 1) * 0x9E3779B97F4A7C15ull + key;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return noise_of_bits(static_cast<uint32_t>(z >> 41));
}

// one row's coupled top-k scores: s = x / t (t 1: x), the k-th largest s found by keeping the k largest seen (the
// running k-th compared 16 lanes at a time); with top_p < 1, the least of those that top-p keeps among them (their
// softmax's mass before each, largest first, below top_p: the first past it kept); then every s at least that
// gets s + its noise, the rest -inf
void coupled_row(const float* x, int64_t V, float t, int64_t k, double top_p, uint64_t key, uint64_t base,
                 float* out, std::vector<float>& best) {
  const bool divide = t != 1.f;
  const __m512 tv = _mm512_set1_ps(t);
  auto scaled = [&](int64_t j) { return divide ? x[j] / t : x[j]; };
  auto scaled16 = [&](int64_t j, __mmask16 m) {  // (the same division, 16 lanes)
    const __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    return divide ? _mm512_div_ps(v, tv) : v;
  };
  auto insert = [&](float s) { best.insert(std::upper_bound(best.begin(), best.end(), s, std::greater<float>()), s); };
  best.clear();
  int64_t j = 0;
  for (; j < V && static_cast<int64_t>(best.size()) < k; ++j)
    if (!std::isnan(scaled(j))) insert(scaled(j));
  for (; j < V; j += 16) {
    const __mmask16 m = lanes(V - j);
    __mmask16 above = _mm512_mask_cmp_ps_mask(m, scaled16(j, m), _mm512_set1_ps(best.back()), _CMP_GT_OQ);
    while (above) {
      const int lane = __builtin_ctz(above);
      above &= above - 1;
      if (scaled(j + lane) > best.back()) {
        best.pop_back();
        insert(scaled(j + lane));
      }
    }
  }
  float kth = best.empty() ? std::numeric_limits<float>::infinity() : best.back();
  if (top_p < 1.0 && !best.empty()) {  // (best: the k largest, largest first; words tied with the k-th past them
    // count in the total, and come last whatever their order)
    int64_t kept = 0;
    for (int64_t i = 0; i < V; i += 16) {
      const __mmask16 m = lanes(V - i);
      kept += __builtin_popcount(_mm512_mask_cmp_ps_mask(m, scaled16(i, m), _mm512_set1_ps(kth), _CMP_GE_OQ));
    }
    double total = static_cast<double>(kept - static_cast<int64_t>(best.size())) *
                   std::exp(static_cast<double>(kth) - best[0]);
    for (float v : best) total += std::exp(static_cast<double>(v) - best[0]);
    double before = 0.0;
    for (float v : best) {
      if (before >= top_p) break;
      kth = v;
      before += std::exp(static_cast<double>(v) - best[0]) / total;
    }
  }
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (j = 0; j < V; j += 16) {
    const __mmask16 m = lanes(V - j);
    _mm512_mask_storeu_ps(out + j, m, none);
    __mmask16 kept = _mm512_mask_cmp_ps_mask(m, scaled16(j, m), _mm512_set1_ps(kth), _CMP_GE_OQ);
    while (kept) {
      const int lane = __builtin_ctz(kept);
      kept &= kept - 1;
      out[j + lane] = scaled(j + lane) + noise_at(key, base + static_cast<uint64_t>(j + lane));
    }
  }
}

// How far below the largest s a word may lie and still win a draw: the noise's whole range, and 1 for the
// rounding of s + G. A word further down scores below the largest s's own score whatever either noise is.
const float REACH = noise_of_bits((1u << 23) - 1) - noise_of_bits(0) + 1.f;
constexpr float NEAR[] = {12.f, 24.f, std::numeric_limits<float>::infinity()};  // top-p's search, in turn

// one row's coupled scores without top-k: s = x / t (t 1: x). With top_p < 1, the words top-p keeps: the most
// probable until the mass before the next reaches top_p (the first past it kept, words tied with the last kept
// too), found among the words within 12 of the largest s (else 24, else all), sorted 1,024, then 16,384, then
// all of them at a time as far as needed (the mass over every word); with top_p 1 (temperature alone), the words within REACH of the largest s: the draw's
// argmax is among them, the same word as over the whole row. Each s kept + its noise, -inf elsewhere (NaN never).
void coupled_nucleus_row(const float* x, int64_t V, float t, double top_p, uint64_t key, uint64_t base, float* out,
                         std::vector<std::pair<float, int64_t>>& found) {
  const bool divide = t != 1.f;
  const __m512 tv = _mm512_set1_ps(t);
  const __m512 none = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  auto scaled = [&](int64_t j) { return divide ? x[j] / t : x[j]; };
  auto scaled16 = [&](int64_t j, __mmask16 m) {  // (the same division, 16 lanes; NaN lanes -inf)
    const __m512 v = _mm512_maskz_loadu_ps(m, x + j);
    const __m512 s = divide ? _mm512_div_ps(v, tv) : v;
    return _mm512_mask_mov_ps(none, _mm512_mask_cmp_ps_mask(m, s, s, _CMP_ORD_Q), s);
  };
  __m512 most = none;
  for (int64_t j = 0; j < V; j += 16) most = _mm512_max_ps(most, scaled16(j, lanes(V - j)));
  const float top = _mm512_reduce_max_ps(most);
  float floor = top - REACH;
  if (top_p < 1.0 && top > -std::numeric_limits<float>::infinity()) {
    __m512 sum = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(top);
    auto collect = [&](int64_t j, __m512 s, __mmask16 m, float margin) {  // (the words within `margin` of the largest)
      __mmask16 close = _mm512_mask_cmp_ps_mask(m, s, _mm512_set1_ps(top - margin), _CMP_GE_OQ);
      while (close) {
        const int lane = __builtin_ctz(close);
        close &= close - 1;
        found.emplace_back(scaled(j + lane), j + lane);
      }
    };
    found.clear();
    for (int64_t j = 0; j < V; j += 16) {  // (the mass, and the first search's words, in one pass)
      const __mmask16 m = lanes(V - j);
      const __m512 s = scaled16(j, m);
      const __mmask16 live = _mm512_mask_cmp_ps_mask(m, s, none, _CMP_NEQ_UQ);  // (exp16 clamps: -inf adds e^-87)
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(s, shift))));
      collect(j, s, m, NEAR[0]);
    }
    const double total = _mm512_reduce_add_ps(sum);
    auto larger = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) { return a.first > b.first; };
    for (float margin : NEAR) {  // (where the words near the largest fall short of top_p, more of them)
      if (margin != NEAR[0]) {
        found.clear();
        for (int64_t j = 0; j < V; j += 16) collect(j, scaled16(j, lanes(V - j)), lanes(V - j), margin);
      }
      const int64_t n = static_cast<int64_t>(found.size());
      double before = 0.0;
      int64_t sorted = 0, i = 0;
      for (int64_t width : {int64_t{1024}, int64_t{16384}, n}) {
        const int64_t upto = std::min(width, n);
        if (upto <= sorted) continue;
        std::partial_sort(found.begin() + sorted, found.begin() + upto, found.end(), larger);
        sorted = upto;
        for (; i < sorted && before < top_p; ++i) {
          floor = found[i].first;
          before += std::exp(static_cast<double>(found[i].first) - top) / total;
        }
        if (before >= top_p) break;
      }
      if (before >= top_p) break;
    }
  }
  const __m512 least = _mm512_set1_ps(floor);
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 m = lanes(V - j);
    _mm512_mask_storeu_ps(out + j, m, none);
    __mmask16 kept = _mm512_mask_cmp_ps_mask(m, scaled16(j, m), least, _CMP_GE_OQ);
    while (kept) {
      const int lane = __builtin_ctz(kept);
      kept &= kept - 1;
      out[j + lane] = scaled(j + lane) + noise_at(key, base + static_cast<uint64_t>(j + lane));
    }
  }
}

}  // namespace

// x [..., V] float32: the index of each row's maximum, int64 [...], as torch's x.max(-1).indices
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1 && x.size(-1) > 0, "float32 rows only");
  x = x.contiguous();
  const int64_t V = x.size(-1), R = x.numel() / V;
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  auto out = torch::empty(sizes, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, std::max<int64_t>(1, LOGIT_GRAIN / V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// x [rows, V] float32 logits: [rows, 2k] float32, each row's k most probable tokens' softmax probabilities
// (largest first; of equal logits the lower token first), then the tokens; rows with fewer than k values that
// are not NaN end with probability 0, token 0
torch::Tensor top_probs(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0, "float32 [rows, V] only");
  TORCH_CHECK(k >= 1 && k <= 64, "k: 1 to 64");
  x = x.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R, 2 * k}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t kk = std::min(k, V);
  at::parallel_for(0, R, std::max<int64_t>(1, LOGIT_GRAIN / V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = op + r * 2 * k;
      top_row(xp + r * V, V, kk, row, row + k);
      for (int64_t i = kk; i < k; ++i) row[i] = row[k + i] = 0.f;
    }
  });
  return out;
}

// counters int64 [...]: coupling.py's Gumbel noise for each, float32 [...] (`noise_at`)
torch::Tensor coupled_noise(torch::Tensor counters, int64_t key) {
  TORCH_CHECK(counters.scalar_type() == at::kLong, "int64 counters");
  counters = counters.contiguous();
  auto out = torch::empty(counters.sizes(), counters.options().dtype(at::kFloat));
  const int64_t* cp = counters.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, counters.numel(), LOGIT_GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) op[i] = noise_at(static_cast<uint64_t>(key), static_cast<uint64_t>(cp[i]));
  });
  return out;
}

// x [rows, V] float32 logits, at [rows] int64 (the position each row scores): each row's coupled scores by
// `row(x row, V, t, the row's first counter (at * vocab), out row, scratch)`, float32 [rows, V], each row alone
// whatever rows share the call (a thread's `Scratch` reused across its rows)
template <typename Scratch, typename Row>
torch::Tensor coupled_rows(torch::Tensor x, torch::Tensor at, double temperature, int64_t vocab, const Row& row) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.size(1) > 0, "float32 [rows, V] only");
  TORCH_CHECK(at.scalar_type() == at::kLong && at.numel() == x.size(0), "at: int64, one a row");
  x = x.contiguous();
  at = at.contiguous();
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R, V}, x.options());
  const float* xp = x.data_ptr<float>();
  const int64_t* ap = at.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  at::parallel_for(0, R, std::max<int64_t>(1, LOGIT_GRAIN / V), [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t r = begin; r < end; ++r)
      row(xp + r * V, V, t, static_cast<uint64_t>(ap[r]) * static_cast<uint64_t>(vocab), op + r * V, scratch);
  });
  return out;
}

// coupled sampling's scores with temperature t, top-k and top-p (1: none): x / t plus the noise of (at * vocab +
// word) for the words whose x / t is at least the k-th largest (ties kept, NaN never) and within top-p of those,
// -inf elsewhere (`coupled_row`)
torch::Tensor coupled_top_k(torch::Tensor x, torch::Tensor at, double temperature, int64_t k, double top_p,
                            int64_t key, int64_t vocab) {
  TORCH_CHECK(k >= 1 && temperature > 0, "k >= 1, temperature > 0");
  const int64_t kk = std::min(k, x.size(-1));
  return coupled_rows<std::vector<float>>(
      x, at, temperature, vocab,
      [&](const float* row, int64_t V, float t, uint64_t base, float* out, std::vector<float>& best) {
        best.reserve(kk + 1);
        coupled_row(row, V, t, kk, top_p, static_cast<uint64_t>(key), base, out, best);
      });
}

// coupled sampling's scores with temperature t and top-p (1: none), no top-k (`coupled_nucleus_row`): x / t plus
// the noise of (at * vocab + word) for the words top-p keeps, or with top_p 1 for the words that can win a draw;
// -inf elsewhere
torch::Tensor coupled_nucleus(torch::Tensor x, torch::Tensor at, double temperature, double top_p, int64_t key,
                              int64_t vocab) {
  TORCH_CHECK(temperature > 0 && top_p > 0, "temperature > 0, top_p > 0");
  return coupled_rows<std::vector<std::pair<float, int64_t>>>(
      x, at, temperature, vocab,
      [&](const float* row, int64_t V, float t, uint64_t base, float* out, std::vector<std::pair<float, int64_t>>& found) {
        coupled_nucleus_row(row, V, t, top_p, static_cast<uint64_t>(key), base, out, found);
      });
}
