/* Attention of short blocks (decode and verify rows) to pasts of any length, read in place.
 *
 * One call attends every short row of a packed pass at one layer: row r brings n_r new positions
 * whose queries (G per key/value head) see keys 0 .. past_r + j; its keys/values lie in segments
 * (shared prefix views, then the session's own buffer), each `[2, layers, kv_heads, positions,
 * head_dim]` with any strides but a contiguous head_dim. Nothing is copied or repeated.
 *
 * Work is split as flash-decoding does: an item is (row, key/value head, chunk of CHUNK key
 * positions); it computes, for all G * n queries of that head, the chunk's scores, their maximum
 * m, the sum l of exp(score - m) and the exp-weighted sum of values. Every key and value row is
 * read from memory once per item, for all the queries that share it (grouped-query attention is
 * why a per-query kernel reads it G times). A second loop merges each query's chunks:
 * out = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c. Items and merges run on `threads`
 * OpenMP threads (torch's own runtime: this library links the libgomp that torch loaded; the caller
 * passes torch's intra-op thread count, so --threads holds here too).
 *
 * Built by specdec.runtime.native with -O3 -march=native -mtune=generic -ffast-math. The
 * code never produces an infinity or NaN (a masked key is left out of the loops, not set to
 * -inf), which -ffast-math's finite-math assumption requires. float32 on AVX2/FMA runs the
 * register-blocked loops below, and with AVX-512 wider ones (8 keys a block for 3 queries; 5
 * queries a pass over the values); other types and machines run the plain loops, which the compiler
 * vectorises. float64 is there so that tests can compare with an exact reference.
 *
 * This file holds what does not depend on the element type and the float32 vector loops; the work
 * items, the merge and the entry points specdec_attend_f32 and specdec_attend_f64 are in
 * attend_impl.h, included at the end once per type. They return a `specdec_status` (status.h).
 *
 * Every buffer comes with its sizes and the bytes of storage behind its pointer, and `check_call`
 * refuses (SPECDEC_OUT_OF_BOUNDS) a call whose plan would read or write past any of them, before
 * anything is stored: keys and values can come from another replica through Redis, and the Python
 * side's checks (`native_attention`, `kv_buffer`) are the first line, this the last.
 * `tests/unit/test_native_asan.py` runs the kernels' tests under AddressSanitizer. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "status.h"

/* Key positions per work item: a chunk's keys and values (512 KB at head_dim 64) stay in L2 between
 * loops. Measured against 256 and 512 (30 layers, medians of 9, side by side): 8 rows x 4096 x 3
 * positions 78.9 / 73.4 / 71.4 ms, 16 x 2000 x 1 58.6 / 59.3 / 51.0, 8 x 8000 x 1 121.3 / 112.6 /
 * 107.4; one short row loses a little (1 x 1024 x 3: 3.0 / 3.2 / 3.2 ms). */
#define CHUNK 1024
#define MAXQ 64    /* most queries (G * n) per row and head; longer blocks take the matmul path */
#define MAXDIM 256 /* largest head_dim */
#define MAXHEADS 4096 /* most key/value heads */
#define SUB 32     /* keys per pass of the value loops: their rows stay in L1 across the passes */
/* The vector loops' first pass over the keys (values) of an item asks for the row AHEAD_KEYS
 * (AHEAD_VALUES) positions on. The hardware prefetcher follows these streams, but not far enough
 * ahead while the loops compute. Measured on 2 cores, 30 layers, medians of 9 side by side, without
 * and with: 8 rows x 4096 x 3 positions 76.3 -> 61.3 ms (AVX2 build: 103.5 -> 75.6), 16 x 2000 x 1
 * 58.2 -> 45.5, 8 x 4096 x 5 97.5 -> 75.7. Keys 32 ahead, or values 64, or the keys' stream running
 * on into the values, were no better; prefetching a whole item's values during its scores, and the
 * next item's keys during its values, was worse (bursts of a thousand requests). */
#define AHEAD_KEYS 16
#define AHEAD_VALUES 32

/* Of the m rows from p that a pass of the value loops reads, how many have a row AHEAD_VALUES on
 * among the `count`. */
static inline int64_t rows_ahead(int64_t count, int64_t p, int64_t m) {
    int64_t left = count - p - AHEAD_VALUES;
    return left <= 0 ? 0 : left < m ? left : m;
}

/* Ask for the `bytes` of a key or value row to be brought into cache. */
static inline void fetch_row(const void *row, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)row + o, 0, 3);
}

/* This thread's buffer `slot` of at least `bytes`, kept for its next call (OpenMP keeps its threads):
 * a work item's scores (256 KB) were an mmap and a munmap through malloc per thread and call, a
 * decode step 30 calls of a few microseconds' work each. Slots: 0 scores, 1 key/value row pointers
 * (any thread); 2 the items' first indices, 3 their states (the calling thread, outside the
 * parallel region). */
static void *scratch_bytes(int slot, size_t bytes) {
    static __thread void *buf[4];
    static __thread size_t size[4];
    if (!buf[slot] || size[slot] < bytes) {
        free(buf[slot]);
        size[slot] = (bytes / 4096 + 1) * 4096; /* never 0: a call with no items still gets a buffer */
        buf[slot] = aligned_alloc(64, size[slot]);
        if (!buf[slot]) size[slot] = 0;
    }
    return buf[slot];
}

/* Plain loops: scores[i * CHUNK + p] = scale * q_i . k_p; acc[i] = sum_p w[i * CHUNK + p] v_p. */
#define DEFINE_LOOPS(T, NAME)                                                                       \
    static void NAME##_scores(const T *qs, int nq, int dim, const T *const *keys, int64_t count,    \
                              T scale, T *scores) {                                                 \
        for (int64_t p = 0; p < count; p++)                                                         \
            for (int i = 0; i < nq; i++) {                                                          \
                const T *x = qs + i * dim, *k = keys[p];                                            \
                T sum = 0;                                                                          \
                _Pragma("omp simd reduction(+:sum)") for (int e = 0; e < dim; e++) sum += x[e] * k[e]; \
                scores[i * CHUNK + p] = sum * scale;                                                \
            }                                                                                       \
    }                                                                                               \
    static void NAME##_values(const T *w, int nq, int dim, const T *const *values, int64_t count,   \
                              T *acc) {                                                             \
        memset(acc, 0, sizeof(T) * nq * dim);                                                       \
        for (int64_t p = 0; p < count; p++)                                                         \
            for (int i = 0; i < nq; i++) {                                                          \
                T x = w[i * CHUNK + p], *o = acc + i * dim;                                         \
                const T *v = values[p];                                                             \
                _Pragma("omp simd") for (int e = 0; e < dim; e++) o[e] += x * v[e];                 \
            }                                                                                       \
    }

DEFINE_LOOPS(float, plain_f32)
DEFINE_LOOPS(double, plain_f64)
#define scores_f64 plain_f64_scores
#define values_f64 plain_f64_values

#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"

/* Scores of 3 queries against 4 keys (twelve accumulators; dim a multiple of 8). */
static inline void scores_3x4(const float *q0, const float *q1, const float *q2, const float *const *k,
                              int dim, __m128 scale, float *d0, float *d1, float *d2) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
           a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int e = 0; e < dim; e += 8) {
        __m256 x0 = _mm256_loadu_ps(q0 + e), x1 = _mm256_loadu_ps(q1 + e), x2 = _mm256_loadu_ps(q2 + e), y;
        y = _mm256_loadu_ps(k[0] + e);
        a00 = _mm256_fmadd_ps(x0, y, a00), a10 = _mm256_fmadd_ps(x1, y, a10), a20 = _mm256_fmadd_ps(x2, y, a20);
        y = _mm256_loadu_ps(k[1] + e);
        a01 = _mm256_fmadd_ps(x0, y, a01), a11 = _mm256_fmadd_ps(x1, y, a11), a21 = _mm256_fmadd_ps(x2, y, a21);
        y = _mm256_loadu_ps(k[2] + e);
        a02 = _mm256_fmadd_ps(x0, y, a02), a12 = _mm256_fmadd_ps(x1, y, a12), a22 = _mm256_fmadd_ps(x2, y, a22);
        y = _mm256_loadu_ps(k[3] + e);
        a03 = _mm256_fmadd_ps(x0, y, a03), a13 = _mm256_fmadd_ps(x1, y, a13), a23 = _mm256_fmadd_ps(x2, y, a23);
    }
    _mm_storeu_ps(d0, _mm_mul_ps(sum4(a00, a01, a02, a03), scale));
    _mm_storeu_ps(d1, _mm_mul_ps(sum4(a10, a11, a12, a13), scale));
    _mm_storeu_ps(d2, _mm_mul_ps(sum4(a20, a21, a22, a23), scale));
}

#ifdef __AVX512F__
/* AVX-512 (16 lanes, 32 registers): the same loops, wider, with more queries and keys per register
 * block, so each key or value row loaded from L1 feeds more multiply-adds. Measured on 2 cores
 * (30 layers, 3 key/value heads of 64, medians of 9, against the AVX2 loops side by side): keys and
 * values in cache, 8 rows x 4096 x 3 positions 48.2 -> 31.9 ms; read from memory 107.4 -> 84.5 ms,
 * 16 rows x 2000 x 1 63.4 -> 54.0 ms. */

/* Scores of 3 queries against 8 keys (24 accumulators; dim a multiple of 16). */
static inline void scores_3x8(const float *q0, const float *q1, const float *q2, const float *const *k, int dim,
                              __m128 scale, float *d0, float *d1, float *d2) {
    __m512 a[3][8];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 8; j++) a[i][j] = _mm512_setzero_ps();
    for (int e = 0; e < dim; e += 16) {
        __m512 x0 = _mm512_loadu_ps(q0 + e), x1 = _mm512_loadu_ps(q1 + e), x2 = _mm512_loadu_ps(q2 + e);
        for (int j = 0; j < 8; j++) {
            __m512 y = _mm512_loadu_ps(k[j] + e);
            a[0][j] = _mm512_fmadd_ps(x0, y, a[0][j]), a[1][j] = _mm512_fmadd_ps(x1, y, a[1][j]);
            a[2][j] = _mm512_fmadd_ps(x2, y, a[2][j]);
        }
    }
    float *d[3] = {d0, d1, d2};
    for (int i = 0; i < 3; i++) {
        _mm_storeu_ps(d[i], _mm_mul_ps(sum4(fold(a[i][0]), fold(a[i][1]), fold(a[i][2]), fold(a[i][3])), scale));
        _mm_storeu_ps(d[i] + 4, _mm_mul_ps(sum4(fold(a[i][4]), fold(a[i][5]), fold(a[i][6]), fold(a[i][7])), scale));
    }
}

static void scores_512(const float *qs, int nq, int dim, const float *const *keys, int64_t count, float scale,
                       float *scores) {
    __m128 s = _mm_set1_ps(scale);
    float spare[16], tail[3][8];
    for (int i = 0; i < nq; i += 3) { /* missing queries of the last triple repeat the first; results dropped */
        const float *q0 = qs + i * dim, *q1 = i + 1 < nq ? q0 + dim : q0, *q2 = i + 2 < nq ? q0 + 2 * dim : q0;
        float *d0 = scores + i * CHUNK;
        int64_t p = 0;
        for (; p + 8 <= count; p += 8) {
            for (int64_t a = p + AHEAD_KEYS; i == 0 && a < p + AHEAD_KEYS + 8 && a < count; a++)
                fetch_row(keys[a], dim * 4);
            scores_3x8(q0, q1, q2, keys + p, dim, s, d0 + p, i + 1 < nq ? d0 + CHUNK + p : spare,
                       i + 2 < nq ? d0 + 2 * CHUNK + p : spare + 8);
        }
        if (p < count) { /* the last 1-7 keys, with the first of them repeated */
            const float *k[8];
            for (int j = 0; j < 8; j++) k[j] = keys[p + j < count ? p + j : p];
            scores_3x8(q0, q1, q2, k, dim, s, tail[0], tail[1], tail[2]);
            for (int r = 0; r < 3 && i + r < nq; r++)
                for (int64_t j = 0; p + j < count; j++) d0[r * CHUNK + p + j] = tail[r][j];
        }
    }
}

/* acc[i][e0 .. e0 + 64) += sum_p w[i * CHUNK + p] v_p[e0 ..] for QB queries (4 * QB accumulators),
 * asking for rows ahead[0 .. ahead_n) on the way. */
#define DEFINE_VALUES512(QB)                                                                         \
    static inline void values512_##QB(const float *w, const float *const *v, int64_t count, int e0,   \
                                      float *acc, int dim, const float *const *ahead, int64_t ahead_n) {                                         \
        __m512 c[QB][4];                                                                             \
        for (int i = 0; i < QB; i++)                                                                 \
            for (int j = 0; j < 4; j++) c[i][j] = _mm512_loadu_ps(acc + i * dim + e0 + 16 * j);      \
        for (int64_t p = 0; p < count; p++) {                                                        \
            if (p < ahead_n) fetch_row(ahead[p], dim * 4); /* the first pass asks for rows ahead */ \
            const float *y = v[p] + e0;                                                              \
            __m512 y0 = _mm512_loadu_ps(y), y1 = _mm512_loadu_ps(y + 16), y2 = _mm512_loadu_ps(y + 32), \
                   y3 = _mm512_loadu_ps(y + 48);                                                     \
            for (int i = 0; i < QB; i++) {                                                           \
                __m512 x = _mm512_set1_ps(w[i * CHUNK + p]);                                         \
                c[i][0] = _mm512_fmadd_ps(x, y0, c[i][0]), c[i][1] = _mm512_fmadd_ps(x, y1, c[i][1]); \
                c[i][2] = _mm512_fmadd_ps(x, y2, c[i][2]), c[i][3] = _mm512_fmadd_ps(x, y3, c[i][3]); \
            }                                                                                        \
        }                                                                                            \
        for (int i = 0; i < QB; i++)                                                                 \
            for (int j = 0; j < 4; j++) _mm512_storeu_ps(acc + i * dim + e0 + 16 * j, c[i][j]);      \
    }
DEFINE_VALUES512(1)
DEFINE_VALUES512(2)
DEFINE_VALUES512(3)
DEFINE_VALUES512(4)
DEFINE_VALUES512(5)

static void values_512(const float *w, int nq, int dim, const float *const *values, int64_t count, float *acc) {
    memset(acc, 0, sizeof(float) * nq * dim);
    for (int64_t p = 0; p < count; p += SUB) {
        int64_t m = count - p < SUB ? count - p : SUB;
        for (int i = 0; i < nq; i += 5)
            for (int e = 0; e < dim; e += 64) {
                const float *wi = w + i * CHUNK + p;
                const float *const *vp = values + p;
                float *ai = acc + i * dim;
                int64_t an = i || e ? 0 : rows_ahead(count, p, m);
                const float *const *ah = an ? vp + AHEAD_VALUES : vp;
                switch (nq - i < 5 ? nq - i : 5) {
                case 1: values512_1(wi, vp, m, e, ai, dim, ah, an); break;
                case 2: values512_2(wi, vp, m, e, ai, dim, ah, an); break;
                case 3: values512_3(wi, vp, m, e, ai, dim, ah, an); break;
                case 4: values512_4(wi, vp, m, e, ai, dim, ah, an); break;
                default: values512_5(wi, vp, m, e, ai, dim, ah, an);
                }
            }
    }
}
#endif

static void scores_f32(const float *qs, int nq, int dim, const float *const *keys, int64_t count, float scale,
                       float *scores) {
#ifdef __AVX512F__
    if (dim % 16 == 0) {
        scores_512(qs, nq, dim, keys, count, scale, scores);
        return;
    }
#endif
    if (dim % 8) {
        plain_f32_scores(qs, nq, dim, keys, count, scale, scores);
        return;
    }
    __m128 s = _mm_set1_ps(scale);
    float spare[8], tail[3][4];
    for (int i = 0; i < nq; i += 3) { /* missing queries of the last triple repeat the first; results dropped */
        const float *q0 = qs + i * dim, *q1 = i + 1 < nq ? q0 + dim : q0, *q2 = i + 2 < nq ? q0 + 2 * dim : q0;
        float *d0 = scores + i * CHUNK;
        int64_t p = 0;
        for (; p + 4 <= count; p += 4) {
            for (int64_t a = p + AHEAD_KEYS; i == 0 && a < p + AHEAD_KEYS + 4 && a < count; a++)
                fetch_row(keys[a], dim * 4);
            scores_3x4(q0, q1, q2, keys + p, dim, s, d0 + p, i + 1 < nq ? d0 + CHUNK + p : spare,
                       i + 2 < nq ? d0 + 2 * CHUNK + p : spare + 4);
        }
        if (p < count) { /* the last 1-3 keys, with the first of them repeated */
            const float *k[4];
            for (int j = 0; j < 4; j++) k[j] = keys[p + j < count ? p + j : p];
            scores_3x4(q0, q1, q2, k, dim, s, tail[0], tail[1], tail[2]);
            for (int r = 0; r < 3 && i + r < nq; r++)
                for (int64_t j = 0; p + j < count; j++) d0[r * CHUNK + p + j] = tail[r][j];
        }
    }
}

/* acc[i][e0 .. e0 + 32) += sum_p w[i * CHUNK + p] v_p[e0 ..] for QB queries (eight accumulators for QB = 2),
 * asking for rows ahead[0 .. ahead_n) on the way. */
#define DEFINE_VALUES(QB)                                                                            \
    static inline void values_##QB##x32(const float *w, const float *const *v, int64_t count, int e0, \
                                        float *acc, int dim, const float *const *ahead, int64_t ahead_n) {                                       \
        __m256 c[QB][4];                                                                             \
        for (int i = 0; i < QB; i++)                                                                 \
            for (int j = 0; j < 4; j++) c[i][j] = _mm256_loadu_ps(acc + i * dim + e0 + 8 * j);       \
        for (int64_t p = 0; p < count; p++) {                                                        \
            if (p < ahead_n) fetch_row(ahead[p], dim * 4); /* the first pass asks for rows ahead */ \
            const float *y = v[p] + e0;                                                              \
            __m256 y0 = _mm256_loadu_ps(y), y1 = _mm256_loadu_ps(y + 8), y2 = _mm256_loadu_ps(y + 16), \
                   y3 = _mm256_loadu_ps(y + 24);                                                     \
            for (int i = 0; i < QB; i++) {                                                           \
                __m256 x = _mm256_broadcast_ss(w + i * CHUNK + p);                                   \
                c[i][0] = _mm256_fmadd_ps(x, y0, c[i][0]), c[i][1] = _mm256_fmadd_ps(x, y1, c[i][1]); \
                c[i][2] = _mm256_fmadd_ps(x, y2, c[i][2]), c[i][3] = _mm256_fmadd_ps(x, y3, c[i][3]); \
            }                                                                                        \
        }                                                                                            \
        for (int i = 0; i < QB; i++)                                                                 \
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc + i * dim + e0 + 8 * j, c[i][j]);       \
    }
DEFINE_VALUES(1)
DEFINE_VALUES(2)

static void values_f32(const float *w, int nq, int dim, const float *const *values, int64_t count, float *acc) {
#ifdef __AVX512F__
    if (dim % 64 == 0) {
        values_512(w, nq, dim, values, count, acc);
        return;
    }
#endif
    if (dim % 32) {
        plain_f32_values(w, nq, dim, values, count, acc);
        return;
    }
    memset(acc, 0, sizeof(float) * nq * dim);
    for (int64_t p = 0; p < count; p += SUB) {
        int64_t m = count - p < SUB ? count - p : SUB;
        for (int i = 0; i < nq; i += 2)
            for (int e = 0; e < dim; e += 32) {
                int64_t an = i || e ? 0 : rows_ahead(count, p, m);
                const float *const *ah = an ? values + p + AHEAD_VALUES : values;
                if (nq - i == 1)
                    values_1x32(w + i * CHUNK + p, values + p, m, e, acc + i * dim, dim, ah, an);
                else
                    values_2x32(w + i * CHUNK + p, values + p, m, e, acc + i * dim, dim, ah, an);
            }
    }
}
#else
#define scores_f32 plain_f32_scores
#define values_f32 plain_f32_values
#endif

/* A row's own buffer: the last of its segments (shared prefix views come first). */
#define OWN(segs, row) ((segs) + (row)->first_segment + (row)->segments - 1)

/* Whether the element offsets `sizes[i] - 1` times `strides[i]`, summed, plus `dim` elements of `elem`
 * bytes stay within `bytes` (no size 0; strides not negative; no overflow on the way). */
static int fits(int n, const int64_t *sizes, const int64_t *strides, int64_t dim, int64_t elem, int64_t bytes) {
    int64_t last = dim - 1, term;
    for (int i = 0; i < n; i++) {
        if (sizes[i] < 1 || strides[i] < 0) return 0;
        if (__builtin_mul_overflow(sizes[i] - 1, strides[i], &term) || __builtin_add_overflow(last, term, &last))
            return 0;
    }
    return !__builtin_mul_overflow(last + 1, elem, &term) && term <= bytes;
}

/* Whether a segment's sizes hold what the call reads (`layer`, `heads_kv` heads of `dim`, `width`
 * positions) and its sizes and strides stay within its storage. */
static int segment_fits(const segment_t *s, int layer, int heads_kv, int dim, int64_t elem) {
    if (!s->base || layer < 0 || layer >= s->layers || s->heads < heads_kv || s->dim != dim) return 0;
    if (s->width < 0 || s->width > s->positions) return 0;
    if (s->positions == 0) return 1; /* nothing to read */
    int64_t sizes[4] = {2, s->layers, s->heads, s->positions};
    int64_t strides[4] = {s->kv_stride, s->layer_stride, s->head_stride, s->pos_stride};
    return fits(4, sizes, strides, dim, elem, s->bytes);
}

/* Whether rows `[tokens, heads, dim]` fit their storage (a null base: none given, fine). */
static int rows_fit(const rows_t *t, int64_t tokens, int heads, int dim, int64_t elem) {
    if (!t || !t->base) return 1;
    int64_t sizes[2] = {tokens, heads}, strides[2] = {t->t_stride, t->h_stride};
    return fits(2, sizes, strides, dim, elem, t->bytes);
}

/* Whether the call fits the kernel and reads and writes only within what it was given, checked before
 * anything is stored: SPECDEC_OK, or what does not. Each row's queries lie among the `tokens` rows of
 * q, out (and new keys and values, when `storing`: these must not land in a shared prefix); its
 * segments lie in the array, follow each other without a gap from position 0 to its last query's
 * key, and each fits its storage (`segment_fits`). The Python side checks the same before it calls
 * (`native_attention`); this is the last line, for a plan that got past it. */
static int check_call(int rows, const row_t *row, int nsegs, const segment_t *segs, int layer, int heads_kv,
                      int groups, int dim, int64_t tokens, const rows_t *q, const rows_t *k, const rows_t *v,
                      const rows_t *out, int64_t elem) {
    int storing = k && k->base;
    if (dim < 1 || dim > MAXDIM || rows < 1 || heads_kv < 1 || heads_kv > MAXHEADS || groups < 1 || groups > MAXQ)
        return SPECDEC_BAD_SHAPE;
    if (tokens < 1 || !q || !q->base || !out || !out->base || (storing && (!v || !v->base)))
        return SPECDEC_OUT_OF_BOUNDS;
    if (!rows_fit(q, tokens, heads_kv * groups, dim, elem) || !rows_fit(out, tokens, heads_kv * groups, dim, elem) ||
        !rows_fit(k, tokens, heads_kv, dim, elem) || !rows_fit(v, tokens, heads_kv, dim, elem))
        return SPECDEC_OUT_OF_BOUNDS;
    for (int r = 0; r < rows; r++) {
        const row_t *w = row + r;
        if (w->queries < 1 || w->queries > MAXQ || w->queries * groups > MAXQ) return SPECDEC_BAD_SHAPE;
        if (w->first_query < 0 || w->first_query + (int64_t)w->queries > tokens || w->past < 0) return SPECDEC_OUT_OF_BOUNDS;
        if (w->segments < 1 || w->first_segment < 0 || (int64_t)w->first_segment + w->segments > nsegs)
            return SPECDEC_OUT_OF_BOUNDS;
        int64_t next = 0;
        for (int i = 0; i < w->segments; i++) {
            const segment_t *s = segs + w->first_segment + i;
            if (s->start != next || !segment_fits(s, layer, heads_kv, dim, elem)) return SPECDEC_OUT_OF_BOUNDS;
            next += s->width;
        }
        if (next != w->past + w->queries) return SPECDEC_OUT_OF_BOUNDS;
        if (storing && w->past < OWN(segs, w)->start) return SPECDEC_PREFIX_WRITE;
    }
    return SPECDEC_OK;
}

/* The work items of each row: first[r] .. first[r + 1] - 1, one per key/value head and chunk of CHUNK
 * keys. Returns the most queries a row brings (the size of an item's state). */
static int plan_items(int rows, const row_t *row, int heads_kv, int groups, int64_t *first) {
    int widest = 1;
    first[0] = 0;
    for (int r = 0; r < rows; r++) {
        int64_t keys = row[r].past + row[r].queries;
        widest = row[r].queries * groups > widest ? row[r].queries * groups : widest;
        first[r + 1] = first[r] + heads_kv * ((keys + CHUNK - 1) / CHUNK);
    }
    return widest;
}

/* The entry points, specdec_attend_f32 and specdec_attend_f64 (attend_impl.h, once per type). */
#define T float
#define KIND f32
#define EXP expf
#include "attend_impl.h"

#define T double
#define KIND f64
#define EXP exp
#include "attend_impl.h"
