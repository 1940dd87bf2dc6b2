/* Helpers shared by neorec's native kernels. */
#ifndef NEOREC_NATIVE_COMMON_H
#define NEOREC_NATIVE_COMMON_H

#include <stdint.h>
#include <string.h>

#define DOT_LANES 16

/* sum_d a[d] * b[d] in a fixed order: DOT_LANES partial sums (d mod DOT_LANES, which the compiler
 * maps to SIMD registers without -ffast-math), added pairwise, then the tail. Deterministic. */
static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float lanes[DOT_LANES] = {0};
    const int64_t full = n - n % DOT_LANES;
    for (int64_t d = 0; d < full; d += DOT_LANES)
        for (int l = 0; l < DOT_LANES; ++l) lanes[l] += a[d + l] * b[d + l];
    for (int width = DOT_LANES / 2; width > 0; width /= 2)
        for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
    float sum = lanes[0];
    for (int64_t d = full; d < n; ++d) sum += a[d] * b[d];
    return sum;
}

/* Runs ``call`` with a constant ``D`` equal to ``dim`` for the common widths, so that loops over D
 * in always-inlined helpers unroll and their accumulators stay in registers; other widths run
 * the same code with D = dim. */
#define FOR_DIM(dim, call)                          \
    switch (dim) {                                  \
    case 16: { const int64_t D = 16; call; break; }   \
    case 32: { const int64_t D = 32; call; break; }   \
    case 64: { const int64_t D = 64; call; break; }   \
    case 128: { const int64_t D = 128; call; break; } \
    default: { const int64_t D = (dim); call; }       \
    }

#define INLINE static inline __attribute__((always_inline))

/* n bytes: 32-byte pieces inline (a row of a 64-float column block is 8 of them), the rest by memcpy. */
static inline void copy_bytes(char *restrict to, const char *restrict from, int64_t n) {
    int64_t done = 0;
    for (; done + 32 <= n; done += 32) __builtin_memcpy(to + done, from + done, 32);
    if (done < n) __builtin_memcpy(to + done, from + done, (size_t)(n - done));
}

#endif
