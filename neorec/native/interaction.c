/* Native CPU kernels of the DLRM dot interaction (fp32), called through ctypes by
 * neorec/model/native_interaction.py (built by neorec/native/build.py).
 *
 * Per sample b, the n = F + 1 vectors of width D are v_0 = dense[b] and v_k = sparse[b, k - 1].
 * forward:  out[b] = [dense[b], <v_i, v_j> for i < j (i <= j with self-interaction), row-major]
 * backward: with S the symmetric matrix of the pair gradients (S_ij = S_ji = g_p for the pair p =
 *           (i, j), i < j; S_ii = 2 g_p for a self pair), dv_i = sum_j S_ij v_j, and the dense
 *           vector also takes the gradient of its copy in the output.
 *
 * Only the pairs are computed (half the work of the full Gram matrix a batched matmul forms), the
 * vectors stay in L1 cache, and no [B, n, D] concatenation or [B, n, n] Gram matrix is built. Each
 * sample is handled by one (OpenMP) thread in a fixed order: the same inputs give the same bits.
 *
 * The kernels take a sample's vectors (and, backward, the rows their gradients go to) by address,
 * so the vectors need not be adjacent. The ``_vectors`` entry points read them in place from other
 * matrices (each sparse vector k at base[k] + b * stride[k] bytes: the parts a sharded embedding
 * collection received, see neorec/sharding/output_dist.py) and write their gradients the same way;
 * the ``_blocks`` ones, for vectors split over column blocks (a column-wise sharded table), gather
 * each sample's vectors into a small per-thread buffer (L1) and scatter their gradients back. Either
 * way the [B, F * D] matrix of the placement is never written nor read back, and the bits are those
 * of placement + interaction.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* Where the n vectors of one sample are: v_0 = dense and v_k = sparse + (k - 1) * dim when its F
 * sparse vectors are adjacent, or v_k = at[k] (by address). Where the rows of its gradient go:
 * likewise. The kernels below take ``by_address`` as a constant of their (inlined) call sites, so
 * the adjacent case keeps its plain offset addressing. */
typedef struct {
    const float *dense, *sparse;
    const float *const *at;
} Vectors;

typedef struct {
    float *dense, *sparse;
    float *const *at;
} Targets;

INLINE const float *vector(Vectors x, int64_t k, int64_t dim, const int by_address) {
    return by_address ? x.at[k] : k == 0 ? x.dense : x.sparse + (k - 1) * dim;
}

INLINE float *target(Targets x, int64_t k, int64_t dim, const int by_address) {
    return by_address ? x.at[k] : k == 0 ? x.dense : x.sparse + (k - 1) * dim;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_DOT_BLOCKS 1

/* out[k] = <a, v_{j+k}> for k < 8 (dim a multiple of 8): eight independent FMA chains share the
 * loads of a, then one transposing reduction. A fixed order: deterministic. */
INLINE void dots8(const float *a, Vectors x, int64_t j, int64_t dim, const int by_address, float *out) {
    const float *b[8];
    for (int k = 0; k < 8; ++k) b[k] = vector(x, j + k, dim, by_address);
    __m256 s[8];
    for (int k = 0; k < 8; ++k) s[k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 a8 = _mm256_loadu_ps(a + d);
        for (int k = 0; k < 8; ++k) s[k] = _mm256_fmadd_ps(a8, _mm256_loadu_ps(b[k] + d), s[k]);
    }
    const __m256 u0 = _mm256_hadd_ps(s[0], s[1]), u1 = _mm256_hadd_ps(s[2], s[3]);
    const __m256 u2 = _mm256_hadd_ps(s[4], s[5]), u3 = _mm256_hadd_ps(s[6], s[7]);
    const __m256 w0 = _mm256_hadd_ps(u0, u1), w1 = _mm256_hadd_ps(u2, u3);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(w0, w1, 0x20), _mm256_permute2f128_ps(w0, w1, 0x31)));
}

/* The same for four vectors. */
INLINE void dots4(const float *a, Vectors x, int64_t j, int64_t dim, const int by_address, float *out) {
    const float *b0 = vector(x, j, dim, by_address), *b1 = vector(x, j + 1, dim, by_address),
                *b2 = vector(x, j + 2, dim, by_address), *b3 = vector(x, j + 3, dim, by_address);
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 a8 = _mm256_loadu_ps(a + d);
        s0 = _mm256_fmadd_ps(a8, _mm256_loadu_ps(b0 + d), s0);
        s1 = _mm256_fmadd_ps(a8, _mm256_loadu_ps(b1 + d), s1);
        s2 = _mm256_fmadd_ps(a8, _mm256_loadu_ps(b2 + d), s2);
        s3 = _mm256_fmadd_ps(a8, _mm256_loadu_ps(b3 + d), s3);
    }
    const __m256 w = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(w), _mm256_extractf128_ps(w, 1)));
}
#endif

/* One sample. Always inlined into callers with a constant dim (the common widths), so the loops
 * over dim unroll and the accumulators live in registers; the generic call takes any dim. With
 * AVX2 and a width that is a multiple of 8, the pairs (i, j..j+7) are computed eight or four at a
 * time. */
INLINE void forward_sample(Vectors x, const int by_address, int64_t n, const int64_t dim, int32_t self_interaction,
                           float *row) {
    memcpy(row, x.dense, (size_t)dim * sizeof(float));
    float *restrict p = row + dim;
    for (int64_t i = 0; i < n; ++i) {
        const float *vi = vector(x, i, dim, by_address);
        int64_t j = self_interaction ? i : i + 1;
#ifdef HAVE_DOT_BLOCKS
        if (dim % 8 == 0) {
            if (j == 0) *p++ = dot(vi, vi, dim), j = 1; /* <v_0, v_0> alone, then groups from v_1 */
            for (; j + 8 <= n; j += 8, p += 8) dots8(vi, x, j, dim, by_address, p);
            for (; j + 4 <= n; j += 4, p += 4) dots4(vi, x, j, dim, by_address, p);
        }
#endif
        for (; j < n; ++j) *p++ = dot(vi, vector(x, j, dim, by_address), dim);
    }
}

/* The backward of one sample: row i of the result (dv_i = sum_j S_ij v_j, plus g's dense part for
 * i = 0) into target i. */
INLINE void backward_sample(const float *g, Vectors x, Targets t, const int by_address, int64_t n, const int64_t dim,
                            const float *symmetric) {
    for (int64_t i = 0; i < n; ++i) {
        float acc[dim];
        for (int64_t d = 0; d < dim; ++d) acc[d] = i == 0 ? g[d] : 0.0f;
        const float *s = symmetric + i * n;
        for (int64_t j = 0; j < n; ++j) {
            const float weight = s[j];
            const float *restrict vj = vector(x, j, dim, by_address);
            for (int64_t d = 0; d < dim; ++d) acc[d] += weight * vj[d];
        }
        float *row = target(t, i, dim, by_address);
        for (int64_t d = 0; d < dim; ++d) row[d] = acc[d];
    }
}

#ifdef HAVE_DOT_BLOCKS
/* The backward of one sample when dim is a multiple of 32, with AVX2: rows i and i + 1 of the
 * result at once, 32 floats (four registers) of each at a time, so every chunk of v_j loaded
 * serves two rows: eight FMA chains, two broadcasts and four loads per j. The sum over j runs in
 * the same order as backward_sample's (one FMA per term), so both give the same bits. */
INLINE void backward_sample_blocks(const float *g, Vectors x, Targets t, const int by_address, int64_t n,
                                   const int64_t dim, const float *symmetric) {
    for (int64_t i = 0; i < n; i += 2) {
        const int two = i + 1 < n;
        const float *s0 = symmetric + i * n, *s1 = symmetric + (i + two) * n;
        float *t0 = target(t, i, dim, by_address), *t1 = target(t, i + two, dim, by_address); /* t1 used if two */
        for (int64_t c = 0; c < dim; c += 32) {
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps(),
                   b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
            if (i == 0) {
                a0 = _mm256_loadu_ps(g + c), a1 = _mm256_loadu_ps(g + c + 8);
                a2 = _mm256_loadu_ps(g + c + 16), a3 = _mm256_loadu_ps(g + c + 24);
            }
            for (int64_t j = 0; j < n; ++j) {
                const float *vj = vector(x, j, dim, by_address) + c;
                const __m256 x0 = _mm256_loadu_ps(vj), x1 = _mm256_loadu_ps(vj + 8), x2 = _mm256_loadu_ps(vj + 16),
                             x3 = _mm256_loadu_ps(vj + 24);
                const __m256 w0 = _mm256_broadcast_ss(s0 + j), w1 = _mm256_broadcast_ss(s1 + j);
                a0 = _mm256_fmadd_ps(w0, x0, a0), a1 = _mm256_fmadd_ps(w0, x1, a1);
                a2 = _mm256_fmadd_ps(w0, x2, a2), a3 = _mm256_fmadd_ps(w0, x3, a3);
                b0 = _mm256_fmadd_ps(w1, x0, b0), b1 = _mm256_fmadd_ps(w1, x1, b1);
                b2 = _mm256_fmadd_ps(w1, x2, b2), b3 = _mm256_fmadd_ps(w1, x3, b3);
            }
            _mm256_storeu_ps(t0 + c, a0), _mm256_storeu_ps(t0 + c + 8, a1);
            _mm256_storeu_ps(t0 + c + 16, a2), _mm256_storeu_ps(t0 + c + 24, a3);
            if (two) {
                _mm256_storeu_ps(t1 + c, b0), _mm256_storeu_ps(t1 + c + 8, b1);
                _mm256_storeu_ps(t1 + c + 16, b2), _mm256_storeu_ps(t1 + c + 24, b3);
            }
        }
    }
}
#endif

/* The pair gradients of one sample (after its dense part, g + dim) as the symmetric [n, n] matrix S. */
static inline void symmetric_of(const float *g, int64_t dim, int64_t n, int32_t self_interaction, float *symmetric) {
    const float *gp = g + dim;
    for (int64_t i = 0; i < n; ++i) {
        symmetric[i * n + i] = 0.0f;
        for (int64_t j = self_interaction ? i : i + 1; j < n; ++j) {
            const float value = *gp++;
            if (i == j) {
                symmetric[i * n + i] = 2.0f * value;
            } else {
                symmetric[i * n + j] = value;
                symmetric[j * n + i] = value;
            }
        }
    }
}

/* The backward of one sample: dv_i into target i. */
INLINE void backward_one(const float *g, Vectors x, Targets t, const int by_address, int64_t n, int64_t dim,
                         int32_t self_interaction, float *symmetric) {
    symmetric_of(g, dim, n, self_interaction, symmetric);
#ifdef HAVE_DOT_BLOCKS
    if (dim % 32 == 0) {
        FOR_DIM(dim, backward_sample_blocks(g, x, t, by_address, n, D, symmetric))
        return;
    }
#endif
    FOR_DIM(dim, backward_sample(g, x, t, by_address, n, D, symmetric))
}

/* Sample b's vectors by address: v_0 = dense_row, v_k at base[k - 1] + b * stride[k - 1] bytes. */
static inline void addresses(int64_t b, int64_t num_features, const int64_t *base, const int64_t *stride,
                             const float **at) {
    for (int64_t k = 0; k < num_features; ++k) at[k + 1] = (const float *)(intptr_t)(base[k] + b * stride[k]);
}

static void *checked_malloc(size_t bytes) {
    void *p = malloc(bytes);
    if (p == NULL) abort();
    return p;
}

/* All B samples, split evenly over ``threads`` OpenMP threads. dense [B, dim]; sparse rows of
 * sparse_stride floats holding F vectors of dim; out [B, dim + P]. */
void neorec_dot_interaction_forward(const float *dense, const float *sparse, int64_t num_features, int64_t dim,
                                    int64_t sparse_stride, int32_t self_interaction, int64_t batch, int64_t threads,
                                    float *out) {
    const int64_t n = num_features + 1;
    const int64_t pairs = self_interaction ? n * (n + 1) / 2 : n * (n - 1) / 2;
#pragma omp parallel for num_threads((int)threads) schedule(static)
    for (int64_t b = 0; b < batch; ++b) {
        const Vectors x = {dense + b * dim, sparse + b * sparse_stride, NULL};
        FOR_DIM(dim, forward_sample(x, 0, n, D, self_interaction, out + b * (D + pairs)))
    }
}

/* All B samples over ``threads`` threads. grad_out: rows of grad_stride floats holding dim + P;
 * grad_dense [B, dim]; grad_sparse [B, F * dim]. */
void neorec_dot_interaction_backward(const float *grad_out, int64_t grad_stride, const float *dense,
                                     const float *sparse, int64_t num_features, int64_t dim, int64_t sparse_stride,
                                     int32_t self_interaction, int64_t batch, int64_t threads, float *grad_dense,
                                     float *grad_sparse) {
    const int64_t n = num_features + 1;
#pragma omp parallel num_threads((int)threads)
    {
        float *symmetric = checked_malloc((size_t)(n * n) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; ++b) {
            const Vectors x = {dense + b * dim, sparse + b * sparse_stride, NULL};
            const Targets t = {grad_dense + b * dim, grad_sparse + b * (n - 1) * dim, NULL};
            backward_one(grad_out + b * grad_stride, x, t, 0, n, dim, self_interaction, symmetric);
        }
        free(symmetric);
    }
}

/* neorec_dot_interaction_forward with sparse vector k of sample b at base[k] + b * stride[k] bytes
 * (anywhere: the parts a sharded collection received, read in place). */
void neorec_dot_interaction_forward_vectors(const float *dense, int64_t num_features, int64_t dim,
                                            int32_t self_interaction, int64_t batch, int64_t threads,
                                            const int64_t *base, const int64_t *stride, float *out) {
    const int64_t n = num_features + 1;
    const int64_t pairs = self_interaction ? n * (n + 1) / 2 : n * (n - 1) / 2;
#pragma omp parallel num_threads((int)threads)
    {
        const float **at = checked_malloc((size_t)n * sizeof(*at));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; ++b) {
            at[0] = dense + b * dim;
            addresses(b, num_features, base, stride, at);
            const Vectors x = {at[0], NULL, at};
            FOR_DIM(dim, forward_sample(x, 1, n, D, self_interaction, out + b * (D + pairs)))
        }
        free(at);
    }
}

/* neorec_dot_interaction_backward with the sparse vectors as in the forward (base, stride) and the
 * gradient of vector k of sample b written to grad_base[k] + b * grad_stride_bytes[k] bytes. */
void neorec_dot_interaction_backward_vectors(const float *grad_out, int64_t grad_stride, const float *dense,
                                             int64_t num_features, int64_t dim, int32_t self_interaction,
                                             int64_t batch, int64_t threads, const int64_t *base,
                                             const int64_t *stride, const int64_t *grad_base,
                                             const int64_t *grad_stride_bytes, float *grad_dense) {
    const int64_t n = num_features + 1;
#pragma omp parallel num_threads((int)threads)
    {
        float *symmetric = checked_malloc((size_t)(n * n) * sizeof(float));
        const float **at = checked_malloc((size_t)(2 * n) * sizeof(*at));
        float **to = (float **)(at + n);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; ++b) {
            at[0] = dense + b * dim;
            addresses(b, num_features, base, stride, at);
            to[0] = grad_dense + b * dim;
            addresses(b, num_features, grad_base, grad_stride_bytes, (const float **)to);
            const Vectors x = {at[0], NULL, at};
            const Targets t = {to[0], NULL, to};
            backward_one(grad_out + b * grad_stride, x, t, 1, n, dim, self_interaction, symmetric);
        }
        free(symmetric);
        free(at);
    }
}

/* Block k of the sparse vectors: bytes[k] bytes of each sample's row b at src[k] + b * src_stride[k]
 * are bytes dst[k] .. dst[k] + bytes[k] of the sample's [F * dim] vectors. The blocks cover those
 * F * dim floats exactly once. */
static inline void gather(int64_t b, int64_t count, const int64_t *src, const int64_t *src_stride,
                          const int64_t *dst, const int64_t *bytes, float *vectors) {
    for (int64_t k = 0; k < count; ++k)
        copy_bytes((char *)vectors + dst[k], (const char *)(intptr_t)src[k] + b * src_stride[k], bytes[k]);
}

/* The reverse of gather: the sample's [F * dim] vector gradients into blocks at dst[k] + b * dst_stride[k]. */
static inline void scatter(int64_t b, int64_t count, const int64_t *dst, const int64_t *dst_stride,
                           const int64_t *offset, const int64_t *bytes, const float *vectors) {
    for (int64_t k = 0; k < count; ++k)
        copy_bytes((char *)(intptr_t)dst[k] + b * dst_stride[k], (const char *)vectors + offset[k], bytes[k]);
}

/* neorec_dot_interaction_forward with the sparse vectors in ``count`` column blocks (see gather),
 * for vectors split over blocks; the _vectors entry points read whole vectors in place. */
void neorec_dot_interaction_forward_blocks(const float *dense, int64_t num_features, int64_t dim,
                                           int32_t self_interaction, int64_t batch, int64_t threads, int64_t count,
                                           const int64_t *src, const int64_t *src_stride, const int64_t *dst,
                                           const int64_t *bytes, float *out) {
    const int64_t n = num_features + 1;
    const int64_t pairs = self_interaction ? n * (n + 1) / 2 : n * (n - 1) / 2;
#pragma omp parallel num_threads((int)threads)
    {
        float *vectors = checked_malloc((size_t)(num_features * dim) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; ++b) {
            gather(b, count, src, src_stride, dst, bytes, vectors);
            const Vectors x = {dense + b * dim, vectors, NULL};
            FOR_DIM(dim, forward_sample(x, 0, n, D, self_interaction, out + b * (D + pairs)))
        }
        free(vectors);
    }
}

/* neorec_dot_interaction_backward with the sparse vectors in column blocks (src, src_stride, dst,
 * bytes as in the forward) and their gradients written to the same blocks of other matrices:
 * grad_src[k] + b * grad_src_stride[k]. */
void neorec_dot_interaction_backward_blocks(const float *grad_out, int64_t grad_stride, const float *dense,
                                            int64_t num_features, int64_t dim, int32_t self_interaction,
                                            int64_t batch, int64_t threads, int64_t count, const int64_t *src,
                                            const int64_t *src_stride, const int64_t *dst, const int64_t *bytes,
                                            const int64_t *grad_src, const int64_t *grad_src_stride,
                                            float *grad_dense) {
    const int64_t n = num_features + 1;
#pragma omp parallel num_threads((int)threads)
    {
        float *symmetric = checked_malloc((size_t)(n * n) * sizeof(float));
        float *vectors = checked_malloc((size_t)(2 * num_features * dim) * sizeof(float));
        float *grads = vectors + num_features * dim;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < batch; ++b) {
            gather(b, count, src, src_stride, dst, bytes, vectors);
            const Vectors x = {dense + b * dim, vectors, NULL};
            const Targets t = {grad_dense + b * dim, grads, NULL};
            backward_one(grad_out + b * grad_stride, x, t, 0, n, dim, self_interaction, symmetric);
            scatter(b, count, grad_src, grad_src_stride, dst, bytes, grads);
        }
        free(symmetric);
        free(vectors);
    }
}
