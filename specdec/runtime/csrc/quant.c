/* Linear layers over block-quantized weights, read as they are stored: y[i, j] = sum_e x[i, e] * w[j, e],
 * i < m, j < n, row j of w being k / G blocks of G weights (`specdec.core.quant` describes the formats):
 *
 *   SYM4   d, G/2 bytes of nibbles         w = d * (q - 8)     (q4_0 at G = 32)
 *   ASYM4  d, m, G/2 bytes of nibbles      w = d * q + m       (q4_1 at G = 32)
 *   SYM8   d, G int8                       w = d * q           (q8_0 at G = 32)
 *
 * d and m are fp16, converted to float32 exactly; within every 32 weights of a block byte j holds
 * weight j in its low nibble and weight j + 16 in its high one. Each weight is de-quantized in
 * registers to the float32 value `gguf`'s de-quantizer gives (d * q is exact in float32, so
 * fma(d, q, m) is the same one rounding as its d * q + m), then multiplied with float32 activations
 * and accumulated in float32: the weights are those of the de-quantized float32 model. (The other
 * way, d * sum(x q) + m * sum(x) per block, does as many multiply-adds per weight and row, rounds
 * differently, and costs more from 2 rows on, where a weight de-quantized once serves every row.)
 *
 * The loops are linear.c's: blocks of 4 weight rows, each lane of an accumulator summing the
 * products of the elements e = lane, lane + 8 (or 16 with AVX-512), ... in order, the lanes added
 * in one fixed order (sum4, fold), so a row's result does not depend on the other rows of the pass,
 * and with whole blocks of 4 weight rows it is the same bits linear.c computes from the de-quantized
 * float32 weights. A pass of few rows (up to DIRECT_ROWS) de-quantizes each weight once in registers
 * and uses it for every row, the inputs read from cache; larger passes de-quantize the block's 4 rows
 * into a per-thread buffer once and run linear.c's passes over it. Weight rows are split over
 * `threads` OpenMP threads in contiguous ranges.
 *
 * The float64 entry point (`specdec_qlinear_f64`) runs the same weights with float64 activations and
 * sums (plain loops): what the tests compare with de-quantize-then-matmul to 1e-12, and what a
 * float64 model runs. `specdec_qrows_f32` de-quantizes whole rows (the embedding's gather). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SYM4 0
#define ASYM4 1
#define SYM8 2
#define RUN 32  /* weights per nibble run */
#define ROWS 4  /* weight rows per block */

static inline int header(int kind) { return kind == ASYM4 ? 4 : 2; }
static inline int run_bytes(int kind) { return kind == SYM8 ? RUN : RUN / 2; }
static inline int64_t block_bytes(int kind, int group) { return header(kind) + group / RUN * run_bytes(kind); }

static inline uint16_t load16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* IEEE binary16 -> binary32, exactly (subnormals, infinities and NaNs included). */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int shift = 0;
        while (!(mant & 0x400)) mant <<= 1, shift++;
        bits = sign | ((uint32_t)(113 - shift) << 23) | ((mant & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The G weights of one block, as float32 (the portable decode every path agrees with). */
static void decode_block(int kind, int group, const uint8_t *b, float *out) {
    float d = half_to_float(load16(b)), mn = kind == ASYM4 ? half_to_float(load16(b + 2)) : 0.0f;
    const uint8_t *q = b + header(kind);
    for (int s = 0; s < group / RUN; s++, q += run_bytes(kind), out += RUN) {
        if (kind == SYM8) {
            for (int j = 0; j < RUN; j++) out[j] = (float)(int8_t)q[j] * d;
        } else if (kind == SYM4) {
            for (int j = 0; j < RUN / 2; j++) {
                out[j] = d * (float)((q[j] & 15) - 8);
                out[j + RUN / 2] = d * (float)((q[j] >> 4) - 8);
            }
        } else {
            for (int j = 0; j < RUN / 2; j++) {
                out[j] = d * (float)(q[j] & 15) + mn; /* d * q exact: contracted or not, one rounding */
                out[j + RUN / 2] = d * (float)(q[j] >> 4) + mn;
            }
        }
    }
}

static void decode_row(int kind, int group, const uint8_t *row, int k, float *out) {
    int64_t bytes = block_bytes(kind, group);
    for (int e = 0; e < k; e += group, row += bytes) decode_block(kind, group, row, out + e);
}

/* y[i, j] for one weight row j (de-quantized in `w`), every input row: the plain loop. */
static void rows_one(int m, const float *x, int64_t x_t, const float *w, int k, float *y, int64_t y_t) {
    for (int i = 0; i < m; i++) {
        const float *u = x + i * x_t;
        float sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int e = 0; e < k; e++) sum += u[e] * w[e];
        y[i * y_t] = sum;
    }
}

static int valid(int kind, int group, int m, int n, int k) {
    return kind >= SYM4 && kind <= SYM8 && group >= RUN && group % RUN == 0 && m >= 1 && n >= 1 && k >= 1 &&
           k % group == 0;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd.h"
#define VECTOR 1

/* d and m of a block (m = 0 where the kind has none), broadcast to 8 lanes. */
static inline void scales8(int kind, const uint8_t *b, __m256 *d, __m256 *mn) {
    if (kind == ASYM4) {
        int32_t pair;
        memcpy(&pair, b, 4);
        __m256 dm = _mm256_cvtph_ps(_mm_set1_epi32(pair)); /* d, m, d, m, ... */
        *d = _mm256_moveldup_ps(dm), *mn = _mm256_movehdup_ps(dm);
    } else {
        *d = _mm256_cvtph_ps(_mm_set1_epi16((short)load16(b))), *mn = _mm256_setzero_ps();
    }
}

/* Weights 8t .. 8t + 7 of the run at q (t < 4), as float32. */
static inline __m256 weights8(int kind, const uint8_t *q, int t, __m256 d, __m256 mn) {
    if (kind == SYM8) return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * t)))), d);
    __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * (t & 1))));
    __m256i v = t < 2 ? _mm256_and_si256(bytes, _mm256_set1_epi32(15)) : _mm256_srli_epi32(bytes, 4);
    if (kind == SYM4) return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(v, _mm256_set1_epi32(8))));
    return _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(v), mn);
}

/* QB input rows against the 4 weight rows at w (`w_t` bytes apart), all k, de-quantizing in registers. */
#define DEFINE_DIRECT(QB)                                                                             \
    static inline void direct_##QB(int kind, int group, const float *x, int64_t x_t, const uint8_t *w, \
                                   int64_t w_t, int k, float *y, int64_t y_t) {                       \
        __m256 a[QB][ROWS];                                                                           \
        for (int i = 0; i < QB; i++)                                                                  \
            for (int r = 0; r < ROWS; r++) a[i][r] = _mm256_setzero_ps();                             \
        int64_t bytes = block_bytes(kind, group);                                                     \
        for (int e0 = 0; e0 < k; e0 += group, w += bytes) {                                           \
            for (int r = 0; r < ROWS; r++) {                                                          \
                __m256 d, mn;                                                                         \
                scales8(kind, w + r * w_t, &d, &mn);                                                  \
                const uint8_t *q = w + r * w_t + header(kind);                                        \
                for (int e = e0; e < e0 + group; e += RUN, q += run_bytes(kind))                      \
                    for (int t = 0; t < 4; t++) {                                                     \
                        __m256 v = weights8(kind, q, t, d, mn);                                       \
                        for (int i = 0; i < QB; i++)                                                  \
                            a[i][r] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + i * x_t + e + 8 * t), a[i][r]); \
                    }                                                                                 \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < QB; i++) _mm_storeu_ps(y + i * y_t, sum4(a[i][0], a[i][1], a[i][2], a[i][3])); \
    }
DEFINE_DIRECT(1)
DEFINE_DIRECT(2)
DEFINE_DIRECT(3)

/* linear.c's block: QB input rows against 4 float32 weight rows at w (`k` apart), from cache. */
#define DEFINE_FLOAT(QB)                                                                              \
    static inline void float_##QB(const float *x, int64_t x_t, const float *w, int k, float *y, int64_t y_t) { \
        __m256 a[QB][ROWS];                                                                           \
        for (int i = 0; i < QB; i++)                                                                  \
            for (int r = 0; r < ROWS; r++) a[i][r] = _mm256_setzero_ps();                             \
        for (int e = 0; e < k; e += 8) {                                                              \
            __m256 v0 = _mm256_load_ps(w + e), v1 = _mm256_load_ps(w + k + e),                       \
                   v2 = _mm256_load_ps(w + 2 * k + e), v3 = _mm256_load_ps(w + 3 * k + e);            \
            for (int i = 0; i < QB; i++) {                                                            \
                __m256 u = _mm256_loadu_ps(x + i * x_t + e);                                          \
                a[i][0] = _mm256_fmadd_ps(u, v0, a[i][0]), a[i][1] = _mm256_fmadd_ps(u, v1, a[i][1]); \
                a[i][2] = _mm256_fmadd_ps(u, v2, a[i][2]), a[i][3] = _mm256_fmadd_ps(u, v3, a[i][3]); \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < QB; i++) _mm_storeu_ps(y + i * y_t, sum4(a[i][0], a[i][1], a[i][2], a[i][3])); \
    }
DEFINE_FLOAT(1)
DEFINE_FLOAT(2)
DEFINE_FLOAT(3)

/* The 4 weight rows at w de-quantized into `buf` (4 rows of k floats, 32-byte aligned). */
static inline void decode4(int kind, int group, const uint8_t *w, int64_t w_t, int k, float *buf) {
    int64_t bytes = block_bytes(kind, group);
    for (int r = 0; r < ROWS; r++) {
        const uint8_t *b = w + r * w_t;
        for (int e0 = 0; e0 < k; e0 += group, b += bytes) {
            __m256 d, mn;
            scales8(kind, b, &d, &mn);
            const uint8_t *q = b + header(kind);
            for (int e = e0; e < e0 + group; e += RUN, q += run_bytes(kind))
                for (int t = 0; t < 4; t++) _mm256_store_ps(buf + r * (int64_t)k + e + 8 * t, weights8(kind, q, t, d, mn));
        }
    }
}

#define DIRECT_ROWS 3 /* passes of up to this many rows de-quantize in registers */

static void rows_block(int kind, int group, int m, const float *x, int64_t x_t, const uint8_t *w, int64_t w_t,
                       int k, float *y, int64_t y_t, float *buf) {
    if (m <= DIRECT_ROWS) {
        if (m == 3) direct_3(kind, group, x, x_t, w, w_t, k, y, y_t);
        else if (m == 2) direct_2(kind, group, x, x_t, w, w_t, k, y, y_t);
        else direct_1(kind, group, x, x_t, w, w_t, k, y, y_t);
        return;
    }
    decode4(kind, group, w, w_t, k, buf);
    for (int i = 0; i < m; i += 3) {
        int q = m - i < 3 ? m - i : 3;
        if (q == 3) float_3(x + i * x_t, x_t, buf, k, y + i * y_t, y_t);
        else if (q == 2) float_2(x + i * x_t, x_t, buf, k, y + i * y_t, y_t);
        else float_1(x + i * x_t, x_t, buf, k, y + i * y_t, y_t);
    }
}

/* One kind at a time: the compiler specialises the loops for it. */
static void rows_block_kind(int kind, int group, int m, const float *x, int64_t x_t, const uint8_t *w, int64_t w_t,
                            int k, float *y, int64_t y_t, float *buf) {
    if (kind == ASYM4) rows_block(ASYM4, group, m, x, x_t, w, w_t, k, y, y_t, buf);
    else if (kind == SYM8) rows_block(SYM8, group, m, x, x_t, w, w_t, k, y, y_t, buf);
    else rows_block(SYM4, group, m, x, x_t, w, w_t, k, y, y_t, buf);
}
#else
#define VECTOR 0
static void rows_block_kind(int kind, int group, int m, const float *x, int64_t x_t, const uint8_t *w, int64_t w_t,
                            int k, float *y, int64_t y_t, float *buf) {
    (void)kind, (void)group, (void)m, (void)x, (void)x_t, (void)w, (void)w_t, (void)k, (void)y, (void)y_t, (void)buf;
}
#endif

int specdec_qlinear_f32(int kind, int group, int m, int n, int k, const float *x, int64_t x_t, const uint8_t *w,
                        int64_t w_t, float *y, int64_t y_t, int threads) {
    if (!valid(kind, group, m, n, k)) return -1;
    int64_t blocks = VECTOR ? n / ROWS : 0;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = aligned_alloc(64, ((size_t)ROWS * k * sizeof(float) + 63) / 64 * 64);
        if (!buf) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks; b++)
                rows_block_kind(kind, group, m, x, x_t, w + b * ROWS * w_t, w_t, k, y + b * ROWS, y_t, buf);
#pragma omp for schedule(static)
            for (int64_t j = blocks * ROWS; j < n; j++) {
                decode_row(kind, group, w + j * w_t, k, buf);
                rows_one(m, x, x_t, buf, k, y + j, y_t);
            }
            free(buf);
        }
    }
    return failed ? -2 : 0;
}

int specdec_qlinear_f64(int kind, int group, int m, int n, int k, const double *x, int64_t x_t, const uint8_t *w,
                        int64_t w_t, double *y, int64_t y_t, int threads) {
    if (!valid(kind, group, m, n, k)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *row = malloc((size_t)k * sizeof(float));
        if (!row) {
            failed = 1;
        } else {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < n; j++) {
                decode_row(kind, group, w + j * w_t, k, row);
                for (int i = 0; i < m; i++) {
                    const double *u = x + i * x_t;
                    double sum = 0;
#pragma omp simd reduction(+ : sum)
                    for (int e = 0; e < k; e++) sum += u[e] * (double)row[e];
                    y[i * y_t + j] = sum;
                }
            }
            free(row);
        }
    }
    return failed ? -2 : 0;
}

/* out[r] = the de-quantized weight row rows[r] (r < count): the embedding's gather, or a whole
 * matrix de-quantized (rows 0 .. n - 1). */
int specdec_qrows_f32(int kind, int group, int count, const int64_t *rows, int k, const uint8_t *w, int64_t w_t,
                      float *out, int64_t out_t, int threads) {
    if (!valid(kind, group, 1, 1, k) || count < 0) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (count > 64)
    for (int r = 0; r < count; r++) decode_row(kind, group, w + rows[r] * w_t, k, out + r * out_t);
    return 0;
}
