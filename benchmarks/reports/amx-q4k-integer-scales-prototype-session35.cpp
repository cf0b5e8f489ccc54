// Session 35 prototype (not built by spec; see amx-q4k-integer-scales-xeon-session35.txt): Q4_K in spec's layout times
// int8 rows on AMX tiles, each group's 6-bit scale folded into the weights (two byte planes of q sc), a row's
// float work once a super-block. g++ -O3 -march=native -std=c++17 FILE; SKIP_EPI/SKIP_PRE/SKIP_TILE=1 time parts.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

struct alignas(64) Config {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
#define TILE_LOAD(T, base, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #T ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define TILE_STORE(T, base, stride) \
  asm volatile("tilestored %%tmm" #T ", (%0,%1,1)" ::"r"(base), "r"(static_cast<int64_t>(stride)) : "memory")
#define TILE_ZERO(T) asm volatile("tilezero %%tmm" #T ::)
#define DPBSUD(C, A, B) asm volatile("tdpbsud %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::)

static int SKIP_EPI = getenv("SKIP_EPI") != nullptr, SKIP_PRE = getenv("SKIP_PRE") != nullptr, SKIP_TILE = getenv("SKIP_TILE") != nullptr;
static void configure(int rows) {
  Config c;
  for (int t : {0, 1, 2, 3}) c.rows[t] = rows, c.colsb[t] = 64;
  c.rows[4] = rows, c.colsb[4] = 64;
  for (int t : {5, 6, 7}) c.rows[t] = 16, c.colsb[t] = 64;
  asm volatile("ldtilecfg %0" ::"m"(c));
}

static float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

struct Weights {
  int64_t N, K, G, S;
  std::vector<uint8_t> w;      // [N/16][G][4][64]
  std::vector<uint8_t> bytes;  // [2G + 4S][N]
};
struct Rows {
  int64_t M;
  std::vector<int8_t> q;    // [M][K]
  std::vector<float> dx;    // [M][S]
  std::vector<int32_t> xs;  // [M][G]
};

static int nib(const Weights& W, int64_t n, int64_t k) {
  const int64_t b = n / 16, i = n % 16, g = k / 32, j = k % 32;
  const int p = (j % 16) / 4, e = j % 4;
  const uint8_t v = W.w[((b * W.G + g) * 4 + p) * 64 + i * 4 + e];
  return j < 16 ? (v & 15) : (v >> 4);
}

// the reference: the integer design's arithmetic, scalar
static void reference(const Weights& W, const Rows& X, std::vector<float>& y) {
  y.assign(X.M * W.N, 0.f);
  for (int64_t r = 0; r < X.M; ++r)
    for (int64_t n = 0; n < W.N; ++n) {
      float acc = 0.f;
      for (int64_t s = 0; s < W.S; ++s) {
        int32_t I = 0, Mn = 0;
        for (int64_t g = s * 8; g < s * 8 + 8; ++g) {
          int32_t isum = 0;
          for (int64_t j = 0; j < 32; ++j) isum += nib(W, n, g * 32 + j) * X.q[r * W.K + g * 32 + j];
          I += W.bytes[g * W.N + n] * isum;
          Mn += W.bytes[(W.G + g) * W.N + n] * X.xs[r * W.G + g];
        }
        const int64_t base = 2 * W.G;
        const float d = half_to_float(W.bytes[(base + s) * W.N + n] | (W.bytes[(base + W.S + s) * W.N + n] << 8));
        const float dmin =
            half_to_float(W.bytes[(base + 2 * W.S + s) * W.N + n] | (W.bytes[(base + 3 * W.S + s) * W.N + n] << 8));
        const float value = std::fmaf(-static_cast<float>(Mn), dmin, static_cast<float>(I) * d);
        acc = std::fmaf(value, X.dx[r * W.S + s], acc);
      }
      y[r * W.N + n] = acc;
    }
}

// block b's weights prescaled: [S][4 steps][2 planes][16 rows][64], plane 0 the low bytes of q sc, 1 the high
static void prescale(const Weights& W, int64_t b, uint8_t* into) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i lo_index, hi_index;
  {
    alignas(64) int16_t a[32], c[32];
    for (int i = 0; i < 32; ++i) a[i] = i / 4, c[i] = 8 + i / 4;
    lo_index = _mm512_load_si512(a), hi_index = _mm512_load_si512(c);
  }
  for (int64_t g = 0; g < W.G; ++g) {
    const __m512i sc = _mm512_cvtepu8_epi16(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&W.bytes[g * W.N + b * 16]))));
    const __m512i sc_lo = _mm512_permutexvar_epi16(lo_index, sc), sc_hi = _mm512_permutexvar_epi16(hi_index, sc);
    const int64_t s = g / 8, step = (g % 8) / 2, half = g % 2;
    uint8_t* plane0 = into + ((s * 4 + step) * 2 + 0) * 1024 + half * 512;
    uint8_t* plane1 = into + ((s * 4 + step) * 2 + 1) * 1024 + half * 512;
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(&W.w[((b * W.G + g) * 4 + p) * 64]);
      const __m512i parts[2] = {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
      for (int h = 0; h < 2; ++h) {  // B row 4h + p: inputs 16h + 4p .. +3
        const __m512i a = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(parts[h]));
        const __m512i c = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(parts[h], 1));
        const __m512i pa = _mm512_mullo_epi16(a, sc_lo), pc = _mm512_mullo_epi16(c, sc_hi);
        const int row = 4 * h + p;
        _mm256_store_si256(reinterpret_cast<__m256i*>(plane0 + row * 64), _mm512_cvtepi16_epi8(pa));
        _mm256_store_si256(reinterpret_cast<__m256i*>(plane0 + row * 64 + 32), _mm512_cvtepi16_epi8(pc));
        _mm256_store_si256(reinterpret_cast<__m256i*>(plane1 + row * 64), _mm512_cvtepi16_epi8(_mm512_srli_epi16(pa, 8)));
        _mm256_store_si256(reinterpret_cast<__m256i*>(plane1 + row * 64 + 32),
                           _mm512_cvtepi16_epi8(_mm512_srli_epi16(pc, 8)));
      }
    }
  }
}

// rows [r0, r0 + rows) x blocks b, b + 1, from their prescaled weights (pre, pre + per)
static void tile_rows(const Weights& W, const Rows& X, const uint8_t* pre, int64_t per, int64_t b, int64_t r0, int rows,
                      const int32_t* xs_pairs, float* y) {
  alignas(64) int32_t c[4][16][16];
  __m512 acc[2][16];
  for (int r = 0; r < 16; ++r) acc[0][r] = acc[1][r] = _mm512_setzero_ps();
  const int64_t base = 2 * W.G;
  for (int64_t s = 0; s < W.S; ++s) {
    TILE_ZERO(0); TILE_ZERO(1); TILE_ZERO(2); TILE_ZERO(3);
    if (!SKIP_TILE) for (int step = 0; step < 4; ++step) {
      TILE_LOAD(4, &X.q[r0 * W.K + s * 256 + step * 64], W.K);
      const uint8_t* p0 = pre + ((s * 4 + step) * 2) * 1024;
      TILE_LOAD(5, p0, 64);
      TILE_LOAD(6, p0 + 1024, 64);
      DPBSUD(0, 4, 5);
      DPBSUD(1, 4, 6);
      TILE_LOAD(7, p0 + per, 64);
      DPBSUD(2, 4, 7);
      TILE_LOAD(5, p0 + per + 1024, 64);
      DPBSUD(3, 4, 5);
    }
    TILE_STORE(0, c[0], 64); TILE_STORE(1, c[1], 64); TILE_STORE(2, c[2], 64); TILE_STORE(3, c[3], 64);
    if (SKIP_EPI) continue;
    for (int k2 = 0; k2 < 2; ++k2) {
      const int64_t n0 = (b + k2) * 16;
      __m512i mn[4];
      for (int k = 0; k < 4; ++k) {
        const int64_t g = s * 8 + 2 * k;
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&W.bytes[(W.G + g) * W.N + n0]));
        const __m128i cc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&W.bytes[(W.G + g + 1) * W.N + n0]));
        mn[k] = _mm512_or_si512(_mm512_cvtepu8_epi32(a), _mm512_slli_epi32(_mm512_cvtepu8_epi32(cc), 16));
      }
      auto half = [&](int64_t row) {
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&W.bytes[row * W.N + n0])));
        const __m256i hi =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(&W.bytes[(row + W.S) * W.N + n0])));
        return _mm512_cvtph_ps(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 8)));
      };
      const __m512 d = half(base + s), dmin = half(base + 2 * W.S + s);
      for (int r = 0; r < rows; ++r) {
        const __m512i I = _mm512_add_epi32(_mm512_load_si512(c[2 * k2][r]), _mm512_slli_epi32(_mm512_load_si512(c[2 * k2 + 1][r]), 8));
        __m512i Mn = _mm512_setzero_si512();
        for (int k = 0; k < 4; ++k)
          Mn = _mm512_dpwssd_epi32(Mn, mn[k], _mm512_set1_epi32(xs_pairs[(r0 + r) * (W.G / 2) + s * 4 + k]));
        const __m512 value = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(Mn), dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(I), d));
        acc[k2][r] = _mm512_fmadd_ps(value, _mm512_set1_ps(X.dx[(r0 + r) * W.S + s]), acc[k2][r]);
      }
    }
  }
  for (int k2 = 0; k2 < 2; ++k2)
    for (int r = 0; r < rows; ++r) _mm512_storeu_ps(y + (r0 + r) * W.N + (b + k2) * 16, acc[k2][r]);
}

static void amx_product(const Weights& W, const Rows& X, std::vector<float>& y, std::vector<uint8_t>& pre,
                        std::vector<int32_t>& xs_pairs) {
  y.resize(X.M * W.N);
  xs_pairs.resize(X.M * W.G / 2);
  for (int64_t r = 0; r < X.M; ++r)
    for (int64_t j = 0; j < W.G / 2; ++j)
      xs_pairs[r * (W.G / 2) + j] = static_cast<int32_t>((static_cast<uint32_t>(X.xs[r * W.G + 2 * j]) & 0xFFFFu) |
                                                         (static_cast<uint32_t>(X.xs[r * W.G + 2 * j + 1]) << 16));
  const int64_t per = W.S * 8 * 1024;
  pre.resize(2 * per);
  int configured = -1;
  for (int64_t b = 0; b < W.N / 16; b += 2) {
    if (!SKIP_PRE || b == 0) prescale(W, b, pre.data()), prescale(W, b + 1, pre.data() + per);
    for (int64_t r0 = 0; r0 < X.M; r0 += 16) {
      const int rows = static_cast<int>(std::min<int64_t>(16, X.M - r0));
      if (rows != configured) configure(rows), configured = rows;
      tile_rows(W, X, pre.data(), per, b, r0, rows, xs_pairs.data(), y.data());
    }
  }
}

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return puts("no AMX permission"), 1;
  const int64_t N = argc > 1 ? atoll(argv[1]) : 17920, K = argc > 2 ? atoll(argv[2]) : 1536;
  std::mt19937 rng(1);
  Weights W{N, K, K / 32, K / 256};
  W.w.resize(N / 16 * W.G * 256);
  for (auto& v : W.w) v = rng();
  W.bytes.resize((2 * W.G + 4 * W.S) * N);
  for (int64_t i = 0; i < 2 * W.G * N; ++i) W.bytes[i] = rng() % 64;
  for (int64_t s = 0; s < 2 * W.S; ++s)  // d and dmin: small positive halves
    for (int64_t n = 0; n < N; ++n) {
      const uint16_t h = _cvtss_sh(0.001f * (1 + rng() % 100), 0);
      W.bytes[(2 * W.G + (s / W.S) * 2 * W.S + s % W.S) * N + n] = h & 0xFF;
      W.bytes[(2 * W.G + (s / W.S) * 2 * W.S + W.S + s % W.S) * N + n] = h >> 8;
    }
  for (int64_t M : {16, 64, 256, 512}) {
    Rows X{M};
    X.q.resize(M * K), X.dx.resize(M * W.S), X.xs.assign(M * W.G, 0);
    for (auto& v : X.q) v = static_cast<int8_t>(rng() % 255 - 127);
    for (auto& v : X.dx) v = 0.01f * (1 + rng() % 100);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t k = 0; k < K; ++k) X.xs[r * W.G + k / 32] += X.q[r * K + k];
    std::vector<float> y, ref;
    std::vector<uint8_t> pre;
    std::vector<int32_t> pairs;
    amx_product(W, X, y, pre, pairs);
    if (M == 16) {
      Weights small = W;  // check bits on the first 64 outputs
      reference(W, X, ref);
      int64_t bad = 0;
      for (int64_t r = 0; r < M; ++r)
        for (int64_t n = 0; n < 64; ++n) bad += std::memcmp(&y[r * N + n], &ref[r * N + n], 4) != 0;
      printf("M=16 bits equal to the scalar reference: %s (%lld differ)\n", bad ? "NO" : "yes", (long long)bad);
    }
    const int reps = M <= 64 ? 20 : 5;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) amx_product(W, X, y, pre, pairs);
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
    printf("M=%4lld %lldx%lld: %.3f ms, %.0f GMAC/s (one thread)\n", (long long)M, (long long)N, (long long)K,
           sec * 1e3, M * N * K / sec / 1e9);
  }
}
