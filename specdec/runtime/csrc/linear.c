/* A linear layer for a few rows: y[i, j] = sum_e x[i, e] * w[j, e], i < m, j < n, w `[n, k]` row-major.
 *
 * A decode or verify pass multiplies 1-48 rows by every weight of the model: the weights are read
 * once and each is used for m multiply-adds, so the pass is a read of the weights, and its floor
 * is their bytes over the memory bandwidth. BLAS libraries take a GEMM path built for large m
 * there (MKL's and oneDNN's float32 read the weights at 9-17 GB/s on 2 cores where the memory
 * gives 29-44). This loop reads each weight row once from memory, for all m rows at once: blocks
 * of 4 weight rows against up to 3 input rows (twelve AVX2 accumulators; with AVX-512, 16 lanes
 * and up to 6 input rows: below), the input rows staying
 * in cache (more input rows: more passes over the block, from cache, while the next block is
 * prefetched); the weight rows are split over `threads` OpenMP threads (torch's count, passed by
 * the caller) in contiguous ranges, so each thread streams its own part of the matrix.
 *
 * Every y[i, j] is the same sequence of operations whatever m is and whichever rows share its
 * block (lane e % 8, or e % 16, sums e = lane, lane + 8 or 16, ...; then the lanes are added in one
 * fixed order), so
 * a row's result does not depend on the other rows of the pass. Built with -ffast-math like
 * attend.c (no infinity or NaN is produced here from finite inputs). */

#include <stdint.h>

#include "status.h"

#define ROWS 4 /* weight rows per block */

#if defined(__AVX2__) && defined(__FMA__)
#include "simd.h"

/* y[i][j0 .. j0 + 4) for QB input rows against weight rows w .. w + 4k (k a multiple of 8). With
 * PREFETCH, the loop also asks for `rows` rows of k floats at `ahead`, a line every 16 floats. */
#define DEFINE_BLOCK(NAME, QB, PREFETCH)                                                              \
    static inline void NAME(const float *x, int64_t x_t, const float *w, int k, float *y, int64_t y_t, \
                            const float *ahead, int rows) {                                           \
        __m256 a[QB][ROWS];                                                                           \
        for (int i = 0; i < QB; i++)                                                                  \
            for (int r = 0; r < ROWS; r++) a[i][r] = _mm256_setzero_ps();                             \
        for (int e = 0; e < k; e += 8) {                                                              \
            if (PREFETCH && e % 16 == 0)                                                              \
                for (int r = 0; r < rows; r++) _mm_prefetch((const char *)(ahead + r * k + e), _MM_HINT_T0); \
            __m256 v0 = _mm256_loadu_ps(w + e), v1 = _mm256_loadu_ps(w + k + e),                     \
                   v2 = _mm256_loadu_ps(w + 2 * k + e), v3 = _mm256_loadu_ps(w + 3 * k + e);          \
            for (int i = 0; i < QB; i++) {                                                            \
                __m256 u = _mm256_loadu_ps(x + i * x_t + e);                                          \
                a[i][0] = _mm256_fmadd_ps(u, v0, a[i][0]), a[i][1] = _mm256_fmadd_ps(u, v1, a[i][1]); \
                a[i][2] = _mm256_fmadd_ps(u, v2, a[i][2]), a[i][3] = _mm256_fmadd_ps(u, v3, a[i][3]); \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < QB; i++) _mm_storeu_ps(y + i * y_t, sum4(a[i][0], a[i][1], a[i][2], a[i][3])); \
    }
DEFINE_BLOCK(block_1, 1, 0)
DEFINE_BLOCK(block_2, 2, 0)
DEFINE_BLOCK(block_3, 3, 0)
DEFINE_BLOCK(block_1_ahead, 1, 1)
DEFINE_BLOCK(block_2_ahead, 2, 1)
DEFINE_BLOCK(block_3_ahead, 3, 1)

/* One block of weight rows against all m input rows, in passes of up to 3 input rows. The first pass
 * reads the block from memory; the others read it from cache, and are multiply-adds with memory
 * idle (from about 5 rows on, as long as the read or longer). So where there is more than one
 * pass, each pass prefetches a share of the next block's rows (`ahead`; null after the last
 * block): memory streams the next block while this one is worked on. A single pass leaves it to
 * the hardware prefetcher, which follows the stream already (software prefetches there cost more
 * than they gave). */
static void rows_block(int m, const float *x, int64_t x_t, const float *w, int k, float *y, int64_t y_t,
                       const float *ahead) {
    int passes = (m + 2) / 3;
    int share = ahead && passes > 1 ? (ROWS + passes - 1) / passes : 0; /* next-block rows a pass */
    for (int p = 0; p < passes; p++) {
        int i = 3 * p, q = m - i < 3 ? m - i : 3;
        int first = p * share, rows = first < ROWS ? (share < ROWS - first ? share : ROWS - first) : 0;
        const float *xi = x + i * x_t, *next = rows ? ahead + first * (int64_t)k : 0;
        float *yi = y + i * y_t;
        if (rows == 0) {
            if (q == 3) block_3(xi, x_t, w, k, yi, y_t, 0, 0);
            else if (q == 2) block_2(xi, x_t, w, k, yi, y_t, 0, 0);
            else block_1(xi, x_t, w, k, yi, y_t, 0, 0);
        } else {
            if (q == 3) block_3_ahead(xi, x_t, w, k, yi, y_t, next, rows);
            else if (q == 2) block_2_ahead(xi, x_t, w, k, yi, y_t, next, rows);
            else block_1_ahead(xi, x_t, w, k, yi, y_t, next, rows);
        }
    }
}
#ifdef __AVX512F__
/* The same blocks with 16 lanes (k a multiple of 16): half the instructions. Passes take 3 input
 * rows as above, and from WIDE_FROM rows on 6 (24 accumulators of the 32 registers: half the passes
 * over a block from cache, where the pass is multiply-adds more than reads). Measured on the 121
 * projections of SmolLM2-135M (2 threads, medians of 15, against the AVX2 blocks): 1 row 19.3 /
 * 20.1 ms, 12 rows 24.4 / 29.0, 16 rows 26.6 / 38.2, 24 rows 37.8 / 47.1, 48 rows 59.7 / 83.7; 6-row
 * passes below 18 rows lost to 3-row ones (16 rows: 32.1 / 26.6 ms). Lane e % 16 sums e = lane,
 * lane + 16, ...; the two halves are added, then the 8 lanes as above: again one order for every m. */
#define WIDE_FROM 18

#define DEFINE_BLOCK512(NAME, QB, PREFETCH)                                                           \
    static inline void NAME(const float *x, int64_t x_t, const float *w, int k, float *y, int64_t y_t, \
                            const float *ahead, int rows) {                                           \
        __m512 a[QB][ROWS];                                                                           \
        for (int i = 0; i < QB; i++)                                                                  \
            for (int r = 0; r < ROWS; r++) a[i][r] = _mm512_setzero_ps();                             \
        for (int e = 0; e < k; e += 16) {                                                             \
            if (PREFETCH)                                                                             \
                for (int r = 0; r < rows; r++) _mm_prefetch((const char *)(ahead + r * k + e), _MM_HINT_T0); \
            __m512 v0 = _mm512_loadu_ps(w + e), v1 = _mm512_loadu_ps(w + k + e),                     \
                   v2 = _mm512_loadu_ps(w + 2 * k + e), v3 = _mm512_loadu_ps(w + 3 * k + e);          \
            for (int i = 0; i < QB; i++) {                                                            \
                __m512 u = _mm512_loadu_ps(x + i * x_t + e);                                          \
                a[i][0] = _mm512_fmadd_ps(u, v0, a[i][0]), a[i][1] = _mm512_fmadd_ps(u, v1, a[i][1]); \
                a[i][2] = _mm512_fmadd_ps(u, v2, a[i][2]), a[i][3] = _mm512_fmadd_ps(u, v3, a[i][3]); \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < QB; i++)                                                                  \
            _mm_storeu_ps(y + i * y_t, sum4(fold(a[i][0]), fold(a[i][1]), fold(a[i][2]), fold(a[i][3]))); \
    }
#define DEFINE_BLOCKS512(QB) DEFINE_BLOCK512(block512_##QB, QB, 0) DEFINE_BLOCK512(block512_##QB##_ahead, QB, 1)
DEFINE_BLOCKS512(1)
DEFINE_BLOCKS512(2)
DEFINE_BLOCKS512(3)
DEFINE_BLOCKS512(4)
DEFINE_BLOCKS512(5)
DEFINE_BLOCKS512(6)

static void rows_block512(int m, const float *x, int64_t x_t, const float *w, int k, float *y, int64_t y_t,
                          const float *ahead) {
    int most = m >= WIDE_FROM ? 6 : 3, passes = (m + most - 1) / most;
    int share = ahead && passes > 1 ? (ROWS + passes - 1) / passes : 0; /* next-block rows a pass */
    for (int p = 0; p < passes; p++) {
        int i = most * p, q = m - i < most ? m - i : most;
        int first = p * share, rows = first < ROWS ? (share < ROWS - first ? share : ROWS - first) : 0;
        const float *xi = x + i * x_t, *next = rows ? ahead + first * (int64_t)k : 0;
        float *yi = y + i * y_t;
#define CASE(QB)                                                                                      \
    case QB:                                                                                          \
        if (rows) block512_##QB##_ahead(xi, x_t, w, k, yi, y_t, next, rows);                          \
        else block512_##QB(xi, x_t, w, k, yi, y_t, 0, 0);                                             \
        break;
        switch (q) { CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) }
#undef CASE
    }
}
#endif
#define VECTOR(k) ((k) % 8 == 0)
#else
#define VECTOR(k) 0
static void rows_block(int m, const float *x, int64_t x_t, const float *w, int k, float *y, int64_t y_t,
                       const float *ahead) {
    (void)ahead, (void)m, (void)x, (void)x_t, (void)w, (void)k, (void)y, (void)y_t;
}
#endif

/* y[i, j] for one weight row j, every input row (the plain loop; the compiler vectorises it). */
static void rows_one(int m, const float *x, int64_t x_t, const float *w, int k, float *y, int64_t y_t) {
    for (int i = 0; i < m; i++) {
        const float *u = x + i * x_t;
        float sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int e = 0; e < k; e++) sum += u[e] * w[e];
        y[i * y_t] = sum;
    }
}

/* Whether rows `[rows, width]` with a row stride of `stride` floats stay within `bytes` (no overflow). */
static int rows_fit(int64_t rows, int64_t width, int64_t stride, int64_t bytes) {
    int64_t last;
    if (stride < 0 || __builtin_mul_overflow(rows - 1, stride, &last) || __builtin_add_overflow(last, width, &last))
        return 0;
    return !__builtin_mul_overflow(last, (int64_t)sizeof(float), &last) && last <= bytes;
}

/* y `[m, n]` (row stride y_t) = x `[m, k]` (row stride x_t) times w `[n, k]` (contiguous) transposed; each
 * pointer comes with the bytes of storage from it on, and a product that would read or write past them is
 * refused (SPECDEC_OUT_OF_BOUNDS; a size below 1: SPECDEC_BAD_SHAPE). */
int specdec_linear_f32(int m, int n, int k, const float *x, int64_t x_t, int64_t x_bytes, const float *w,
                       int64_t w_bytes, float *y, int64_t y_t, int64_t y_bytes, int threads) {
    if (m < 1 || n < 1 || k < 1) return SPECDEC_BAD_SHAPE;
    if (!x || !w || !y || !rows_fit(m, k, x_t, x_bytes) || !rows_fit(n, k, k, w_bytes) || !rows_fit(m, n, y_t, y_bytes))
        return SPECDEC_OUT_OF_BOUNDS;
    int64_t blocks = VECTOR(k) ? n / ROWS : 0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; b++) { /* a thread's blocks are contiguous: it reads b + 1 next */
        const float *ahead = b + 1 < blocks ? w + (b + 1) * ROWS * (int64_t)k : 0;
#ifdef __AVX512F__
        if (k % 16 == 0) {
            rows_block512(m, x, x_t, w + b * ROWS * (int64_t)k, k, y + b * ROWS, y_t, ahead);
            continue;
        }
#endif
        rows_block(m, x, x_t, w + b * ROWS * (int64_t)k, k, y + b * ROWS, y_t, ahead);
    }
    for (int64_t j = blocks * ROWS; j < n; j++) rows_one(m, x, x_t, w + j * (int64_t)k, k, y + j, y_t);
    return 0;
}
