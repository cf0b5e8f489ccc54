// int4 weights (scale and zero per group of 32 inputs), 8-bit ones (per group of 32 or 16) and 6-bit ones (llama.cpp's
// Q6_K as it is: an 8-bit scale per 16 inputs under a half-precision one per 256) times bfloat16 activations, on
// AVX-512 VNNI (or AVX2, through avx2.h), computed on
// the blocks directly as llama.cpp does: each row's activations quantized to int8 per group of 32 (for the K-quants,
// Q4_K and Q6_K, per super-block of 256 as llama.cpp's Q8_K), the products summed as integers by vpdpbusd, then
// scaled. A row's result is computed by the same instructions in the same
// order whatever other rows share the call (rows never share a sum), so it is the same bits: exact speculation.
//
// Weight layout (`pack`): [N / 16][groups][4][16][4] bytes. For 16 outputs and one group, four 64-byte vectors;
// vector p holds, for output lane i, inputs 4p..4p+3 of the group in its low nibbles and 4p+16..4p+19 in its high
// ones: q = 0..15, w = (q - 8) * scale + zero. 8 bits: [N / 16][groups][group / 4][16][4] bytes, q + 128. Scales
// and zeros: [groups][N][2] bfloat16 (torch's own layout), or the scales alone, [groups][N], where every zero is 0.
// 6 bits (groups of 16): [N / 16][groups][3][16][4] bytes, q + 32 = 0..63 for inputs 4p..4p+3 (p = 0..3): the low
// four bits of p = 0 and 2 in vector 0 (low and high nibbles), of p = 1 and 3 in vector 1, the top two bits of p =
// 0..3 in vector 2 (bits 2p, 2p + 1); scales: [groups + 2 * supers][N] bytes, a signed 8-bit scale a group, then
// each super-block's half-precision scale, its low bytes and then its high ones (so that products side by side
// concatenate along N), w = d * sc * (q - 32), the file's own values exactly (d * sc is exact in float32). int4
// weights may hold llama.cpp's Q4_K scales as they are instead: [2 * groups + 4 * supers][N] bytes, a 6-bit scale
// sc a group, its 6-bit min mn, then the super-block's half-precision d and dmin (low bytes, high bytes each), w =
// d sc q - dmin mn, exactly.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#ifndef SPEC_AVX2
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// Rows computed together over one pass of the weights, at most. Up to 8 a verifying forward's products cost about
// what one row's do: the weights stream from memory once while every row's sums are computed on them. In passes of 4
// (before), a second pass over each piece waited on the integer units after the first had waited on memory. The
// 1.5B's products in model order (Zen 5, the two builds alternating in one process): 0.85-0.92x the time at 5-12 rows,
// 0.90x at 17, 0.95x at 32; the 0.5B's (mostly 8-bit) 0.83-0.91x at 5-12; 1-4 rows within 4%; the same bits.
#ifdef SPEC_AVX2  // (16 registers, not 32: passes of 4 rows took 0.92-0.96x the time of 8 at 5-16 rows, Zen 3)
constexpr int ROWS = 4;
#else
constexpr int ROWS = 8;
#endif

// x [M, K] bfloat16 -> per row: int8 values, a scale d per SPAN inputs and the (integer) sum of the values per group
// of GROUP: q = x / d rounded to the nearest (ties to even), d = max |x| / 127 over the span, 16 lanes at a time;
// rows spread over threads where there are enough of them (a row's values do not depend on the thread, nor on the
// rows beside it). SPAN = GROUP: a scale a group; 256 for the K-quants (llama.cpp's Q8_K: their super-blocks).
template <int SPAN, int GROUP>
void quantize_rows(const at::BFloat16* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* xs) {
  static_assert(SPAN % GROUP == 0 && GROUP % 16 == 0, "groups of 16 lanes in a span");
  constexpr int V = SPAN / 16, PER = GROUP / 16;
  const int64_t S = K / SPAN, G = K / GROUP;
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  auto row = [&](int64_t m) {
    for (int64_t s = 0; s < S; ++s) {
      const at::BFloat16* src = x + m * K + s * SPAN;
      __m512 v[V];
      __m512 top = _mm512_setzero_ps();
      for (int i = 0; i < V; ++i) {
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * i));
        v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
        top = _mm512_max_ps(top, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v[i]), magnitude)));
      }
      const float scale = _mm512_reduce_max_ps(top) / 127.f;
      const __m512 inverse = _mm512_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
      for (int g = 0; g < SPAN / GROUP; ++g) {
        __m512i sum = _mm512_setzero_si512();
        for (int i = g * PER; i < (g + 1) * PER; ++i) {
          const __m512i r =
              _mm512_cvt_roundps_epi32(_mm512_mul_ps(v[i], inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * K + s * SPAN + 16 * i), _mm512_cvtepi32_epi8(r));
          sum = _mm512_add_epi32(sum, r);
        }
        xs[m * G + s * (SPAN / GROUP) + g] = _mm512_reduce_add_epi32(sum);
      }
      d[m * S + s] = scale;
    }
  };
  at::parallel_for(0, M, std::max<int64_t>(1, (1 << 15) / K), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) row(m);
  });
}

// R rows times NB blocks of 16 outputs: R * NB independent integer sums a group (vpdpbusd's latency is hidden
// by the others), each row and block computed by the same instructions in the same order whatever R and NB are.
// BITS 4: the weights' nibbles (q, w = (q - 8) * scale + zero); BITS 8: bytes (q + 128, w = q * scale + zero).
// SCALES: PAIRS, `sz` holds a (scale, zero) pair a group and output; ALONE, its scale alone, the zero 0 (symmetric
// formats: Q8_0, Q5_0, Q4_0), with the same arithmetic (zero - 128 * scale is -128 * scale exactly); SUPER, the bytes of
// Q6_K's (6 bits) or Q4_K's (4 bits) scales under half-precision super-block ones, as the layouts above say
// (`block_super`); E2M1, MXFP4's (gpt-oss's experts): the nibbles index its 4-bit floats (e2m1, doubled: 0, 1, 2,
// 3, 4, 6, 8, 12 and their negatives, as llama.cpp's kvalues_mxfp4), taken as bytes 12 more (0..24) so that vpdpbusd
// takes them unsigned, w = (v - 12) * 2^(e - 128), the file's exponent byte e a group ([groups, N] bytes).
enum Scales { ALONE, PAIRS, SUPER, E2M1 };

// E2M1's bytes by nibble (each 128-bit lane: vpshufb looks up within lanes), its values 12 more
inline __m512i e2m1_bytes() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
}

// a super-block scale of 16 outputs from its low and high bytes, `rows` bytes apart
inline __m512 halves(const uint8_t* at, int64_t rows) {
  const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
  const __m256i hi = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + rows)));
  return _mm512_cvtph_ps(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 8)));
}

// 16 bytes as 16 floats, signed or not
template <bool SIGNED>
inline __m512 byte_floats(const uint8_t* at) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
  return _mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}

// 16 floats to bfloat16, rounded to the nearest even as torch's float -> bfloat16
inline void store_rounded(__m512 v, at::BFloat16* y) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// Prefetches. The weights of a pass's blocks stream from memory side by side, each a few KB to a few hundred long:
// too short for the hardware's prefetcher to run far enough ahead, so each load asks for its line WEIGHTS_AHEAD bytes
// on; and where a pass takes 3 rows or more (computing longer on each line), the same lines of the next blocks into
// L2.
// Measured on the 1.5B's 126 products a forward (Zen 4, one process, alternating with the build before): 1 row
// 0.96-1.0x the time, 2 rows 0.87x, 4 rows 0.81x, 16 rows 0.87x; the next blocks' lines cost 1-2 rows 3-8% (so not
// there). 8-bit weights (the 0.5B's Q5_0 and Q8_0 at its file's values): passes of 3 rows or more only.
constexpr int64_t WEIGHTS_AHEAD = 1024;

template <int R>
inline void prefetch_weights(const uint8_t* line, int64_t next) {
  _mm_prefetch(reinterpret_cast<const char*>(line + WEIGHTS_AHEAD), _MM_HINT_T0);
  if constexpr (R >= 3) _mm_prefetch(reinterpret_cast<const char*>(line + next), _MM_HINT_T1);
}

// a scale row's line for the next pass: the scales lie [groups, outputs], so a pass over a few blocks reads one
// line from each of a hundred or more rows, a stride no prefetcher follows (each a miss, waited on)
inline void prefetch_scales(const void* at) {
  _mm_prefetch(static_cast<const char*>(at) + 64, _MM_HINT_T0);
}

// sum + the 4-byte products of w and the 32 bits at x broadcast to every lane, the broadcast embedded in the
// instruction (GCC emits a separate vpbroadcastd for _mm512_set1_epi32 of a load: one more op a product)
#ifndef SPEC_AVX2
inline __m512i dpbusd_broadcast(__m512i sum, __m512i w, const int32_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(sum) : "v"(w), "m"(*x));
  return sum;
}
// 8-bit weights: their bytes as they are (q + 128); `block` takes the 128 off with the zero
inline __m512i dpbusd8_broadcast(__m512i sum, __m512i w, const int32_t* x) { return dpbusd_broadcast(sum, w, x); }
constexpr float EIGHT_BIT_OFFSET = 128.f;
#else
inline __m512i dpbusd_broadcast(__m512i sum, __m512i w, const int32_t* x) { return avx2::dpbusd(sum, w, x); }
// 8-bit weights on AVX2: (q + 128 - 128) . x, exact (see avx2.h), so `block` has no 128 to take off
inline __m512i dpbusd8_broadcast(__m512i sum, __m512i w, const int32_t* x) { return avx2::dpbusd8(sum, w, x); }
constexpr float EIGHT_BIT_OFFSET = 0.f;
#endif

// Q6_K's values (q + 32) for 16 outputs and a group, vector p inputs 4p..4p+3, from the layout's three vectors at `at`
inline void six_bit_values(const uint8_t* at, __m512i (&v)[4]) {
  const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  const __m512i a = _mm512_loadu_si512(at), c = _mm512_loadu_si512(at + 64), h = _mm512_loadu_si512(at + 128);
  v[0] = _mm512_or_si512(_mm512_and_si512(a, low), _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
  v[1] = _mm512_or_si512(_mm512_and_si512(c, low), _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
  v[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(a, 4), low), _mm512_and_si512(h, top));
  v[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(c, 4), low), _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
}

#ifdef SPEC_AVX2
// the 32 bits at `at` in every lane, loaded where it is used
inline __m256i load_broadcast(const int32_t* at) {
  __m256i v;
  asm volatile("vpbroadcastd %1, %0" : "=x"(v) : "m"(*at));
  return v;
}

// v as computed here, not reassociated with the sums after it
inline void keep(__m256i& v) { asm("" : "+x"(v)); }

#endif

// One group's integer sums, R rows times NB blocks of 16 outputs, added to `sum`: BITS 4, the nibbles (vector p:
// inputs 4p..4p+3 low, 4p+16..4p+19 high); 8, bytes (vector p: inputs 4p..4p+3); 6, Q6_K's layout above
template <int R, int NB, int BITS, int GROUP, bool TABLE = false>
inline void group_sums(const uint8_t* w, int64_t block_bytes, int64_t g, const int8_t* q, int64_t K,
                       __m512i (&sum)[R][NB]) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  [[maybe_unused]] const __m512i table = e2m1_bytes();
#ifdef SPEC_AVX2
  // AVX2: vpmaddubsw's 16-bit pair sums added in 16 bits as far as they cannot overflow, then widened once by
  // vpmaddwd, instead of a vpmaddwd and an add each: a group's eight 4-bit products (|8 x 2 x 15 x 127| < 2^15),
  // Q6_K's products two by two (|2 x 2 x 63 x 127| < 2^15). Integers: the same sums, whatever the grouping.
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (BITS == 4) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256i pairs[R][NB][2];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) pairs[r][b][0] = pairs[r][b][1] = _mm256_setzero_si256();
    // (as `block_super_avx2`: a row's two broadcasts serve both halves, the running sums kept in order)
    #pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      for (int b = 0; b < NB; ++b) {
        const uint8_t* at = w + b * block_bytes + (g * 4 + p) * 64;
        prefetch_weights<R>(at, NB * block_bytes);
        const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
        const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32));
        __m256i lo0 = _mm256_and_si256(v0, nibble), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
        __m256i lo1 = _mm256_and_si256(v1, nibble), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
        if constexpr (TABLE) {
          lo0 = _mm256_shuffle_epi8(table.lo, lo0), hi0 = _mm256_shuffle_epi8(table.lo, hi0);
          lo1 = _mm256_shuffle_epi8(table.lo, lo1), hi1 = _mm256_shuffle_epi8(table.lo, hi1);
        }
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(q + r * K + g * GROUP);
          const __m256i low = load_broadcast(xq + p), high = load_broadcast(xq + p + 4);
          pairs[r][b][0] = _mm256_add_epi16(pairs[r][b][0], _mm256_maddubs_epi16(lo0, low));
          pairs[r][b][1] = _mm256_add_epi16(pairs[r][b][1], _mm256_maddubs_epi16(lo1, low));
          pairs[r][b][0] = _mm256_add_epi16(pairs[r][b][0], _mm256_maddubs_epi16(hi0, high));
          pairs[r][b][1] = _mm256_add_epi16(pairs[r][b][1], _mm256_maddubs_epi16(hi1, high));
          keep(pairs[r][b][0]);
          keep(pairs[r][b][1]);
          if constexpr (TABLE) {  // (E2M1's bytes reach 24: |2 x 2 x 24 x 127| < 2^15, four of them would not be)
            sum[r][b].lo = _mm256_add_epi32(sum[r][b].lo, _mm256_madd_epi16(pairs[r][b][0], ones));
            sum[r][b].hi = _mm256_add_epi32(sum[r][b].hi, _mm256_madd_epi16(pairs[r][b][1], ones));
            pairs[r][b][0] = pairs[r][b][1] = _mm256_setzero_si256();
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) {
        sum[r][b].lo = _mm256_add_epi32(sum[r][b].lo, _mm256_madd_epi16(pairs[r][b][0], ones));
        sum[r][b].hi = _mm256_add_epi32(sum[r][b].hi, _mm256_madd_epi16(pairs[r][b][1], ones));
      }
    return;
  }
  if constexpr (BITS == 6) {
    for (int b = 0; b < NB; ++b) {
      const uint8_t* at = w + b * block_bytes + g * 192;
      for (int l = 0; l < 3; ++l) prefetch_weights<R>(at + l * 64, NB * block_bytes);
      __m512i values[4];
      six_bit_values(at, values);
      for (int h = 0; h < 2; ++h) {
        const __m256i v[4] = {h == 0 ? values[0].lo : values[0].hi, h == 0 ? values[1].lo : values[1].hi,
                              h == 0 ? values[2].lo : values[2].hi, h == 0 ? values[3].lo : values[3].hi};
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(q + r * K + g * GROUP);
          const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], _mm256_set1_epi32(xq[0])),
                                                 _mm256_maddubs_epi16(v[1], _mm256_set1_epi32(xq[1])));
          const __m256i second = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], _mm256_set1_epi32(xq[2])),
                                                  _mm256_maddubs_epi16(v[3], _mm256_set1_epi32(xq[3])));
          __m256i& into = h == 0 ? sum[r][b].lo : sum[r][b].hi;
          into = _mm256_add_epi32(into, _mm256_add_epi32(_mm256_madd_epi16(first, ones), _mm256_madd_epi16(second, ones)));
        }
      }
    }
    return;
  }
#endif
  if constexpr (BITS == 4) {
    for (int p = 0; p < 4; ++p) {
      for (int b = 0; b < NB; ++b) {
        prefetch_weights<R>(w + b * block_bytes + (g * 4 + p) * 64, NB * block_bytes);
        const __m512i v = _mm512_loadu_si512(w + b * block_bytes + (g * 4 + p) * 64);
        __m512i lo = _mm512_and_si512(v, low);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (TABLE) lo = _mm512_shuffle_epi8(table, lo), hi = _mm512_shuffle_epi8(table, hi);
        #pragma GCC unroll 8  // (else at 6-7 rows GCC keeps a loop and the sums in memory: 1.6x the time)
        for (int r = 0; r < R; ++r) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(q + r * K + g * GROUP);
          sum[r][b] = dpbusd_broadcast(sum[r][b], lo, xq + p);
          sum[r][b] = dpbusd_broadcast(sum[r][b], hi, xq + p + 4);
        }
      }
    }
  } else if constexpr (BITS == 6) {
    for (int b = 0; b < NB; ++b) {
      const uint8_t* at = w + b * block_bytes + g * 192;
      for (int l = 0; l < 3; ++l) prefetch_weights<R>(at + l * 64, NB * block_bytes);
      __m512i v[4];
      six_bit_values(at, v);
      #pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* xq = reinterpret_cast<const int32_t*>(q + r * K + g * GROUP);
        for (int p = 0; p < 4; ++p) sum[r][b] = dpbusd_broadcast(sum[r][b], v[p], xq + p);
      }
    }
  } else {
    for (int p = 0; p < GROUP / 4; ++p) {
      for (int b = 0; b < NB; ++b) {
        if constexpr (R >= 3)  // (8-bit passes of 1 row were 1.03x the time with it, of 4 rows 0.85-0.90x)
          prefetch_weights<R>(w + b * block_bytes + (g * (GROUP / 4) + p) * 64, NB * block_bytes);
        const __m512i v = _mm512_loadu_si512(w + b * block_bytes + (g * (GROUP / 4) + p) * 64);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int32_t* xq = reinterpret_cast<const int32_t*>(q + r * K + g * GROUP);
          sum[r][b] = dpbusd8_broadcast(sum[r][b], v, xq + p);
        }
      }
    }
  }
}

template <int R, int NB, int BITS, int GROUP, int SCALES>
inline void block(const uint8_t* w, int64_t block_bytes, const void* scales_, int64_t N, int64_t G,
                  const int8_t* q, const float* d, const float* dsum, int64_t K, int64_t n0, at::BFloat16* y,
                  int64_t ldy) {
  static_assert(SCALES != SUPER && BITS != 6, "super-blocks: block_super");
  const at::BFloat16* sz = static_cast<const at::BFloat16*>(scales_);
  const __m512i high_words = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i sum[R][NB];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) sum[r][b] = _mm512_setzero_si512();
    constexpr int64_t WIDTH = SCALES == PAIRS ? 4 : SCALES == E2M1 ? 1 : 2;  // (bytes of an output's scale)
    constexpr int64_t PASS = NB * 16 * WIDTH;  // (a pass's bytes of a row of scales)
    for (int64_t l = 0; l < PASS; l += 64)
      prefetch_scales(static_cast<const uint8_t*>(scales_) + (g * N + n0) * WIDTH + PASS - 64 + l);
    group_sums<R, NB, BITS, GROUP, SCALES == E2M1>(w, block_bytes, g, q, K, sum);
    for (int b = 0; b < NB; ++b) {
      __m512 scale, zero;  // w = scale * q + offset, q as the layout holds it (unsigned)
      if constexpr (SCALES == PAIRS) {
        const __m512i pairs = _mm512_loadu_si512(sz + (g * N + n0 + b * 16) * 2);  // 16 x (scale, zero)
        scale = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        zero = _mm512_castsi512_ps(_mm512_and_si512(pairs, high_words));
      } else if constexpr (SCALES == E2M1) {  // 2^(e - 127) as a float's bits (e = 0: 2^-127), halved: 2^(e - 128)
        const __m512i e = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(scales_) + g * N + n0 + b * 16)));
        const __m512i bits = _mm512_max_epi32(_mm512_slli_epi32(e, 23), _mm512_set1_epi32(0x00400000));
        scale = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0.5f));
        zero = _mm512_setzero_ps();
      } else {
        const __m256i scales = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + g * N + n0 + b * 16));
        scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(scales), 16));
        zero = _mm512_setzero_ps();
      }
      const __m512 offset = _mm512_fnmadd_ps(  // zero - 8 (128; E2M1 12) scale
          _mm512_set1_ps(SCALES == E2M1 ? 12.f : BITS == 4 ? 8.f : EIGHT_BIT_OFFSET), scale, zero);
      for (int r = 0; r < R; ++r) {
        acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][b]), _mm512_mul_ps(scale, _mm512_set1_ps(d[r * G + g])),
                                    acc[r][b]);
        acc[r][b] = _mm512_fmadd_ps(offset, _mm512_set1_ps(dsum[r * G + g]), acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) store_rounded(acc[r][b], y + r * ldy + n0 + b * 16);
}

// llama.cpp's Q4_K (BITS 4) and Q6_K (BITS 6) as they are, against activations quantized per super-block
// (`quantize_rows` over spans of 256: one scale d_x a row and 256 inputs, the sum xs of each group's values). Within a
// super-block every group's scale applies to integers, so a row's work past vpdpbusd is one multiply-add a group
// for Q6_K (sc (isum - 32 xs), the sum started at -32 xs), two for Q4_K (sc isum; mn xs, the mins), and the
// super-block's half-precision scales and d_x once at its end (per group of 32 there were three, and four a group of
// 16 for Q6_K). vpdpbusd and float multiplies share two of Zen 4's four vector pipes (one each a cycle), so these
// are what a row beyond the first costs: Q6_K's products of 8-16 rows take 0.81-0.86x the time (4 rows
// 0.83-0.98x), Q4_K's of 8-16 rows 0.95x. The same instructions in the same order for a row whatever R and NB are.
template <int R, int NB, int BITS>
inline void block_super(const uint8_t* w, int64_t block_bytes, const uint8_t* bytes, int64_t N, int64_t G,
                        const int8_t* q, const float* dx, const void* xs_, int64_t K, int64_t n0, at::BFloat16* y,
                        int64_t ldy) {
  constexpr int GROUP = BITS == 6 ? 16 : 32, PER_SUPER = 256 / GROUP;
  const int64_t S = G / PER_SUPER;
  const int64_t scale_rows = BITS == 6 ? G : 2 * G;  // the rows of bytes before the super-blocks' scales
  // each group's sum of a row's values as the kernel takes it (`grouped_product`): Q6_K -32 xs, Q4_K xs as a float
  const int32_t* xs = static_cast<const int32_t*>(xs_);
  const float* xf = static_cast<const float*>(xs_);
  __m512 acc[R][NB];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m512 scaled[R][NB], mins[R][NB];  // over the super-block's groups: sc isum (Q6_K: sc (isum - 32 xs)); mn xs
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < NB; ++b) scaled[r][b] = mins[r][b] = _mm512_setzero_ps();
    for (int64_t g = s * PER_SUPER; g < (s + 1) * PER_SUPER; ++g) {
      __m512i sum[R][NB];  // Q6_K: from -32 xs (q as held is q + 32: the sum is that of (q - 32) x, exactly)
      for (int r = 0; r < R; ++r)
        for (int b = 0; b < NB; ++b)
          sum[r][b] = BITS == 6 ? _mm512_set1_epi32(xs[r * G + g]) : _mm512_setzero_si512();
      prefetch_scales(bytes + g * N + n0);
      if constexpr (BITS == 4) prefetch_scales(bytes + (G + g) * N + n0);
      group_sums<R, NB, BITS, GROUP>(w, block_bytes, g, q, K, sum);
      for (int b = 0; b < NB; ++b) {
        if constexpr (BITS == 6) {
          const __m512 sc = byte_floats<true>(bytes + g * N + n0 + b * 16);
          for (int r = 0; r < R; ++r) scaled[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][b]), sc, scaled[r][b]);
        } else {
          const __m512 sc = byte_floats<false>(bytes + g * N + n0 + b * 16);
          const __m512 mn = byte_floats<false>(bytes + (G + g) * N + n0 + b * 16);
          for (int r = 0; r < R; ++r) {
            scaled[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r][b]), sc, scaled[r][b]);
            mins[r][b] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xf[r * G + g]), mins[r][b]);
          }
        }
      }
    }
    for (int64_t k = 0; k < (BITS == 6 ? 2 : 4); ++k) prefetch_scales(bytes + (scale_rows + s + k * S) * N + n0);
    for (int b = 0; b < NB; ++b) {  // y += d_x (d scaled - dmin mins)
      const uint8_t* at = bytes + (scale_rows + s) * N + n0 + b * 16;
      const __m512 d = halves(at, S * N);
      if constexpr (BITS == 6) {
        for (int r = 0; r < R; ++r)
          acc[r][b] = _mm512_fmadd_ps(scaled[r][b], _mm512_mul_ps(d, _mm512_set1_ps(dx[r * S + s])), acc[r][b]);
      } else {
        const __m512 dmin = halves(at + 2 * S * N, S * N);
        for (int r = 0; r < R; ++r)
          acc[r][b] = _mm512_fmadd_ps(_mm512_fnmadd_ps(mins[r][b], dmin, _mm512_mul_ps(scaled[r][b], d)),
                                      _mm512_set1_ps(dx[r * S + s]), acc[r][b]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < NB; ++b) store_rounded(acc[r][b], y + r * ldy + n0 + b * 16);
}

#ifdef SPEC_AVX2
// The K-quants on AVX2. Within a super-block the groups' scales and mins are integers (6 or 8 bits), so they are
// applied to the integer sums by the vpmaddwd that widens vpmaddubsw's 16-bit pairs (llama.cpp's AVX2 form), and
// the mins' (Q4_K) or the 32 offset's (Q6_K) part is a product of the integer sums xs of a row's groups: a row's
// floating-point work is once a super-block, not once a group. A pass takes one block of 16 outputs, as two halves
// of 8, and at most 4 rows: a group's running 16-bit pairs (8 vectors) and the block's unpacked nibbles (4) take
// most of AVX2's 16 registers, so a row's two broadcasts serve both halves and are loaded where used
// (`load_broadcast`), and each running sum is kept in order (`keep`): the compiler otherwise reassociates the adds,
// holds every product at once and spills them (4 rows took 1.45x the time without it). Integers: the same sums
// whatever the grouping; a row's bits never depend on the rows beside it (nor are they the AVX-512 build's: that
// one applies the groups' scales in float). The 1.5B's Q4_K product (17920 x 1536), two builds alternating in one
// process, Zen 3: 4 rows 0.79-0.84x the time of `block_super` through avx2.h, 8 rows 0.77-0.79x; Q6_K (1536 x 8960)
// 0.89-0.97x; the whole layer from memory (14 layers, 460 MB): 1 row 0.92x, 2 rows 1.00x, 4 rows 0.92x, 8 rows 0.83x.

// 8 outputs' scale bytes as the pair (s, s) of 16-bit integers in each 32-bit lane
template <bool SIGNED>
inline __m256i scale_pairs(const uint8_t* at) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at));
  const __m256i s = SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
  return _mm256_or_si256(_mm256_and_si256(s, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(s, 16));
}

// 8 outputs' bytes of two groups (rows of bytes `rows` apart) as the pair (group g, group g + 1) in each lane
template <bool SIGNED>
inline __m256i group_pairs(const uint8_t* at, int64_t rows) {
  const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at));
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + rows));
  const __m128i both = _mm_unpacklo_epi8(a, b);
  return SIGNED ? _mm256_cvtepi8_epi16(both) : _mm256_cvtepu8_epi16(both);
}

// Q6_K's values (q + 32) for 8 outputs (half h of a block) and a group, vector p inputs 4p..4p+3
inline void six_bit_half(const uint8_t* at, int h, __m256i (&v)[4]) {
  const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32 * h));
  const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 64 + 32 * h));
  const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 128 + 32 * h));
  v[0] = _mm256_or_si256(_mm256_and_si256(a, low), _mm256_and_si256(_mm256_slli_epi16(e, 4), top));
  v[1] = _mm256_or_si256(_mm256_and_si256(c, low), _mm256_and_si256(_mm256_slli_epi16(e, 2), top));
  v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low), _mm256_and_si256(e, top));
  v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), low), _mm256_and_si256(_mm256_srli_epi16(e, 2), top));
}

// one row's products of those values (its 16 inputs at xq) under the group's scales `sc` (`scale_pairs`), added to
// `sum`: two vpmaddubsw's 16-bit pairs added before widening cannot overflow (2 x 2 x 63 x 127 < 2^15)
inline void add_six_bit_row(__m256i& sum, const __m256i (&v)[4], __m256i sc, const int32_t* xq) {
  const __m256i first = _mm256_add_epi16(_mm256_maddubs_epi16(v[0], load_broadcast(xq)),
                                         _mm256_maddubs_epi16(v[1], load_broadcast(xq + 1)));
  const __m256i second = _mm256_add_epi16(_mm256_maddubs_epi16(v[2], load_broadcast(xq + 2)),
                                          _mm256_maddubs_epi16(v[3], load_broadcast(xq + 3)));
  sum = _mm256_add_epi32(sum, _mm256_add_epi32(_mm256_madd_epi16(first, sc), _mm256_madd_epi16(second, sc)));
  keep(sum);
}

// the part of a super-block's sums from the groups' sums of x, for half h of a block (8 outputs) and R rows, added
// to each row's float sums: Q4_K d sc q x - dmin mn xs (the mins), Q6_K d sc (q + 32 - 32) x (the values' 32)
template <int R, int BITS>
inline void super_block_end(const uint8_t* bytes, int64_t N, int64_t G, int64_t s, int64_t n0, int h,
                            const int32_t* xs, const float* dx, const __m256i (&sums)[R], __m256 (&acc)[R]) {
  constexpr int PER_SUPER = BITS == 6 ? 16 : 8;
  const int64_t S = G / PER_SUPER, first = s * PER_SUPER, part_rows = BITS == 6 ? 0 : G;
  const int64_t scale_rows = BITS == 6 ? G : 2 * G;  // the rows of bytes before the super-blocks' scales
  const uint8_t* at = bytes + (scale_rows + s) * N + n0 + 8 * h;
  const __m256 d = _mm256_cvtph_ps(_mm_or_si128(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))),
                                                _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(
                                                    reinterpret_cast<const __m128i*>(at + S * N))), 8)));
  __m256 dmin = _mm256_setzero_ps();
  if constexpr (BITS == 4)
    dmin = _mm256_cvtph_ps(_mm_or_si128(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at + 2 * S * N))),
                                        _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(
                                            reinterpret_cast<const __m128i*>(at + 3 * S * N))), 8)));
  __m256i part[R];
  for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
  for (int64_t g = first; g < first + PER_SUPER; g += 2) {
    const __m256i both = group_pairs<BITS == 6>(bytes + (part_rows + g) * N + n0 + 8 * h, N);
    for (int r = 0; r < R; ++r)
      part[r] = _mm256_add_epi32(part[r], _mm256_madd_epi16(both, _mm256_set1_epi32(xs[r * G + g / 2])));
  }
  for (int r = 0; r < R; ++r) {
    const __m256 scale = _mm256_set1_ps(dx[r * S + s]);
    if constexpr (BITS == 6) {  // d sc (q + 32 - 32) x
      const __m256i exact = _mm256_sub_epi32(sums[r], _mm256_slli_epi32(part[r], 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(d, scale), acc[r]);
    } else {  // d sc q x - dmin mn xs
      const __m256 value = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(part[r]), dmin,
                                            _mm256_mul_ps(_mm256_cvtepi32_ps(sums[r]), d));
      acc[r] = _mm256_fmadd_ps(value, scale, acc[r]);
    }
  }
}

// Q6_K's passes of 5 to 8 rows: one half of the block (8 outputs) at a time, so that a row's running sums stay in
// registers (both halves' take two each: beyond 4 rows they would spill), and the values are unpacked once for up
// to 8 rows. Q6_K's broadcasts serve one half either way. The 1.5B's Q6_K products (1536 x 8960, a quarter of its
// head), two builds alternating in one process, Zen 3, against passes of 4: 5-16 rows 0.85-0.91x the time, 4 rows
// this way 1.0-1.09x (so not). Q4_K this way (8-row passes) took 1.16-1.21x the time at 5-10 rows: a Q4_K row's
// broadcast serves both halves, so its passes stay at 4 (`block_super_avx2`). The same integer sums.
template <int R>
inline void block_six_halves(const uint8_t* w, int64_t block_bytes, const uint8_t* bytes, int64_t N, int64_t G,
                             const int8_t* q, const float* dx, const void* xs_, int64_t K, int64_t n0,
                             at::BFloat16* y, int64_t ldy) {
  constexpr int GROUP = 16, PER_SUPER = 16;
  const int64_t S = G / PER_SUPER;
  const int32_t* xs = static_cast<const int32_t*>(xs_);
  __m256 out[R][2];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t s = 0; s < S; ++s) {
      __m256i sums[R];  // sc (q + 32) x over the super-block's groups
      for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
      for (int64_t g = s * PER_SUPER; g < (s + 1) * PER_SUPER; ++g) {
        prefetch_scales(bytes + g * N + n0);
        const uint8_t* at = w + g * 192;
        if (h == 0)
          for (int l = 0; l < 3; ++l) prefetch_weights<R>(at + l * 64, block_bytes);
        __m256i v[4];
        six_bit_half(at, h, v);
        const __m256i sc = scale_pairs<true>(bytes + g * N + n0 + 8 * h);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          add_six_bit_row(sums[r], v, sc, reinterpret_cast<const int32_t*>(q + r * K + g * GROUP));
        }
      }
      for (int64_t k = 0; k < 2; ++k) prefetch_scales(bytes + (G + s + k * S) * N + n0);
      super_block_end<R, 6>(bytes, N, G, s, n0, h, xs, dx, sums, acc);
    }
    for (int r = 0; r < R; ++r) out[r][h] = acc[r];
  }
  for (int r = 0; r < R; ++r) store_rounded(__m512{out[r][0], out[r][1]}, y + r * ldy + n0);
}

// R rows (at most 4: Q6_K's passes of more are `block_six_halves`) times one block of 16 outputs, llama.cpp's
// Q4_K (BITS 4) or Q6_K (BITS 6) as they are; `xs_` the integer sums of each row's groups two by two, as 16-bit
// pairs (|xs| < 2^15), as `grouped_product` gives them
template <int R, int BITS>
inline void block_super_avx2(const uint8_t* w, int64_t block_bytes, const uint8_t* bytes, int64_t N, int64_t G,
                             const int8_t* q, const float* dx, const void* xs_, int64_t K, int64_t n0,
                             at::BFloat16* y, int64_t ldy) {
  constexpr int GROUP = BITS == 6 ? 16 : 32, PER_SUPER = 256 / GROUP;
  const int64_t S = G / PER_SUPER;
  const int64_t scale_rows = BITS == 6 ? G : 2 * G;  // the rows of bytes before the super-blocks' scales
  const int32_t* xs = static_cast<const int32_t*>(xs_);
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    __m256i sums[R][2];  // sc (q + 32) x (Q6_K), sc q x (Q4_K), over the super-block's groups
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    for (int64_t g = s * PER_SUPER; g < (s + 1) * PER_SUPER; ++g) {
      prefetch_scales(bytes + g * N + n0);
      if constexpr (BITS == 4) {
        prefetch_scales(bytes + (G + g) * N + n0);
        __m256i pairs[R][2];
        for (int r = 0; r < R; ++r) pairs[r][0] = pairs[r][1] = _mm256_setzero_si256();
        #pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const uint8_t* at = w + (g * 4 + p) * 64;
          prefetch_weights<R>(at, block_bytes);
          const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
          const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32));
          const __m256i lo0 = _mm256_and_si256(v0, nibble), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
          const __m256i lo1 = _mm256_and_si256(v1, nibble), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
          #pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const int32_t* xq = reinterpret_cast<const int32_t*>(q + r * K + g * GROUP);
            const __m256i low = load_broadcast(xq + p), high = load_broadcast(xq + p + 4);
            pairs[r][0] = _mm256_add_epi16(pairs[r][0], _mm256_maddubs_epi16(lo0, low));
            pairs[r][1] = _mm256_add_epi16(pairs[r][1], _mm256_maddubs_epi16(lo1, low));
            pairs[r][0] = _mm256_add_epi16(pairs[r][0], _mm256_maddubs_epi16(hi0, high));
            pairs[r][1] = _mm256_add_epi16(pairs[r][1], _mm256_maddubs_epi16(hi1, high));
            keep(pairs[r][0]);
            keep(pairs[r][1]);
          }
        }
        for (int h = 0; h < 2; ++h) {
          const __m256i sc = scale_pairs<false>(bytes + g * N + n0 + 8 * h);
          for (int r = 0; r < R; ++r) sums[r][h] = _mm256_add_epi32(sums[r][h], _mm256_madd_epi16(pairs[r][h], sc));
        }
      } else {
        const uint8_t* at = w + g * 192;
        for (int l = 0; l < 3; ++l) prefetch_weights<R>(at + l * 64, block_bytes);
        for (int h = 0; h < 2; ++h) {
          __m256i v[4];
          six_bit_half(at, h, v);
          const __m256i sc = scale_pairs<true>(bytes + g * N + n0 + 8 * h);
          for (int r = 0; r < R; ++r) {
            add_six_bit_row(sums[r][h], v, sc, reinterpret_cast<const int32_t*>(q + r * K + g * GROUP));
          }
        }
      }
    }
    for (int64_t k = 0; k < (BITS == 6 ? 2 : 4); ++k) prefetch_scales(bytes + (scale_rows + s + k * S) * N + n0);
    for (int h = 0; h < 2; ++h) {
      __m256i half_sums[R];
      __m256 half_acc[R];
      for (int r = 0; r < R; ++r) half_sums[r] = sums[r][h], half_acc[r] = acc[r][h];
      super_block_end<R, BITS>(bytes, N, G, s, n0, h, xs, dx, half_sums, half_acc);
      for (int r = 0; r < R; ++r) acc[r][h] = half_acc[r];
    }
  }
  for (int r = 0; r < R; ++r) store_rounded(__m512{acc[r][0], acc[r][1]}, y + r * ldy + n0);
}
#endif

// Rows a pass takes at most: ROWS; on AVX2 Q6_K's 8 (`block_six_halves`)
constexpr int rows_a_pass(int bits, int scales) {
#ifdef SPEC_AVX2
  if (scales == SUPER && bits == 6) return 8;
#endif
  return ROWS;
}

// Blocks of 16 outputs a pass takes side by side: several where a pass has few rows, so that its sums overlap (one
// block's sums alone wait on vpdpbusd's latency). On AMD's cores 4-bit weights stream faster from memory one block at
// a time (`one_stream`): at one row (Zen 5, every product of a model in order, the two ways alternating in one
// process) the 0.5B's int4 (scale, zero) pairs took 0.89-0.90x the time with one block against four, the 1.5B's Q4_K
// 0.97x; at 2-4 rows the pairs 0.92-0.97x, Q4_K within 3% either way. On Intel's the other way (Emerald Rapids Xeon,
// forwards of the real models, the builds alternating): at one row the 1.5B's Q4_K 0.93-0.94x the time with four,
// the 0.5B's pairs 0.87-0.93x, a Q4_0 Llama 1B's scales alone about 0.88x; the pairs at 2 and 4 rows 0.90x and 0.94x.
// 8-bit and 6-bit weights keep several everywhere: at one row 8-bit with one block was 1.02-1.05x the time (Zen 5).
constexpr int blocks_a_pass(int rows, int bits, int scales, bool one) {
#ifdef SPEC_AVX2
  if (scales == SUPER) return 1;  // (block_super_avx2)
  one = true;  // (an AVX2 build keeps the rule it was measured with)
#endif
  if (rows >= 5) return 1;
  if (one && bits == 4 && (rows == 1 || scales == PAIRS)) return 1;
  return rows >= 3 ? 2 : 4;
}

template <int R, int NB, int BITS, int GROUP, int SCALES>
inline void rows(const uint8_t* wp, int64_t block_bytes, const void* sz, int64_t N, int64_t G, const int8_t* q,
                 const float* d, const void* sums, int64_t K, at::BFloat16* y, int64_t begin, int64_t end) {
  auto one = [&](auto nb, int64_t b) {
    constexpr int B = decltype(nb)::value;
    if constexpr (SCALES == SUPER)
#ifdef SPEC_AVX2  // (one block a pass: `blocks_a_pass`)
      if constexpr (BITS == 6 && R > 4)  // (`rows_a_pass`)
        block_six_halves<R>(wp + b * block_bytes, block_bytes, static_cast<const uint8_t*>(sz), N, G, q, d, sums,
                            K, b * 16, y, N);
      else
        block_super_avx2<R, BITS>(wp + b * block_bytes, block_bytes, static_cast<const uint8_t*>(sz), N, G, q, d,
                                  sums, K, b * 16, y, N);
#else
      block_super<R, B, BITS>(wp + b * block_bytes, block_bytes, static_cast<const uint8_t*>(sz), N, G, q, d,
                              sums, K, b * 16, y, N);
#endif
    else
      block<R, B, BITS, GROUP, SCALES>(wp + b * block_bytes, block_bytes, sz, N, G, q, d,
                                       static_cast<const float*>(sums), K, b * 16, y, N);
  };
  int64_t b = begin;
  for (; b + NB <= end; b += NB) one(std::integral_constant<int, NB>{}, b);
  for (; b < end; ++b) one(std::integral_constant<int, 1>{}, b);
}

}  // namespace

#ifndef SPEC_AVX2
// AMX (Xeons since Sapphire Rapids): Q4_K's products of many rows (a prompt's read, a server's batch) take each
// group's integer sums for 16 rows and 16 outputs from one tile product (tdpbsud: the rows' int8 values times the
// weights' nibbles as bytes), stored, and then scale them by `block_super`'s instructions in its order, a row at a
// time: integer sums are the same whoever sums them, so every row has the bits it has in VNNI's passes (and alone).
// A block's weights are unpacked once into tiles' rows and serve every 16 rows; the rows past the last 16 run on
// VNNI. Session 30 tried tiles for every row count (a pass of up to 16 rows unpacking its weights): slower.
namespace amx {

constexpr int64_t FROM = 64;  // rows a Q4_K product takes at least for tiles

// the CPU has AMX's tiles and int8 products (CPUID 7: EDX bits 24, 25), Linux gave this process their state
// (without arch_prctl's ARCH_REQ_XCOMP_PERM a first tile instruction is an illegal one), SPEC_AMX is not 0
bool available() {
  static const bool yes = [] {
    const char* flag = std::getenv("SPEC_AMX");
    if (flag != nullptr && std::strcmp(flag, "0") == 0) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return yes;
}

struct alignas(64) Config {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tile instructions as asm that names the memory each reads or writes (GCC 12's intrinsics tell the compiler
// neither ldtilecfg's 64 bytes nor tileloadd's rows, so it may drop or move the stores before them), tiles by number.
#define SPEC_TILE_LOAD(T, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define SPEC_TILE_STORE(T, base, stride) \
  asm volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define SPEC_TILE_ZERO(T) asm volatile("tilezero %%tmm" #T ::)
#define SPEC_TILE_DPBSUD(C, A, B) asm volatile("tdpbsud %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)

// tile 0: 16 rows' values of a group [16][32]; 1: a block's weights of the group [8 rows of 4 inputs][16 x 4];
// 2: the sums [16][16]
inline void configure() {
  Config c;
  c.rows[0] = 16, c.colsb[0] = 32;
  c.rows[1] = 8, c.colsb[1] = 64;
  c.rows[2] = 16, c.colsb[2] = 64;
  asm volatile("ldtilecfg %0" ::"m"(c) : "memory");
}

inline void release() { asm volatile("tilerelease" ::: "memory"); }

// Q4_K (spec's layout, `block_super`'s arguments): rows [0, M16) (a multiple of 16) times blocks [begin, end)
void q4k(const uint8_t* wp, int64_t block_bytes, const uint8_t* bytes, int64_t N, int64_t G, const int8_t* q,
         const float* dx, const float* xf, int64_t K, at::BFloat16* y, int64_t M16, int64_t begin, int64_t end) {
  constexpr int PER_SUPER = 8;
  const int64_t S = G / PER_SUPER;
  // blocks unpacked together (about 256 KB: in L2), then every 16 rows over them (their values in L1)
  const int64_t chunk = std::max<int64_t>(1, (256 << 10) / (G * 512));
  std::vector<uint8_t> held(chunk * G * 512 + 64);
  uint8_t* unpacked = held.data() + (64 - reinterpret_cast<uintptr_t>(held.data()) % 64) % 64;  // [chunk][G][8][64]
  alignas(64) int32_t sums[PER_SUPER][16][16];
  const __m512i low = _mm512_set1_epi8(0x0F);
  configure();
  for (int64_t first = begin; first < end; first += chunk) {
    const int64_t last = std::min(end, first + chunk);
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* w = wp + b * block_bytes;
      uint8_t* into = unpacked + (b - first) * G * 512;
      for (int64_t g = 0; g < G; ++g)
        for (int p = 0; p < 4; ++p) {  // tile row p: inputs 4p..4p+3 (low nibbles); 4 + p: 16 + 4p.. (high)
          const __m512i v = _mm512_loadu_si512(w + (g * 4 + p) * 64);
          _mm512_store_si512(into + g * 512 + p * 64, _mm512_and_si512(v, low));
          _mm512_store_si512(into + g * 512 + (4 + p) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
    for (int64_t r0 = 0; r0 < M16; r0 += 16) {
      for (int64_t b = first; b < last; ++b) {
        const uint8_t* from = unpacked + (b - first) * G * 512;
        const int64_t n0 = b * 16;
        __m512 acc[16];
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t s = 0; s < S; ++s) {
          for (int i = 0; i < PER_SUPER; ++i) {
            const int64_t g = s * PER_SUPER + i;
            SPEC_TILE_LOAD(0, q + r0 * K + g * 32, K);
            SPEC_TILE_LOAD(1, from + g * 512, 64);
            SPEC_TILE_ZERO(2);
            SPEC_TILE_DPBSUD(2, 0, 1);
            SPEC_TILE_STORE(2, sums[i], 64);
          }
          __m512 sc[PER_SUPER], mn[PER_SUPER];
          for (int i = 0; i < PER_SUPER; ++i) {
            const int64_t g = s * PER_SUPER + i;
            sc[i] = byte_floats<false>(bytes + g * N + n0);
            mn[i] = byte_floats<false>(bytes + (G + g) * N + n0);
          }
          const uint8_t* at = bytes + (2 * G + s) * N + n0;
          const __m512 d = halves(at, S * N), dmin = halves(at + 2 * S * N, S * N);
          for (int r = 0; r < 16; ++r) {  // (block_super's instructions for a row, in its order)
            __m512 scaled = _mm512_setzero_ps(), mins = _mm512_setzero_ps();
            for (int i = 0; i < PER_SUPER; ++i) {
              scaled = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[i][r])), sc[i], scaled);
              mins = _mm512_fmadd_ps(mn[i], _mm512_set1_ps(xf[(r0 + r) * G + s * PER_SUPER + i]), mins);
            }
            acc[r] = _mm512_fmadd_ps(_mm512_fnmadd_ps(mins, dmin, _mm512_mul_ps(scaled, d)),
                                     _mm512_set1_ps(dx[(r0 + r) * S + s]), acc[r]);
          }
        }
        for (int r = 0; r < 16; ++r) store_rounded(acc[r], y + (r0 + r) * N + n0);
      }
    }
  }
  release();
}

}  // namespace amx
#endif

// whether 4-bit weights of few rows stream one block at a time here (`blocks_a_pass`): on AMD's CPUs, not Intel's
// (SPEC_ONE_STREAM=1 or 0 says which, for the tests: both rules give the same bits)
bool one_stream() {
#ifdef SPEC_AVX2
  return true;
#else
  static const bool not_intel = [] {
    if (const char* forced = std::getenv("SPEC_ONE_STREAM")) return std::strcmp(forced, "0") != 0;
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return true;
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    return std::strcmp(vendor, "GenuineIntel") != 0;
  }();
  return not_intel;
#endif
}

template <int BITS, int GROUP, int SCALES>
torch::Tensor grouped_product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& sz) {
  const int64_t M = x.size(0), K = x.size(1), G = K / GROUP, N = sz.size(1);  // sz [G, N, 2] or [G, N] (6 bits: bytes)
  auto y = torch::empty({M, N}, x.options());
  // per row: its int8 values, a scale per group (the K-quants: per 256) and the integer sum of each group's values;
  // for the others each group's d * (that sum), as `block` takes it
  constexpr bool super = SCALES == SUPER;
  const int64_t D = super ? K / 256 : G;  // scales a row
  std::vector<int8_t> q(M * K);
  std::vector<float> scales(M * D), dsum(super ? 0 : M * G);
  std::vector<int32_t> xs(M * G);
  quantize_rows<super ? 256 : GROUP, GROUP>(x.data_ptr<at::BFloat16>(), M, K, q.data(), scales.data(), xs.data());
  for (size_t i = 0; i < dsum.size(); ++i) dsum[i] = scales[i] * static_cast<float>(xs[i]);
  // the K-quants take each group's sum as their inner loop uses it, converted once here rather than once a block of
  // outputs there (where Q4_K's conversions and broadcasts were a tenth of a read's time): Q6_K -32 xs (its values
  // are held as q + 32), Q4_K the float of xs (exact: |xs| < 2^24), in the same memory
#ifdef SPEC_AVX2  // (block_super_avx2: groups g and g + 1 as one 32-bit pair of 16-bit sums, in place)
  if constexpr (super) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < G / 2; ++j)
        xs[m * G + j] = static_cast<int32_t>((static_cast<uint32_t>(xs[m * G + 2 * j]) & 0xFFFFu) |
                                             (static_cast<uint32_t>(xs[m * G + 2 * j + 1]) << 16));
  }
#else
  if constexpr (super) {
    for (auto& x : xs) {
      if constexpr (BITS == 6) x *= -32;
      else { const float f = static_cast<float>(x); std::memcpy(&x, &f, sizeof f); }
    }
  }
#endif
  const float* dp = scales.data();
  auto sums = [&](int64_t m) -> const void* {
    return super ? static_cast<const void*>(xs.data() + m * G) : dsum.data() + m * G;
  };
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const void* szp = sz.data_ptr();
  const int8_t* qp = q.data();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = N / 16, block_bytes = G * GROUP * BITS * 2;  // (16 outputs x a group)
  static_assert(BITS != 6 || (GROUP == 16 && SCALES == SUPER), "6 bits: Q6_K's groups of 16");
  // (a thread takes 256 group-blocks at least: in a model the weights come from memory, not a warm cache)
  const int64_t grain = std::max<int64_t>(2, 256 * 32 / GROUP / std::max<int64_t>(1, M * G));
  // a piece of the weights (about 256 KB: it stays in L2) at a time, every row over it: the weights come from memory
  // once however many rows there are, PASS rows a pass over the piece; a whole thread's share where one pass takes
  // every row. Pieces of four blocks at least, so that every pass has several sums under way (one block's sums
  // alone wait on vpdpbusd's latency: up to a fifth slower end to end with 1-4 rows)
  constexpr int PASS = rows_a_pass(BITS, SCALES);
  const int64_t piece = M <= PASS ? blocks : std::max<int64_t>(4, (256 << 10) / block_bytes / 4 * 4);
  int64_t tiled = 0;  // rows the tiles take (`amx`: Q4_K, 64 rows or more, in 16s)
#ifndef SPEC_AVX2
  if constexpr (super && BITS == 4)
    if (M >= amx::FROM && amx::available()) tiled = M / 16 * 16;
#endif
  const bool one = one_stream();  // (`blocks_a_pass`)
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
#ifndef SPEC_AVX2
    if constexpr (super && BITS == 4)
      if (tiled) amx::q4k(wp, block_bytes, static_cast<const uint8_t*>(szp), N, G, qp, dp,
                          reinterpret_cast<const float*>(xs.data()), K, yp, tiled, begin, end);
#endif
    for (int64_t first = begin; first < end; first += piece) {
      const int64_t last = std::min(end, first + piece);
      for (int64_t m = tiled; m < M; m += PASS) {
        auto pass = [&](auto r, auto nb) {
          rows<decltype(r)::value, decltype(nb)::value, BITS, GROUP, SCALES>(
              wp, block_bytes, szp, N, G, qp + m * K, dp + m * D, sums(m), K, yp + m * N, first, last);
        };
        using std::integral_constant;
        auto with_rows = [&](auto r) {  // (both rules' blocks: the same template where they agree)
          constexpr int R = decltype(r)::value;
          if (one) pass(r, integral_constant<int, blocks_a_pass(R, BITS, SCALES, true)>{});
          else pass(r, integral_constant<int, blocks_a_pass(R, BITS, SCALES, false)>{});
        };
        switch (std::min<int64_t>(PASS, M - m)) {
          case 8: with_rows(integral_constant<int, 8>{}); break;
          case 7: with_rows(integral_constant<int, 7>{}); break;
          case 6: with_rows(integral_constant<int, 6>{}); break;
          case 5: with_rows(integral_constant<int, 5>{}); break;
          case 4: with_rows(integral_constant<int, 4>{}); break;
          case 3: with_rows(integral_constant<int, 3>{}); break;
          case 2: with_rows(integral_constant<int, 2>{}); break;
          default: with_rows(integral_constant<int, 1>{}); break;
        }
      }
    }
  });
  return y;
}

// the form of `sz` says the group: [groups, N, 2] or [groups, N] bfloat16 (K / groups inputs: 32, or 16 for 8-bit
// weights), or super-block bytes (SUPER: Q4_K's for 4 bits, Q6_K's for 6)
template <int BITS>
torch::Tensor product(torch::Tensor x, torch::Tensor w, torch::Tensor sz) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K] bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "w: packed uint8");
  TORCH_CHECK(sz.is_contiguous(), "sz: contiguous");
  const int64_t K = x.size(1), N = sz.size(1);
  TORCH_CHECK(N % 16 == 0 && w.numel() == N * K * BITS / 8, "shapes do not agree");
  if (sz.scalar_type() == at::kByte) {
    constexpr int GROUP = BITS == 6 ? 16 : 32;
    const int64_t G = K / GROUP, S = K / 256, rows = BITS == 6 ? G + 2 * S : 2 * G + 4 * S;
    TORCH_CHECK(BITS != 8 && sz.dim() == 2 && K % 256 == 0 && sz.size(0) == rows,
                "sz: super-block bytes [groups + 2 * supers, N] (6 bits) or [2 * groups + 4 * supers, N] (4 bits)");
    if constexpr (BITS != 8) return grouped_product<BITS, GROUP, SUPER>(x, w, sz);
  }
  const bool pairs = sz.dim() == 3;
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && (pairs ? sz.size(2) == 2 : sz.dim() == 2),
              "sz: [groups, N, 2] bfloat16 (or [groups, N], scales alone)");
  TORCH_CHECK(BITS != 6, "6 bits: super-block bytes");
  const int64_t G = sz.size(0);
  TORCH_CHECK(G > 0 && K % G == 0, "shapes do not agree");
  if constexpr (BITS != 6) {
    if (K == G * 32) return pairs ? grouped_product<BITS, 32, PAIRS>(x, w, sz) : grouped_product<BITS, 32, ALONE>(x, w, sz);
  }
  TORCH_CHECK(BITS == 8 && K == G * 16, "groups of 32 inputs (or 16, for 8-bit weights)");
  return pairs ? grouped_product<8, 16, PAIRS>(x, w, sz) : grouped_product<8, 16, ALONE>(x, w, sz);
}

// whether Q4_K's products of many rows run on AMX's tiles here (`amx`)
bool tiles() {
#ifndef SPEC_AVX2
  return amx::available();
#else
  return false;
#endif
}

// int4 weights: a (scale, zero) pair a group of 32 in bfloat16, or Q4_K's scales as they are
torch::Tensor mm(torch::Tensor x, torch::Tensor w, torch::Tensor sz) { return product<4>(x, w, sz); }

// 8-bit weights (llama.cpp's Q8_0, Q5_0, Q5_1, Q5_K: a scale and zero per 32 inputs; Q6_K: per 16), layout
// [N / 16][groups][group / 4][16][4] bytes, q + 128
torch::Tensor mm8(torch::Tensor x, torch::Tensor w, torch::Tensor sz) { return product<8>(x, w, sz); }

// 6-bit weights, llama.cpp's Q6_K as it is (the layout above): `sz` [groups + 2 * supers, N] bytes
torch::Tensor mm6(torch::Tensor x, torch::Tensor w, torch::Tensor sz) { return product<6>(x, w, sz); }

// MXFP4 (E2M1 above): int4's nibbles indexing its floats, an exponent byte a group of 32 ([groups, N])
torch::Tensor mmfp4(torch::Tensor x, torch::Tensor w, torch::Tensor sz) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous [M, K] bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous(), "w: packed uint8");
  TORCH_CHECK(sz.is_contiguous() && sz.scalar_type() == at::kByte && sz.dim() == 2, "sz: [groups, N] exponent bytes");
  const int64_t K = x.size(1), N = sz.size(1);
  TORCH_CHECK(N % 16 == 0 && K == sz.size(0) * 32 && w.numel() == N * K / 2, "shapes do not agree");
  return grouped_product<4, 32, E2M1>(x, w, sz);
}

// The weight layouts above made from plain values (the loader's `native.pack`, `pack6`, `pack8`: the same bytes as
// their torch forms, which a load took ~3 s to run over the Qwen pair), blocks of 16 outputs spread over threads.

// nibbles [out, in / 2] (two a byte, the even input high) -> 4 bits' layout
torch::Tensor pack4(torch::Tensor nibbles) {
  TORCH_CHECK(nibbles.scalar_type() == at::kByte && nibbles.dim() == 2 && nibbles.is_contiguous(), "nibbles: uint8 [out, in / 2]");
  const int64_t out = nibbles.size(0), half = nibbles.size(1), G = half * 2 / 32;
  TORCH_CHECK(out % 16 == 0 && half % 16 == 0, "nibbles: out in 16s, in in 32s");
  auto packed = torch::empty_like(nibbles);
  const uint8_t* src = nibbles.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  // a group's 16 bytes of an output hold its inputs 0-31, the even one high; vector p's four bytes for this output
  // take inputs 4p..4p+3 (low nibbles) and 4p+16..4p+19 (high): from bytes 2p, 2p+1 and 8+2p, 9+2p
  at::parallel_for(0, out / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < G; ++g)
        for (int lane = 0; lane < 16; ++lane) {
          const uint8_t* s = src + (b * 16 + lane) * half + g * 16;
          uint8_t* d = dst + (b * G + g) * 256 + lane * 4;
          for (int p = 0; p < 4; ++p) {
            const uint8_t a = s[2 * p], c = s[2 * p + 1], e = s[8 + 2 * p], f = s[9 + 2 * p];
            d[p * 64 + 0] = (a >> 4) | (e & 0xF0);
            d[p * 64 + 1] = (a & 15) | ((e & 15) << 4);
            d[p * 64 + 2] = (c >> 4) | (f & 0xF0);
            d[p * 64 + 3] = (c & 15) | ((f & 15) << 4);
          }
        }
  });
  return packed;
}

// signed values [out, in] (-32..31) -> 6 bits' layout
torch::Tensor pack6(torch::Tensor values) {
  TORCH_CHECK(values.scalar_type() == at::kChar && values.dim() == 2 && values.is_contiguous(), "values: int8 [out, in]");
  const int64_t out = values.size(0), in = values.size(1), G = in / 16;
  TORCH_CHECK(out % 16 == 0 && in % 16 == 0, "values: out and in in 16s");
  auto packed = torch::empty({out, in * 3 / 4}, values.options().dtype(at::kByte));
  const int8_t* src = values.data_ptr<int8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, out / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < G; ++g)
        for (int lane = 0; lane < 16; ++lane)
          for (int byte = 0; byte < 4; ++byte) {
            uint8_t q[4];  // the group's quarters 0-3 at this byte, + 32
            for (int quarter = 0; quarter < 4; ++quarter)
              q[quarter] = static_cast<uint8_t>(src[(b * 16 + lane) * in + g * 16 + quarter * 4 + byte] + 32);
            uint8_t* at = dst + ((b * G + g) * 3 * 16 + lane) * 4 + byte;
            at[0] = (q[0] & 15) | ((q[2] & 15) << 4);
            at[64] = (q[1] & 15) | ((q[3] & 15) << 4);
            at[128] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
          }
  });
  return packed;
}

// signed values [out, in] -> 8 bits' layout for groups of `group` inputs (32 or 16), each value + 128
torch::Tensor pack8(torch::Tensor values, int64_t group) {
  TORCH_CHECK(values.scalar_type() == at::kChar && values.dim() == 2 && values.is_contiguous(), "values: int8 [out, in]");
  const int64_t out = values.size(0), in = values.size(1), G = in / group, P = group / 4;
  TORCH_CHECK(out % 16 == 0 && group % 4 == 0 && in % group == 0, "values: out in 16s, in in groups");
  auto packed = torch::empty({out, in}, values.options().dtype(at::kByte));
  const int8_t* src = values.data_ptr<int8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, out / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t p = 0; p < P; ++p)
          for (int lane = 0; lane < 16; ++lane)
            for (int byte = 0; byte < 4; ++byte)
              dst[(((b * G + g) * P + p) * 16 + lane) * 4 + byte] =
                  static_cast<uint8_t>(src[(b * 16 + lane) * in + g * group + p * 4 + byte] + 128);
  });
  return packed;
}
