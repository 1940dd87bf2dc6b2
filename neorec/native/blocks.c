/* Row-by-row copies of column blocks between row-major matrices, called through ctypes by
 * neorec/native/blocks.py (built by neorec/native/build.py).
 *
 * Block k: rows x bytes[k] bytes, row i at src[k] + i * src_stride[k] (read) and at
 * dst[k] + i * dst_stride[k] (written). One strided copy per block (what ``dst.copy_(src)`` does
 * block after block) walks each block's rows down the whole matrix: with rows of several KiB every
 * row is on another 4 KiB page, so a permutation of many narrow column blocks misses the TLB on
 * nearly every row of every block. Here each row copies all its blocks before the next row: the
 * pages of one source row and one destination row serve every block. Rows are split over
 * ``threads`` OpenMP threads; blocks must not overlap (each byte of the result is written once). */
#include <stdint.h>

#include "common.h"

void neorec_copy_blocks(int64_t rows, int64_t count, const int64_t *src, const int64_t *src_stride,
                        const int64_t *dst, const int64_t *dst_stride, const int64_t *bytes, int64_t threads) {
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t k = 0; k < count; ++k)
            copy_bytes((char *)(intptr_t)dst[k] + i * dst_stride[k],
                       (const char *)(intptr_t)src[k] + i * src_stride[k], bytes[k]);
}
