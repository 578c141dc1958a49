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
 * register-blocked loops of attend_loops.h, and with AVX-512 wider ones (8 keys a block for 3
 * queries; 5 queries a pass over the values); other machines run the plain loops, which the
 * compiler vectorises. float64 is there so that tests can compare with an exact reference.
 * bfloat16 (a model loaded with --dtype bfloat16) is stored as it comes and computed in float32:
 * the same loops widen each key and value as they load it (exact: a bfloat16 is a float32's top
 * half), and the output is rounded once to bfloat16. torch's bfloat16 attention ran 5-8x slower
 * than its float32 attention on a CPU without AMX (see docs/benchmarks.md).
 *
 * This file holds what does not depend on the element type; the loops over keys and values are in
 * attend_loops.h (once per stored type), the work items, the merge and the entry points
 * specdec_attend_f32, _f64 and _bf16 in attend_impl.h, included at the end once per type. They return
 * a `specdec_status` (status.h).
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

#include "bf16.h"
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

/* Plain loops over keys and values stored as S (LD: one as T), computing in T; named SCORES and VALUES. */
#define DEFINE_LOOPS(T, S, LD, SCORES, VALUES)                                                      \
    static void SCORES(const T *qs, int nq, int dim, const S *const *keys, int64_t count, T scale,  \
                       T *scores) {                                                                 \
        for (int64_t p = 0; p < count; p++)                                                         \
            for (int i = 0; i < nq; i++) {                                                          \
                const T *x = qs + i * dim;                                                          \
                const S *k = keys[p];                                                               \
                T sum = 0;                                                                          \
                _Pragma("omp simd reduction(+:sum)") for (int e = 0; e < dim; e++) sum += x[e] * LD(k + e); \
                scores[i * CHUNK + p] = sum * scale;                                                \
            }                                                                                       \
    }                                                                                               \
    static void VALUES(const T *w, int nq, int dim, const S *const *values, int64_t count, T *acc) { \
        memset(acc, 0, sizeof(T) * nq * dim);                                                       \
        for (int64_t p = 0; p < count; p++)                                                         \
            for (int i = 0; i < nq; i++) {                                                          \
                T x = w[i * CHUNK + p], *o = acc + i * dim;                                         \
                const S *v = values[p];                                                             \
                _Pragma("omp simd") for (int e = 0; e < dim; e++) o[e] += x * LD(v + e);            \
            }                                                                                       \
    }

#define PLAIN_LOAD(p) (*(p))
#define BF16_LOAD(p) bf16_to_f32(*(p))
DEFINE_LOOPS(double, double, PLAIN_LOAD, scores_f64, values_f64)

#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"
#endif

/* The loops for float32 and for bfloat16 keys and values (attend_loops.h, once per type). */
#define S float
#define SK f32
#define LOAD1 PLAIN_LOAD
#define LOAD256(p) _mm256_loadu_ps(p)
#define LOAD512(p) _mm512_loadu_ps(p)
#include "attend_loops.h"

#define S uint16_t
#define SK bf16
#define LOAD1 BF16_LOAD
#define LOAD256(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define LOAD512(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#include "attend_loops.h"

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

/* The entry points, specdec_attend_f32, specdec_attend_f64 and specdec_attend_bf16 (attend_impl.h, once
 * per type). */
#define S float
#define T float
#define KIND f32
#define EXP expf
#define TO_T(x) (x)
#define TO_S(x) (x)
#include "attend_impl.h"

#define S double
#define T double
#define KIND f64
#define EXP exp
#define TO_T(x) (x)
#define TO_S(x) (x)
#include "attend_impl.h"

#define S uint16_t
#define T float
#define KIND bf16
#define EXP expf
#define TO_T(x) bf16_to_f32(x)
#define TO_S(x) f32_to_bf16(x)
#include "attend_impl.h"
