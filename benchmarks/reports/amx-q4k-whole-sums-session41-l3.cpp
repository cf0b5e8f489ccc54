// Ad hoc (session 41): can part of a model's weights stay in this CPU's L3 across tokens while the rest streams?
// Each "token" reads A (resident candidate) with plain loads, then B with loads whose lines were asked for by
// prefetchnta (or plain): A's read speed tells whether A stayed in L3.
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>

template <int HINT>
__attribute__((noinline)) int64_t read(const uint8_t* p, size_t n) {
  __m512i acc = _mm512_setzero_si512();
  #pragma omp parallel
  {
    __m512i local = _mm512_setzero_si512();
    #pragma omp for schedule(static)
    for (size_t i = 0; i < n; i += 256) {
      if (HINT >= 0) _mm_prefetch((const char*)p + i + 2048, (_mm_hint)HINT);
      if (HINT >= 0) _mm_prefetch((const char*)p + i + 2048 + 64, (_mm_hint)HINT);
      if (HINT >= 0) _mm_prefetch((const char*)p + i + 2048 + 128, (_mm_hint)HINT);
      if (HINT >= 0) _mm_prefetch((const char*)p + i + 2048 + 192, (_mm_hint)HINT);
      local = _mm512_add_epi64(local, _mm512_load_si512(p + i));
      local = _mm512_add_epi64(local, _mm512_load_si512(p + i + 64));
      local = _mm512_add_epi64(local, _mm512_load_si512(p + i + 128));
      local = _mm512_add_epi64(local, _mm512_load_si512(p + i + 192));
    }
    #pragma omp critical
    acc = _mm512_add_epi64(acc, local);
  }
  return _mm512_reduce_add_epi64(acc);
}

int main(int argc, char** argv) {
  size_t a_mb = atoi(argv[1]), b_mb = atoi(argv[2]);
  int hint = atoi(argv[3]);  // 0: NTA for B, 3: T0 for B, -1: no prefetch
  size_t na = a_mb << 20, nb = b_mb << 20;
  uint8_t* a = (uint8_t*)aligned_alloc(4096, na);
  uint8_t* b = (uint8_t*)aligned_alloc(4096, nb + 4096);
  memset(a, 1, na); memset(b, 2, nb + 4096);
  int64_t s = 0;
  for (int it = 0; it < 12; ++it) {
    auto t0 = std::chrono::steady_clock::now();
    s += read<_MM_HINT_T0>(a, na);
    auto t1 = std::chrono::steady_clock::now();
    if (hint == 0) s += read<_MM_HINT_NTA>(b, nb);
    else if (hint == 3) s += read<_MM_HINT_T0>(b, nb);
    else s += read<-1>(b, nb);
    auto t2 = std::chrono::steady_clock::now();
    double ta = std::chrono::duration<double>(t1 - t0).count(), tb = std::chrono::duration<double>(t2 - t1).count();
    if (it >= 9) printf("A %zu MB %.1f GB/s (%.1f ms) | B %zu MB %.1f GB/s (%.1f ms) | token %.1f ms\n", a_mb, na / ta / 1e9, ta * 1e3, b_mb, nb / tb / 1e9, tb * 1e3, (ta + tb) * 1e3);
  }
  return s == 42;
}
