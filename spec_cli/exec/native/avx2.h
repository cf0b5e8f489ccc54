// The kernels' AVX-512 on AVX2 (with FMA and F16C): a CPU without AVX-512 (Zen 2 and 3, Intel's client chips since
// Alder Lake) builds the same sources with this header first (`-DSPEC_AVX2`), as SIMDe's native aliases do: the
// 512-bit types become pairs of 256-bit halves, and each AVX-512 intrinsic the kernels use becomes its two halves'
// AVX2 instructions (a mask of 16 lanes stays a 16-bit integer). Lanewise arithmetic gives the same bits as AVX-512;
// the reductions sum in their own fixed order; vpdpbusd is vpmaddubsw then vpmaddwd (exact: no pair of 4-bit or
// 6-bit weights times int8 values reaches vpmaddubsw's saturation; 8-bit weights take `dpbusd8`). A row's bits still
// never depend on the rows beside it. The bfloat16 dot products (AVX-512 BF16) are left out: attention sums in float.
// The K-quants (Q4_K, Q6_K) have a kernel of their own here (`block_super_avx2` in int4.cpp: the groups' scales in
// integers, as llama.cpp's AVX2 code applies them).
#pragma once

// everything the kernels include, before the names below are redefined (their include guards keep them as they are)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#define SPEC_AVX2 1

namespace avx2 {

#define SPEC_INLINE inline __attribute__((always_inline))

struct f32x16 { __m256 lo, hi; };
struct i32x16 { __m256i lo, hi; };
using mask16 = uint16_t;

// a 16-bit mask's lanes as two all-ones / all-zeros vectors
SPEC_INLINE i32x16 lanes_of(mask16 m) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i lo = _mm256_set1_epi32(m & 0xFF), hi = _mm256_set1_epi32(m >> 8);
  return {_mm256_cmpeq_epi32(_mm256_and_si256(lo, bits), bits), _mm256_cmpeq_epi32(_mm256_and_si256(hi, bits), bits)};
}
SPEC_INLINE mask16 mask_of(__m256 lo, __m256 hi) {
  return static_cast<mask16>(_mm256_movemask_ps(lo) | (_mm256_movemask_ps(hi) << 8));
}

// float lanes
SPEC_INLINE f32x16 set1_ps(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
SPEC_INLINE f32x16 setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
#define SPEC_BINARY(name, op)                                                                     \
  SPEC_INLINE f32x16 name(f32x16 a, f32x16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
SPEC_BINARY(add_ps, _mm256_add_ps)
SPEC_BINARY(sub_ps, _mm256_sub_ps)
SPEC_BINARY(mul_ps, _mm256_mul_ps)
SPEC_BINARY(div_ps, _mm256_div_ps)
SPEC_BINARY(max_ps, _mm256_max_ps)
SPEC_BINARY(min_ps, _mm256_min_ps)
#undef SPEC_BINARY
SPEC_INLINE f32x16 fmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
SPEC_INLINE f32x16 fnmadd_ps(f32x16 a, f32x16 b, f32x16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
SPEC_INLINE f32x16 roundscale_nearest(f32x16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
// a * 2^n for whole n in [-126, 127] (exp16's range), as vscalefps gives it there
SPEC_INLINE f32x16 scalef_ps(f32x16 a, f32x16 n) {
  auto two_to = [](__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  };
  return {_mm256_mul_ps(a.lo, two_to(n.lo)), _mm256_mul_ps(a.hi, two_to(n.hi))};
}
SPEC_INLINE float reduce_add_ps(f32x16 a) {
  __m256 s = _mm256_add_ps(a.lo, a.hi);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}
SPEC_INLINE float reduce_max_ps(f32x16 a) {
  __m256 s = _mm256_max_ps(a.lo, a.hi);
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  t = _mm_max_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}

// masked float lanes (a masked-off lane is never read or written)
SPEC_INLINE f32x16 maskz_loadu_ps(mask16 m, const float* p) {
  if (m == 0xFFFF) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
  const i32x16 k = lanes_of(m);
  return {_mm256_maskload_ps(p, k.lo), _mm256_maskload_ps(p + 8, k.hi)};
}
SPEC_INLINE void mask_storeu_ps(float* p, mask16 m, f32x16 a) {
  if (m == 0xFFFF) {
    _mm256_storeu_ps(p, a.lo);
    _mm256_storeu_ps(p + 8, a.hi);
    return;
  }
  const i32x16 k = lanes_of(m);
  _mm256_maskstore_ps(p, k.lo, a.lo);
  _mm256_maskstore_ps(p + 8, k.hi, a.hi);
}
SPEC_INLINE f32x16 mask_mov_ps(f32x16 src, mask16 m, f32x16 a) {
  const i32x16 k = lanes_of(m);
  return {_mm256_blendv_ps(src.lo, a.lo, _mm256_castsi256_ps(k.lo)),
          _mm256_blendv_ps(src.hi, a.hi, _mm256_castsi256_ps(k.hi))};
}
SPEC_INLINE f32x16 maskz_mov_ps(mask16 m, f32x16 a) { return mask_mov_ps(setzero_ps(), m, a); }
SPEC_INLINE f32x16 mask_loadu_ps(f32x16 src, mask16 m, const float* p) {
  return mask_mov_ps(src, m, maskz_loadu_ps(m, p));
}
SPEC_INLINE f32x16 mask_max_ps(f32x16 src, mask16 m, f32x16 a, f32x16 b) { return mask_mov_ps(src, m, max_ps(a, b)); }
template <int PREDICATE>
SPEC_INLINE mask16 cmp_ps_mask(f32x16 a, f32x16 b) {
  return mask_of(_mm256_cmp_ps(a.lo, b.lo, PREDICATE), _mm256_cmp_ps(a.hi, b.hi, PREDICATE));
}

// integer lanes
SPEC_INLINE i32x16 setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
SPEC_INLINE i32x16 set1_epi32(int a) { return {_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
SPEC_INLINE i32x16 set1_epi8(char a) { return {_mm256_set1_epi8(a), _mm256_set1_epi8(a)}; }
SPEC_INLINE i32x16 setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9, int a10,
                              int a11, int a12, int a13, int a14, int a15) {
  return {_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_setr_epi32(a8, a9, a10, a11, a12, a13, a14, a15)};
}
SPEC_INLINE i32x16 loadu_si512(const void* p) {
  const auto* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
#define SPEC_BINARY(name, op)                                                                     \
  SPEC_INLINE i32x16 name(i32x16 a, i32x16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
SPEC_BINARY(and_si512, _mm256_and_si256)
SPEC_BINARY(max_epi32, _mm256_max_epi32)
SPEC_BINARY(shuffle_epi8, _mm256_shuffle_epi8)  // (vpshufb: within each 128-bit lane, as AVX-512's)
SPEC_INLINE i32x16 broadcast_i32x4(__m128i a) { return {_mm256_broadcastsi128_si256(a), _mm256_broadcastsi128_si256(a)}; }
SPEC_BINARY(or_si512, _mm256_or_si256)
SPEC_BINARY(add_epi32, _mm256_add_epi32)
#undef SPEC_BINARY
#define SPEC_SHIFT(name, op)                                                                      \
  SPEC_INLINE i32x16 name(i32x16 a, int n) { return {op(a.lo, n), op(a.hi, n)}; }
SPEC_SHIFT(srli_epi32, _mm256_srli_epi32)
SPEC_SHIFT(slli_epi32, _mm256_slli_epi32)
SPEC_SHIFT(srli_epi16, _mm256_srli_epi16)
SPEC_SHIFT(slli_epi16, _mm256_slli_epi16)
#undef SPEC_SHIFT
SPEC_INLINE int reduce_add_epi32(i32x16 a) {
  __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// conversions
SPEC_INLINE f32x16 castsi512_ps(i32x16 a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
SPEC_INLINE i32x16 castps_si512(f32x16 a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
SPEC_INLINE f32x16 cvtepi32_ps(i32x16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
SPEC_INLINE i32x16 cvtps_epi32(f32x16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }  // (nearest, even)
SPEC_INLINE i32x16 cvtepu16_epi32(__m256i a) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
SPEC_INLINE i32x16 cvtepu8_epi32(__m128i a) { return {_mm256_cvtepu8_epi32(a), _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8))}; }
SPEC_INLINE i32x16 cvtepi8_epi32(__m128i a) { return {_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))}; }
// (the kernels narrow only values that fit: there packing's saturation is vpmovdw's truncation)
SPEC_INLINE __m256i cvtepi32_epi16(i32x16 a) {
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a.lo, a.hi), 0xD8);
}
SPEC_INLINE __m128i cvtepi32_epi8(i32x16 a) {
  const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);
  return _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
}
SPEC_INLINE f32x16 cvtph_ps(__m256i a) {
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(a)), _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1))};
}

// 16 bfloat16 lanes (32 bytes) under a mask
SPEC_INLINE __m256i maskz_loadu_epi16(mask16 m, const void* p) {
  if (m == 0xFFFF) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint16_t lanes[16] = {};
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) lanes[i] = static_cast<const uint16_t*>(p)[i];
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
}
SPEC_INLINE void mask_storeu_epi16(void* p, mask16 m, __m256i a) {
  if (m == 0xFFFF) return _mm256_storeu_si256(static_cast<__m256i*>(p), a);
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), a);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) static_cast<uint16_t*>(p)[i] = lanes[i];
}

// vpdpbusd: sum + the four byte products of each lane of w (unsigned) and the four bytes at x (signed, broadcast),
// for w's bytes below 64 (4 and 6 bits: a pair of products stays under vpmaddubsw's saturation)
SPEC_INLINE i32x16 dpbusd(i32x16 sum, i32x16 w, const int32_t* x) {
  const __m256i xb = _mm256_set1_epi32(*x), ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(sum.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(w.lo, xb), ones)),
          _mm256_add_epi32(sum.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(w.hi, xb), ones))};
}
// the same for 8-bit weights held as q + 128, without the 128: sum + (w - 128) . x, exactly for every byte (the
// weight's magnitude |q| <= 128 unsigned, times x carrying q's sign: |x| <= 127, so no pair saturates)
SPEC_INLINE i32x16 dpbusd8(i32x16 sum, i32x16 w, const int32_t* x) {
  const __m256i xb = _mm256_set1_epi32(*x), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  auto half = [&](__m256i s, __m256i v) {
    const __m256i q = _mm256_xor_si256(v, flip);
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xb, q)), ones));
  };
  return {half(sum.lo, w.lo), half(sum.hi, w.hi)};
}

}  // namespace avx2

#define __m512 avx2::f32x16
#define __m512i avx2::i32x16
#define _mm512_set1_ps avx2::set1_ps
#define _mm512_setzero_ps avx2::setzero_ps
#define _mm512_add_ps avx2::add_ps
#define _mm512_sub_ps avx2::sub_ps
#define _mm512_mul_ps avx2::mul_ps
#define _mm512_div_ps avx2::div_ps
#define _mm512_max_ps avx2::max_ps
#define _mm512_min_ps avx2::min_ps
#define _mm512_fmadd_ps avx2::fmadd_ps
#define _mm512_fnmadd_ps avx2::fnmadd_ps
#define _mm512_roundscale_ps(a, mode) avx2::roundscale_nearest(a)  // (the kernels round to the nearest only)
#define _mm512_scalef_ps avx2::scalef_ps
#define _mm512_reduce_add_ps avx2::reduce_add_ps
#define _mm512_reduce_max_ps avx2::reduce_max_ps
#define _mm512_maskz_loadu_ps avx2::maskz_loadu_ps
#define _mm512_mask_loadu_ps avx2::mask_loadu_ps
#define _mm512_mask_storeu_ps avx2::mask_storeu_ps
#define _mm512_mask_mov_ps avx2::mask_mov_ps
#define _mm512_maskz_mov_ps avx2::maskz_mov_ps
#define _mm512_mask_max_ps avx2::mask_max_ps
#define _mm512_cmp_ps_mask(a, b, predicate) avx2::cmp_ps_mask<predicate>(a, b)
#define _mm512_mask_cmp_ps_mask(m, a, b, predicate) static_cast<avx2::mask16>((m) & avx2::cmp_ps_mask<predicate>(a, b))
#define _mm512_setzero_si512 avx2::setzero_si512
#define _mm512_set1_epi32 avx2::set1_epi32
#define _mm512_set1_epi8 avx2::set1_epi8
#define _mm512_setr_epi32 avx2::setr_epi32
#define _mm512_loadu_si512 avx2::loadu_si512
#define _mm512_and_si512 avx2::and_si512
#define _mm512_shuffle_epi8 avx2::shuffle_epi8
#define _mm512_max_epi32 avx2::max_epi32
#define _mm512_broadcast_i32x4 avx2::broadcast_i32x4
#define _mm512_or_si512 avx2::or_si512
#define _mm512_add_epi32 avx2::add_epi32
#define _mm512_srli_epi32 avx2::srli_epi32
#define _mm512_slli_epi32 avx2::slli_epi32
#define _mm512_srli_epi16 avx2::srli_epi16
#define _mm512_slli_epi16 avx2::slli_epi16
#define _mm512_reduce_add_epi32 avx2::reduce_add_epi32
#define _mm512_castsi512_ps avx2::castsi512_ps
#define _mm512_castps_si512 avx2::castps_si512
#define _mm512_cvtepi32_ps avx2::cvtepi32_ps
#define _mm512_cvt_roundps_epi32(a, mode) avx2::cvtps_epi32(a)  // (to the nearest, ties to even: MXCSR's default)
#define _mm512_cvtepu16_epi32 avx2::cvtepu16_epi32
#define _mm512_cvtepu8_epi32 avx2::cvtepu8_epi32
#define _mm512_cvtepi8_epi32 avx2::cvtepi8_epi32
#define _mm512_cvtepi32_epi16 avx2::cvtepi32_epi16
#define _mm512_cvtepi32_epi8 avx2::cvtepi32_epi8
#define _mm512_cvtph_ps avx2::cvtph_ps
#define _mm256_maskz_loadu_epi16 avx2::maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 avx2::mask_storeu_epi16
