/* Native CPU kernels of the table-batched embedding op (fp32 weights).
 *
 * Built on first use by neorec/native/build.py with the system C compiler and called through ctypes
 * (neorec/embedding/kernels/native_tbe.py). Layout and semantics are those of
 * neorec/embedding/kernels/layout.py and reference.py:
 *
 *   weights: one flat fp32 buffer; table t: table_rows[t] x table_dims[t] row-major from element
 *            table_offsets[t]; row-wise state indexed by table_row_offsets[t] + id.
 *   input:   ids key-major, bag f * B + b = (feature f, sample b); bag_offsets [F * B + 1];
 *            optional per-value weights; "mean" features scale each value by 1 / len(bag).
 *   output:  [B, total_cols] fp32; feature f in columns col_offsets[f] .. + dim.
 *
 * Threads: OpenMP (the library is linked against the libgomp that torch has loaded, so it shares
 * torch's thread pool); the Python side splits the work into ranges, one per thread.
 *
 * Determinism: a bag is pooled in value order; a row's gradient is summed over its values in value
 * order (the radix sort below is stable) and every row is updated by exactly one thread (ranges of
 * one step cover disjoint sets of tables), so the result does not depend on the number of threads.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

#define PREFETCH_DISTANCE 24
#define GRADIENT_PREFETCH_DISTANCE 16
#define FLOATS_PER_LINE 16

/* Prefetch every cache line of a row (one prefetch would bring only the first 64 bytes). */
static inline void prefetch_row(const float *row, int64_t dim, int write) {
    for (int64_t d = 0; d < dim; d += FLOATS_PER_LINE) {
        if (write) __builtin_prefetch(row + d, 1);
        else __builtin_prefetch(row + d, 0);
    }
    if (write) __builtin_prefetch(row + dim - 1, 1); /* the last line when dim is not a multiple */
    else __builtin_prefetch(row + dim - 1, 0);
}

/* ----------------------------------------------------------------------------------- forward */

/* One bag of one table: dst[0..dim) = sum of its rows (times scale). Returns -1, or the position of
 * an id outside the table. */
INLINE int64_t pool_bag(const float *base, int64_t rows, const int64_t dim, const int64_t *ids, int64_t start,
                        int64_t end, int64_t feature_end, const float *value_weights, float mean_scale, int scaled,
                        float *restrict dst) {
    if (end - start == 1 && !scaled) { /* one id: a copy (bags of one id are common) */
        if (start + PREFETCH_DISTANCE < feature_end) {
            const int64_t ahead = ids[start + PREFETCH_DISTANCE];
            if (ahead >= 0 && ahead < rows) prefetch_row(base + ahead * dim, dim, 0);
        }
        const int64_t id = ids[start];
        if (id < 0 || id >= rows) return start;
        for (int64_t d = 0; d < dim; ++d) dst[d] = base[id * dim + d];
        return -1;
    }
    float acc[dim];
    for (int64_t d = 0; d < dim; ++d) acc[d] = 0.0f;
    for (int64_t i = start; i < end; ++i) {
        if (i + PREFETCH_DISTANCE < feature_end) {
            const int64_t ahead = ids[i + PREFETCH_DISTANCE];
            if (ahead >= 0 && ahead < rows) prefetch_row(base + ahead * dim, dim, 0);
        }
        const int64_t id = ids[i];
        if (id < 0 || id >= rows) return i;
        const float *restrict row = base + id * dim;
        if (scaled) {
            const float scale = (value_weights ? value_weights[i] : 1.0f) * mean_scale;
            for (int64_t d = 0; d < dim; ++d) acc[d] += scale * row[d];
        } else {
            for (int64_t d = 0; d < dim; ++d) acc[d] += row[d];
        }
    }
    for (int64_t d = 0; d < dim; ++d) dst[d] = acc[d];
    return -1;
}

/* Pools bags [bag_begin, bag_end). Returns -1, or the position of the first id (in that range)
 * outside its table, in which case the output of the range is not complete. Rows are prefetched
 * PREFETCH_DISTANCE values ahead, across bags of the same feature (bags of one id are common). */
static int64_t forward_range(const float *weights, const int64_t *table_offsets, const int32_t *table_dims,
                             const int64_t *table_rows, const int32_t *feature_table, const int32_t *feature_mean,
                             const int64_t *col_offsets, const int64_t *ids, const int64_t *bag_offsets,
                             const float *value_weights, int64_t batch_size, int64_t total_cols, int64_t bag_begin,
                             int64_t bag_end, float *out) {
    for (int64_t bag = bag_begin; bag < bag_end; ++bag) {
        const int64_t feature = bag / batch_size, sample = bag - feature * batch_size;
        const int32_t table = feature_table[feature];
        const int64_t dim = table_dims[table], rows = table_rows[table];
        const int64_t feature_end = bag_offsets[(feature + 1) * batch_size];
        const float *base = weights + table_offsets[table];
        float *dst = out + sample * total_cols + col_offsets[feature];
        const int64_t start = bag_offsets[bag], end = bag_offsets[bag + 1];
        const float mean_scale = (feature_mean[feature] && end > start) ? 1.0f / (float)(end - start) : 1.0f;
        const int scaled = value_weights != NULL || feature_mean[feature];
        int64_t bad = -1;
        FOR_DIM(dim, bad = pool_bag(base, rows, D, ids, start, end, feature_end, value_weights, mean_scale, scaled, dst))
        if (bad >= 0) return bad;
    }
    return -1;
}

/* Pools the bags of ``parts`` ranges [ranges[2p], ranges[2p + 1]), one OpenMP thread each. Returns
 * -1, or the smallest position of an id outside its table (the output is then incomplete). */
int64_t neorec_forward(const float *weights, const int64_t *table_offsets, const int32_t *table_dims,
                       const int64_t *table_rows, const int32_t *feature_table, const int32_t *feature_mean,
                       const int64_t *col_offsets, const int64_t *ids, const int64_t *bag_offsets,
                       const float *value_weights, int64_t batch_size, int64_t total_cols, const int64_t *ranges,
                       int64_t parts, float *out) {
    int64_t first_bad = INT64_MAX;
#pragma omp parallel for num_threads((int)parts) schedule(static, 1) reduction(min : first_bad)
    for (int64_t p = 0; p < parts; ++p) {
        const int64_t bad = forward_range(weights, table_offsets, table_dims, table_rows, feature_table, feature_mean,
                                          col_offsets, ids, bag_offsets, value_weights, batch_size, total_cols,
                                          ranges[2 * p], ranges[2 * p + 1], out);
        if (bad >= 0 && bad < first_bad) first_bad = bad;
    }
    return first_bad == INT64_MAX ? -1 : first_bad;
}

/* ----------------------------------------------------------------------------------- backward */

#define RADIX_BITS 9
#define RADIX_SIZE (1 << RADIX_BITS)

enum { KIND_SGD = 0, KIND_ROWWISE_ADAGRAD = 1, KIND_ADAGRAD = 2 };

/* Stable LSD radix sort of (key, bag[, scale]) by key; the result is left in the first buffers. */
static void sort_by_key(int64_t n, int32_t key_bits, uint32_t *keys, uint32_t *keys_tmp, int32_t *bags,
                        int32_t *bags_tmp, float *scales, float *scales_tmp) {
    int64_t counts[RADIX_SIZE];
    int passes = 0;
    for (int32_t low = 0; low < key_bits; low += RADIX_BITS, ++passes) {
        memset(counts, 0, sizeof(counts));
        for (int64_t i = 0; i < n; ++i) counts[(keys[i] >> low) & (RADIX_SIZE - 1)]++;
        int64_t total = 0;
        for (int d = 0; d < RADIX_SIZE; ++d) {
            const int64_t c = counts[d];
            counts[d] = total;
            total += c;
        }
        for (int64_t i = 0; i < n; ++i) {
            const int64_t to = counts[(keys[i] >> low) & (RADIX_SIZE - 1)]++;
            keys_tmp[to] = keys[i];
            bags_tmp[to] = bags[i];
            if (scales) scales_tmp[to] = scales[i];
        }
        uint32_t *k = keys; keys = keys_tmp; keys_tmp = k;
        int32_t *b = bags; bags = bags_tmp; bags_tmp = b;
        float *s = scales; scales = scales_tmp; scales_tmp = s;
    }
    if (passes % 2 == 1) { /* the result is in the scratch buffers: move it back */
        memcpy(keys_tmp, keys, (size_t)n * sizeof(uint32_t));
        memcpy(bags_tmp, bags, (size_t)n * sizeof(int32_t));
        if (scales) memcpy(scales_tmp, scales, (size_t)n * sizeof(float));
    }
}

static inline int32_t bits_for(int64_t count) {
    int32_t bits = 1;
    while (bits < 63 && ((int64_t)1 << bits) < count) ++bits;
    return bits;
}

/* Gradient columns of the bag's value: grad_output[sample, col_offsets[feature] ...]. */
static inline const float *gradient_of(const float *grad_output, int32_t bag, int32_t batch_size,
                                       int64_t total_cols, const int64_t *col_offsets) {
    const int32_t feature = bag / batch_size;
    return grad_output + (int64_t)(bag - feature * batch_size) * total_cols + col_offsets[feature];
}

/* The update of one table's sorted values: each run of equal keys is one row; its gradient is
 * summed over the run in order, then the optimizer steps the row. Returns the rows updated. */
INLINE int64_t update_sorted(int32_t kind, float *restrict rows_base, float *restrict state_base, const int64_t dim,
                             const uint32_t *keys, const int32_t *bags, const float *scales, int64_t n,
                             int32_t batch_size, int64_t total_cols, const int64_t *col_offsets,
                             const float *grad_output, float learning_rate, float eps, float weight_decay,
                             uint8_t *modified) {
    int64_t updated = 0;
    int64_t ahead = 0; /* first value of the row PREFETCH_DISTANCE rows ahead */
    for (int r = 0; r < PREFETCH_DISTANCE && ahead < n; ++r) {
        const uint32_t key = keys[ahead];
        while (ahead < n && keys[ahead] == key) ++ahead;
    }
    float g[dim];
    for (int64_t lo = 0; lo < n;) {
        int64_t hi = lo + 1;
        while (hi < n && keys[hi] == keys[lo]) ++hi;
        if (ahead < n) {
            const uint32_t key = keys[ahead];
            prefetch_row(rows_base + (int64_t)key * dim, dim, 1);
            if (kind == KIND_ROWWISE_ADAGRAD) __builtin_prefetch(state_base + key, 1);
            while (ahead < n && keys[ahead] == key) ++ahead;
        }
        const int64_t id = keys[lo];
        float *restrict row = rows_base + id * dim;
        for (int64_t d = 0; d < dim; ++d) g[d] = 0.0f;
        for (int64_t k = lo; k < hi; ++k) {
            if (k + GRADIENT_PREFETCH_DISTANCE < n)
                prefetch_row(gradient_of(grad_output, bags[k + GRADIENT_PREFETCH_DISTANCE], batch_size, total_cols,
                                         col_offsets), dim, 0);
            const float *restrict src = gradient_of(grad_output, bags[k], batch_size, total_cols, col_offsets);
            if (scales) {
                const float scale = scales[k];
                for (int64_t d = 0; d < dim; ++d) g[d] += scale * src[d];
            } else {
                for (int64_t d = 0; d < dim; ++d) g[d] += src[d];
            }
        }
        if (weight_decay != 0.0f)
            for (int64_t d = 0; d < dim; ++d) g[d] += weight_decay * row[d];
        if (kind == KIND_SGD) {
            const float step = -learning_rate;
            for (int64_t d = 0; d < dim; ++d) row[d] += g[d] * step;
        } else if (kind == KIND_ROWWISE_ADAGRAD) {
            const float squares = dot(g, g, dim);
            const float sum = state_base[id] + squares / (float)dim;
            state_base[id] = sum;
            const float step = (1.0f / (sqrtf(sum) + eps)) * -learning_rate;
            for (int64_t d = 0; d < dim; ++d) row[d] += g[d] * step;
        } else { /* KIND_ADAGRAD: state laid out like the weights */
            float *restrict s = state_base + id * dim;
            for (int64_t d = 0; d < dim; ++d) {
                s[d] += g[d] * g[d];
                row[d] += g[d] / (sqrtf(s[d]) + eps) * -learning_rate;
            }
        }
        if (modified) modified[id] = 1;
        ++updated;
        lo = hi;
    }
    return updated;
}

/* One table (its features [feature_begin, feature_end) are adjacent): sort its n values by row,
 * then sum each row's gradient over its values in value order and apply the optimizer once.
 * Returns the rows updated, or -1 (nothing written) when an id lies outside the table. */
static int64_t update_table(int32_t kind, float *restrict rows_base, float *restrict state_base, int64_t dim,
                            int64_t num_rows, const int32_t *feature_mean, const int64_t *col_offsets,
                            const int64_t *ids, const int64_t *bag_offsets, const float *value_weights,
                            int32_t batch_size, int64_t total_cols, const float *grad_output,
                            int64_t feature_begin, int64_t feature_end, float learning_rate, float eps,
                            float weight_decay, uint8_t *modified, uint32_t *keys, uint32_t *keys_tmp,
                            int32_t *bags, int32_t *bags_tmp, float *scales, float *scales_tmp) {
    const int64_t first = bag_offsets[feature_begin * batch_size];
    const int64_t n = bag_offsets[feature_end * batch_size] - first;
    if (n <= 0) return 0;
    int scaled = value_weights != NULL;
    for (int64_t f = feature_begin; f < feature_end; ++f) scaled |= feature_mean[f];
    if (!scaled) scales = scales_tmp = NULL;
    for (int64_t bag = feature_begin * batch_size; bag < feature_end * batch_size; ++bag) {
        const int64_t lo = bag_offsets[bag], hi = bag_offsets[bag + 1];
        const float mean_scale = (feature_mean[bag / batch_size] && hi > lo) ? 1.0f / (float)(hi - lo) : 1.0f;
        for (int64_t i = lo; i < hi; ++i) {
            if (ids[i] < 0 || ids[i] >= num_rows) return -1; /* changed since the forward checked them */
            keys[i - first] = (uint32_t)ids[i];
            bags[i - first] = (int32_t)bag;
            if (scaled) scales[i - first] = (value_weights ? value_weights[i] : 1.0f) * mean_scale;
        }
    }
    sort_by_key(n, bits_for(num_rows), keys, keys_tmp, bags, bags_tmp, scales, scales_tmp);

    int64_t updated = 0;
    FOR_DIM(dim, updated = update_sorted(kind, rows_base, state_base, D, keys, bags, scales, n, batch_size, total_cols,
                                         col_offsets, grad_output, learning_rate, eps, weight_decay, modified))
    return updated;
}

/* The fused backward of features [feature_begin, feature_end), whose tables no other range of the
 * same step touches (a table's features are adjacent), table by table: the values of a table are
 * sorted by row (stable), each row's gradient is summed over its values in value order and the
 * optimizer is applied once per row. Scratch: this range's own (see neorec_backward_update). */
static int64_t update_features(int32_t kind, float *weights, float *state, const int64_t *table_offsets,
                               const int32_t *table_dims, const int64_t *table_rows,
                               const int64_t *table_row_offsets, const int32_t *feature_table,
                               const int32_t *feature_mean, const int64_t *col_offsets, const int64_t *ids,
                               const int64_t *bag_offsets, const float *value_weights, int64_t batch_size,
                               int64_t total_cols, const float *grad_output, int64_t feature_begin,
                               int64_t feature_end, float learning_rate, float eps, float weight_decay,
                               uint8_t *modified, uint32_t *keys, uint32_t *keys_tmp, int32_t *bags,
                               int32_t *bags_tmp, float *scales, float *scales_tmp) {
    const int64_t first = bag_offsets[feature_begin * batch_size];
    int64_t updated = 0;
    for (int64_t begin = feature_begin; begin < feature_end;) {
        const int32_t table = feature_table[begin];
        int64_t end = begin + 1;
        while (end < feature_end && feature_table[end] == table) ++end;
        const int64_t skip = bag_offsets[begin * batch_size] - first; /* this table's scratch */
        const int64_t dim = table_dims[table];
        float *state_base = NULL;
        if (kind == KIND_ROWWISE_ADAGRAD) state_base = state + table_row_offsets[table];
        if (kind == KIND_ADAGRAD) state_base = state + table_offsets[table];
        const int64_t rows = update_table(kind, weights + table_offsets[table], state_base, dim, table_rows[table],
                                feature_mean, col_offsets, ids, bag_offsets, value_weights, (int32_t)batch_size,
                                total_cols, grad_output, begin, end, learning_rate, eps, weight_decay,
                                modified ? modified + table_row_offsets[table] : NULL, keys + skip,
                                keys_tmp + skip, bags + skip, bags_tmp + skip, scales ? scales + skip : NULL,
                                scales_tmp ? scales_tmp + skip : NULL);
        if (rows < 0) return -1;
        updated += rows;
        begin = end;
    }
    return updated;
}

/* One optimizer step on every row the batch touched: ``parts`` feature ranges [groups[2p],
 * groups[2p + 1]) that share no table, one OpenMP thread each.
 *
 * state: [total_rows] (row-wise AdaGrad), flat like the weights (AdaGrad) or NULL (SGD).
 * modified (nullable): [total_rows] flags set for every updated row.
 * Scratch, n = all values of the batch (a range uses the part at its values' offset): keys,
 * keys_tmp (uint32 [n]), bags, bags_tmp (int32 [n]), scales, scales_tmp (float [n] or NULL; needed
 * when values are weighted or a feature is mean-pooled). Returns the number of rows updated, or -1
 * when an id lies outside its table (the ids changed after the forward checked them): that table
 * is left untouched, others may have been updated. */
int64_t neorec_backward_update(int32_t kind, float *weights, float *state, const int64_t *table_offsets,
                               const int32_t *table_dims, const int64_t *table_rows,
                               const int64_t *table_row_offsets, const int32_t *feature_table,
                               const int32_t *feature_mean, const int64_t *col_offsets, const int64_t *ids,
                               const int64_t *bag_offsets, const float *value_weights, int64_t batch_size,
                               int64_t total_cols, const float *grad_output, const int64_t *groups, int64_t parts,
                               float learning_rate, float eps, float weight_decay, uint8_t *modified, uint32_t *keys,
                               uint32_t *keys_tmp, int32_t *bags, int32_t *bags_tmp, float *scales,
                               float *scales_tmp) {
    const int64_t first = bag_offsets[0];
    int64_t updated = 0, failed = 0;
#pragma omp parallel for num_threads((int)parts) schedule(static, 1) reduction(+ : updated, failed)
    for (int64_t p = 0; p < parts; ++p) {
        const int64_t begin = groups[2 * p], end = groups[2 * p + 1];
        const int64_t skip = bag_offsets[begin * batch_size] - first;
        const int64_t rows = update_features(kind, weights, state, table_offsets, table_dims, table_rows, table_row_offsets,
                                   feature_table, feature_mean, col_offsets, ids, bag_offsets, value_weights,
                                   batch_size, total_cols, grad_output, begin, end, learning_rate, eps, weight_decay,
                                   modified, keys + skip, keys_tmp + skip, bags + skip, bags_tmp + skip,
                                   scales ? scales + skip : NULL, scales_tmp ? scales_tmp + skip : NULL);
        if (rows < 0) failed += 1;
        else updated += rows;
    }
    return failed ? -1 : updated;
}
