/* Peak fp32 FMA rate of one core (AVX2 + FMA): ten independent chains of 8-wide fused
 * multiply-adds, enough to keep both FMA pipes of a Zen 3 or Skylake core busy. Prints GFLOP/s.
 * Compiled and run by bench_floor.py (one copy per core at once for the all-cores figure). */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

int main(void) {
    __m256 a0 = _mm256_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
           a9 = a0;
    const __m256 x = _mm256_set1_ps(0.9999999f), y = _mm256_set1_ps(1e-7f);
    const long iterations = 100000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iterations; ++i) {
#define STEP(a) a = _mm256_fmadd_ps(a, x, y);
        STEP(a0) STEP(a1) STEP(a2) STEP(a3) STEP(a4) STEP(a5) STEP(a6) STEP(a7) STEP(a8) STEP(a9)
        __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7),
                         "+x"(a8), "+x"(a9));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    const double seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    float sink[8];
    _mm256_storeu_ps(sink, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                                         _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(_mm256_add_ps(a6, a7),
                                                                                             _mm256_add_ps(a8, a9)))));
    printf("%.2f %g\n", (double)iterations * 10 * 16 / seconds / 1e9, (double)sink[0]);
    return 0;
}
