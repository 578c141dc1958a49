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
 * and accumulated in float32: the weights are those of the de-quantized float32 model. The other
 * way, d * sum(x q) + m * sum(x) a block, rounds differently, and measured no faster at 1 row (q4_1,
 * 512 x 576 in cache, one thread: 6.5 cycles a run of 32 weights either way) while costing a
 * multiply-add per weight and row from 2 rows on, where a weight de-quantized once serves every row.
 *
 * The loops are linear.c's: blocks of 4 weight rows, each lane of an accumulator summing the
 * products of the elements e = lane, lane + 8 (or 16 with AVX-512), ... in order, the lanes added
 * in one fixed order (sum4, fold), so a row's result does not depend on the other rows of the pass,
 * and with whole blocks of 4 weight rows it is the same bits linear.c computes from the de-quantized
 * float32 weights. Passes of 1-3 rows (1-8 with AVX-512) de-quantize each weight once in registers
 * and use it for every row, the inputs read from cache; larger passes keep the block's 4
 * de-quantized rows in a per-thread buffer and run linear.c's passes over it. Weight rows are split over `threads` OpenMP
 * threads in contiguous ranges.
 *
 * Where the time goes (AVX2, Zen 3, 1 row): a run of 32 weights of one row takes about 19 vector
 * instructions (2 widening loads, 2 masks, 2 shifts, 4 conversions, 4 multiply-adds de-quantizing, 4
 * accumulating, 2 scale broadcasts) and runs at about 2.5 a cycle: ~8 cycles, so 2 cores at 3 GHz
 * read q4_1 at ~5 GB/s each, under the memory's bandwidth: the loop, not memory, is the bound.
 * Removing each group in turn (timing only) saved 1.0 (conversions), 1.5 (de-quantizing
 * multiply-adds) and 0.6 (masks and shifts) cycles; 8 weight rows at once (8 chains instead of 4)
 * and magic-number conversions (or, subtract) were no faster, unpacking with shuffles slower.
 *
 * The float64 entry point (`specdec_qlinear_f64`) runs the same weights with float64 activations and
 * sums (plain loops): what the tests compare with de-quantize-then-matmul to 1e-12, and what a
 * float64 model runs. `specdec_qrows_f32` de-quantizes whole rows (the embedding's gather). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "status.h"

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

static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
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

/* This thread's buffer of at least `floats` floats, 64-byte aligned, kept for its next call (OpenMP
 * keeps its threads: an allocation and a free each call cost more than a small projection's work). */
static float *scratch(size_t floats) {
    static __thread float *buf;
    static __thread size_t size;
    if (size < floats) {
        free(buf);
        size = (floats + 1023) / 1024 * 1024;
        buf = aligned_alloc(64, size * sizeof(float));
        if (!buf) size = 0;
    }
    return buf;
}

static int valid(int kind, int group, int m, int n, int k) {
    return kind >= SYM4 && kind <= SYM8 && group >= RUN && group % RUN == 0 && m >= 1 && n >= 1 && k >= 1 &&
           k % group == 0;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include "simd.h"
#define VECTOR 1

/* d and m of one block (m = 0 where the kind has none), broadcast to 8 lanes. */
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

/* The scales of the 4 weight rows at w (`w_t` bytes apart), converted once for the whole block:
 * sc[8 g + 2 r] = d and sc[8 g + 2 r + 1] = m (0 where the kind has none) of row r's block g; the
 * loops broadcast them from memory (a load, no arithmetic). For q4_1 at 1 row that took a run of
 * 32 weights of one row from 7.7 to 6.5 cycles (2.45 GHz equivalent, 16384 x 576, one thread); for
 * q8_0 (one scale, 2 instructions in the loop) and the 4-row de-quantization below it cost more
 * than it gave (its loads wait on memory before the block's loop can start). A group's 4 rows are
 * gathered into one vector and converted at once: written as 4 scalar stores read back by one wide
 * load (which the CPU cannot forward from the stores: it waits for them to reach the cache), the
 * AVX-512 loop at 1 row took 6.5 cycles a run of 32 weights, 5.4 so, 4.0 with no scales at all
 * (Xeon at 3.8 GHz, one thread, q4_1 144 x 8192 in cache). */
static inline void scales4(int kind, int group, const uint8_t *w, int64_t w_t, int k, float *sc) {
    int64_t bytes = block_bytes(kind, group);
    int groups = k / group;
    for (int g = 0; g < groups; g++, w += bytes) {
        __m128i halves = kind == ASYM4 ? _mm_setr_epi32((int)load32(w), (int)load32(w + w_t), (int)load32(w + 2 * w_t),
                                                        (int)load32(w + 3 * w_t))
                                       : _mm_setr_epi32(load16(w), load16(w + w_t), load16(w + 2 * w_t),
                                                        load16(w + 3 * w_t));
        _mm256_storeu_ps(sc + 8 * g, _mm256_cvtph_ps(halves));
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

/* QB input rows against the 4 weight rows at w (`w_t` bytes apart), all k, de-quantizing in registers:
 * run by run (32 weights), row by row, the four vectors of 8 in order (each accumulator sums its
 * elements in order; the rows' chains of multiply-adds are independent, and overlap). With STORE,
 * the de-quantized weights are also kept in `keep` (4 rows of k floats) for the pass's other rows.
 * Each run also prefetches its share of the next block of 4 rows (the whole block over the loop):
 * the hardware prefetcher alone left the loop waiting on memory; a decode step's 211 matrices at 1
 * row on one thread took 15.7-18.8 ms so against 22.3-23.7 without (minimums of 21, side by side;
 * 2 blocks ahead or into L2 only measured the same). */
#define DEFINE_DIRECT(QB, NAME, STORE)                                                                \
    static inline void NAME(int kind, int group, const float *x, int64_t x_t, const uint8_t *w,       \
                            int64_t w_t, int k, float *y, int64_t y_t, float *sc, float *keep) {      \
        __m256 a[QB][ROWS];                                                                           \
        for (int i = 0; i < QB; i++)                                                                  \
            for (int r = 0; r < ROWS; r++) a[i][r] = _mm256_setzero_ps();                             \
        if (kind == ASYM4) scales4(kind, group, w, w_t, k, sc);                                       \
        int runs = group / RUN, hb = header(kind), rb = run_bytes(kind);                              \
        int64_t bytes = block_bytes(kind, group);                                                     \
        const char *ahead = (const char *)(w + ROWS * w_t); /* the next block: prefetched a share a run */ \
        int lines = (int)((ROWS * w_t + 64 * (k / RUN) - 1) / (64 * (k / RUN)));                      \
        for (int e = 0, g = 0, s = 0; e < k; e += RUN) {                                              \
            const uint8_t *q = w + g * bytes + hb + s * rb;                                           \
            for (int l = 0; l < lines; l++, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T0);           \
            _Pragma("GCC unroll 4") for (int r = 0; r < ROWS; r++) {                                  \
                __m256 d, mn;                                                                         \
                if (kind == ASYM4)                                                                    \
                    d = _mm256_broadcast_ss(sc + 8 * g + 2 * r), mn = _mm256_broadcast_ss(sc + 8 * g + 2 * r + 1); \
                else                                                                                  \
                    scales8(kind, w + g * bytes + r * w_t, &d, &mn);                                  \
                _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {                                 \
                    __m256 v = weights8(kind, q + r * w_t, t, d, mn);                                 \
                    if (STORE) _mm256_store_ps(keep + r * (int64_t)k + e + 8 * t, v);                 \
                    _Pragma("GCC unroll 6") for (int i = 0; i < QB; i++)                              \
                        a[i][r] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + i * x_t + e + 8 * t), a[i][r]); \
                }                                                                                     \
            }                                                                                         \
            if (++s == runs) s = 0, g++;                                                              \
        }                                                                                             \
        for (int i = 0; i < QB; i++) _mm_storeu_ps(y + i * y_t, sum4(a[i][0], a[i][1], a[i][2], a[i][3])); \
    }
DEFINE_DIRECT(1, direct_1, 0)
DEFINE_DIRECT(2, direct_2, 0)
DEFINE_DIRECT(3, direct_3, 0)
DEFINE_DIRECT(2, direct_2_keep, 1) /* the first 2 rows of a larger pass, keeping the weights in `keep` */

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

#define DIRECT_ROWS 3 /* passes of up to this many rows de-quantize in registers */

/* 4 rows and more: the first 2 de-quantizing in registers (and keeping the weights in `buf`), the
 * others in passes of 3 over `buf`, from cache. Against de-quantizing into `buf` first and running
 * every row from it (q4_1, 512 x 576 in cache, one thread; 2.45 GHz cycles a run of 32 weights and
 * row, the quietest of 3 rounds): 4 rows 14.0 / 14.5, 5 rows 15.0 / 15.5; passes of 1-3 rows that
 * each de-quantize in registers were slower still (5 rows 18.9: every pass pays it again). The
 * floor at 5 rows is the multiply-adds: 20 a run and row (5 rows x 4 vectors), 2 a cycle, plus the
 * de-quantization's 4 and its conversions. */
static inline void rows_block(int kind, int group, int m, const float *x, int64_t x_t, const uint8_t *w, int64_t w_t,
                              int k, float *y, int64_t y_t, float *buf) {
    float *sc = buf + ROWS * (int64_t)k;
    if (m <= DIRECT_ROWS) {
        if (m == 3) direct_3(kind, group, x, x_t, w, w_t, k, y, y_t, sc, 0);
        else if (m == 2) direct_2(kind, group, x, x_t, w, w_t, k, y, y_t, sc, 0);
        else direct_1(kind, group, x, x_t, w, w_t, k, y, y_t, sc, 0);
        return;
    }
    direct_2_keep(kind, group, x, x_t, w, w_t, k, y, y_t, sc, buf);
    for (int i = 2; i < m; i += 3) {
        int q = m - i < 3 ? m - i : 3;
        if (q == 3) float_3(x + i * x_t, x_t, buf, k, y + i * y_t, y_t);
        else if (q == 2) float_2(x + i * x_t, x_t, buf, k, y + i * y_t, y_t);
        else float_1(x + i * x_t, x_t, buf, k, y + i * y_t, y_t);
    }
}

#if defined(__AVX512F__) || defined(SPECDEC_EMULATE_AVX512)
/* AVX-512: 16 lanes, half the instructions, and a 4-bit weight is a table look-up: the 16 values a
 * nibble can take in a block, fma(q, d, m) for q = 0 .. 15 (one multiply-add a block), and
 * vpermps picks each lane's from its nibble (it reads the low 4 bits of each index: the low
 * nibble needs no mask). A run of 32 weights of one row: 1 widening load, 1 shift, 2 look-ups, the
 * table, and a multiply-add per input row and 16 weights. Accumulators as linear.c's AVX-512 loop
 * (lane e % 16 sums e = lane, lane + 16, ...; halves folded, then sum4): the same bits as linear.c
 * computes from the de-quantized weights. The loops are written over a few wrappers (z_*) so that
 * the tests can run them on a CPU without AVX-512: built with SPECDEC_EMULATE_AVX512 (never by the
 * engine), the wrappers are plain loops over 16 lanes with the same IEEE results. */
#ifdef __AVX512F__
typedef __m512 zf;
typedef __m512i zi;
static inline zf z_zero(void) { return _mm512_setzero_ps(); }
static inline zf z_set1(float v) { return _mm512_set1_ps(v); }
static inline zf z_loadu(const float *p) { return _mm512_loadu_ps(p); }
static inline zf z_load(const float *p) { return _mm512_load_ps(p); }
static inline void z_store(float *p, zf a) { _mm512_store_ps(p, a); }
static inline zf z_fma(zf a, zf b, zf c) { return _mm512_fmadd_ps(a, b, c); }
static inline zf z_mul(zf a, zf b) { return _mm512_mul_ps(a, b); }
static inline zf z_cvt(zi a) { return _mm512_cvtepi32_ps(a); }
static inline zi z_u8(const uint8_t *q) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q)); }
static inline zi z_i8(const uint8_t *q) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)); }
static inline zi z_srl4(zi a) { return _mm512_srli_epi32(a, 4); }
static inline zf z_perm(zi index, zf table) { return _mm512_permutexvar_ps(index, table); }
static inline zf z_iota(int from) {
    return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps((float)from));
}
static inline __m256 z_fold(zf a) { return fold(a); }
#else
typedef struct { float v[16]; } zf;
typedef struct { int32_t v[16]; } zi;
#define Z_LANES(r, expr) for (int l = 0; l < 16; l++) r.v[l] = (expr)
static inline zf z_zero(void) { zf r; Z_LANES(r, 0.0f); return r; }
static inline zf z_set1(float v) { zf r; Z_LANES(r, v); return r; }
static inline zf z_loadu(const float *p) { zf r; Z_LANES(r, p[l]); return r; }
static inline zf z_load(const float *p) { return z_loadu(p); }
static inline void z_store(float *p, zf a) { for (int l = 0; l < 16; l++) p[l] = a.v[l]; }
static inline zf z_fma(zf a, zf b, zf c) { zf r; Z_LANES(r, __builtin_fmaf(a.v[l], b.v[l], c.v[l])); return r; }
static inline zf z_mul(zf a, zf b) { zf r; Z_LANES(r, a.v[l] * b.v[l]); return r; }
static inline zf z_cvt(zi a) { zf r; Z_LANES(r, (float)a.v[l]); return r; }
static inline zi z_u8(const uint8_t *q) { zi r; Z_LANES(r, q[l]); return r; }
static inline zi z_i8(const uint8_t *q) { zi r; Z_LANES(r, (int8_t)q[l]); return r; }
static inline zi z_srl4(zi a) { zi r; Z_LANES(r, (int32_t)((uint32_t)a.v[l] >> 4)); return r; }
static inline zf z_perm(zi index, zf table) { zf r; Z_LANES(r, table.v[index.v[l] & 15]); return r; }
static inline zf z_iota(int from) { zf r; Z_LANES(r, (float)(l + from)); return r; }
static inline __m256 z_fold(zf a) {
    float half[8];
    for (int l = 0; l < 8; l++) half[l] = a.v[l] + a.v[l + 8];
    return _mm256_loadu_ps(half);
}
#endif

/* Inlined into each of rows_block_kind's branches, where `kind` is a constant: as calls, GCC kept one
 * copy of each loop that tested the kind every run (a layer's gate/up at 1 row on one thread, Xeon:
 * 106 -> 90 us; the decode step's 121 calls 5.2 -> 4.3 ms). */
#define FLATTEN inline __attribute__((always_inline))

/* The block of 4 weight rows the AVX-512 loops prefetch a share of each run: 4 blocks ahead, not the
 * next one as on AVX2. On a Xeon (AVX-512, 2 threads) a decode step's 211 matrices took 6.0-7.0 ms
 * so against 7.5-8.3 (1 row, alternated 3 times, medians of 25); 2-6 rows alike. */
#define AHEAD_512 4

/* The loops' pieces below are always inlined like the loops (as calls, returning vectors, the step's
 * matrices took twice as long). Weights 16t .. 16t + 15 (t < 2) of the run at q; `table`: its block's
 * `block_table`. */
static FLATTEN zf weights16(int kind, const uint8_t *q, int t, zf table) {
    if (kind == SYM8) return z_mul(z_cvt(z_i8(q + 16 * t)), table);
    zi v = z_u8(q);
    return z_perm(t ? z_srl4(v) : v, table);
}

/* What `weights16` needs of a block whose converted scales are at `scale` (d, m): for the 4-bit kinds
 * the 16 values a nibble can take, d * (q - 8) (sym4) or fma(q, d, m) (asym4) for q = 0 .. 15, as the
 * de-quantizer computes them; for sym8, d. */
static FLATTEN zf block_table(int kind, const float *scale) {
    zf d = z_set1(scale[0]);
    if (kind == SYM8) return d;
    return kind == ASYM4 ? z_fma(z_iota(0), d, z_set1(scale[1])) : z_mul(d, z_iota(-8));
}

/* Prefetch a run's share of the block ahead, from `ahead` (see prefetch_stride); where the next run's starts. */
static FLATTEN const char *prefetch_run(int kind, const char *ahead, int stride) {
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    if (kind == SYM8) _mm_prefetch(ahead + 128, _MM_HINT_T0);
    return ahead + stride;
}

/* The bytes of `bytes` (the block ahead's share) to prefetch each run of 32 weights along k. Each run
 * prefetches the lines at ahead, ahead + 64 (and + 128 for sym8), ahead stepping by this stride: 4
 * rows' share of a run is at most 80 bytes for the 4-bit kinds, 136 for sym8, so every line of the
 * block is touched, with no loop in the run (against a loop over a line count: the step's 211
 * matrices at 5 rows 4.39-4.44 -> 4.16-4.27 ms, 1 row 2.34-2.79 -> 2.27-2.29; EPYC, 2 threads,
 * alternated twice). */
static inline int prefetch_stride(int64_t bytes, int k) { return (int)((bytes + k / RUN - 1) / (k / RUN)); }

/* QB input rows against NR of the 4 weight rows at w (rows r0 .. r0 + NR - 1, `w_t` bytes apart),
 * all k, de-quantizing each weight once in registers and using it for every row: part[i][r0 + j]
 * becomes row i's sum against weight row r0 + j, its 16 lanes folded to 8 (sum4 adds them up in
 * linear.c's order). Each accumulator sums its elements in order, so the bits do not depend on NR.
 * Each run prefetches its share of the block ahead, `stride` bytes from `ahead` on (see
 * prefetch_stride). Always inlined: the callers' `kind` is a constant there. One
 * loop over the runs, the tables made in it and the pointers stepped: against a loop over groups
 * holding each group's tables across an inner loop over its runs (which left GCC short of
 * registers at 5 rows: spills in the group loop), 5 rows 7.7-7.8 -> 7.0-7.2 ms and 1 row 4.1 ->
 * 3.7-3.8 for the step's 121 projections (`bench/quant_step.c`, alternated twice). */
#define DEFINE_SWEEP512(QB, NR, NAME)                                                                 \
    static inline __attribute__((always_inline)) void NAME(                                           \
        int kind, int group, const float *x, int64_t x_t, const uint8_t *w, int64_t w_t, int k,       \
        const float *sc, int r0, const char *ahead, int stride, __m256 part[][ROWS]) {                 \
        zf a[QB][NR];                                                                                 \
        for (int i = 0; i < QB; i++)                                                                  \
            for (int j = 0; j < NR; j++) a[i][j] = z_zero();                                          \
        const int runs = group / RUN, rb = run_bytes(kind);                                           \
        const int64_t bytes = block_bytes(kind, group);                                               \
        const uint8_t *block = w + header(kind) + r0 * w_t, *q = block; /* row r0's run */           \
        const float *xe = x, *scale = sc + 2 * r0;          /* this run's inputs; its group's scales */ \
        for (int e = 0, s = 0; e < k; e += RUN, xe += RUN) {                                          \
            ahead = prefetch_run(kind, ahead, stride);                                                \
            _Pragma("GCC unroll 4") for (int j = 0; j < NR; j++) {                                    \
                zf table = block_table(kind, scale + 2 * j);                                          \
                _Pragma("GCC unroll 2") for (int t = 0; t < 2; t++) {                                 \
                    zf v = weights16(kind, q + j * w_t, t, table);                                    \
                    _Pragma("GCC unroll 8") for (int i = 0; i < QB; i++)                              \
                        a[i][j] = z_fma(v, z_loadu(xe + i * x_t + 16 * t), a[i][j]);                  \
                }                                                                                     \
            }                                                                                         \
            if (++s < runs) {                                                                         \
                q += rb;                                                                              \
            } else {                                                                                  \
                s = 0, block += bytes, q = block, scale += 8;                                         \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < QB; i++)                                                                  \
            for (int j = 0; j < NR; j++) part[i][r0 + j] = z_fold(a[i][j]);                           \
    }
DEFINE_SWEEP512(1, 4, sweep512_1)
DEFINE_SWEEP512(2, 4, sweep512_2)
DEFINE_SWEEP512(3, 4, sweep512_3)
DEFINE_SWEEP512(4, 4, sweep512_4)
DEFINE_SWEEP512(5, 4, sweep512_5)
DEFINE_SWEEP512(6, 4, sweep512_6)
DEFINE_SWEEP512(7, 2, sweep512_7_pair)
DEFINE_SWEEP512(8, 2, sweep512_8_pair)

/* QB input rows against the block's 4 weight rows in one sweep (up to 6 rows: 24 accumulators of
 * the 32 registers), prefetching AHEAD_512 blocks ahead. */
#define DEFINE_DIRECT512(QB, NAME, SWEEP)                                                             \
    static FLATTEN void NAME(int kind, int group, const float *x, int64_t x_t, const uint8_t *w,       \
                            int64_t w_t, int k, float *y, int64_t y_t, float *sc) {                   \
        __m256 part[QB][ROWS];                                                                        \
        scales4(kind, group, w, w_t, k, sc);                                                          \
        SWEEP(kind, group, x, x_t, w, w_t, k, sc, 0, (const char *)(w + AHEAD_512 * ROWS * w_t),     \
              prefetch_stride(ROWS * w_t, k), part);                                                   \
        for (int i = 0; i < QB; i++) _mm_storeu_ps(y + i * y_t, sum4(part[i][0], part[i][1], part[i][2], part[i][3])); \
    }
DEFINE_DIRECT512(1, direct512_1, sweep512_1)
DEFINE_DIRECT512(2, direct512_2, sweep512_2)
DEFINE_DIRECT512(3, direct512_3, sweep512_3)
DEFINE_DIRECT512(4, direct512_4, sweep512_4)
DEFINE_DIRECT512(5, direct512_5, sweep512_5)
DEFINE_DIRECT512(6, direct512_6, sweep512_6)

/* QB = 7 or 8 input rows against the block's 4 weight rows, 2 weight rows at a time (16
 * accumulators; 32 would not fit the registers), each weight still de-quantized once in registers
 * for all the rows: two sweeps over k, each prefetching half of the next block. Against the first 6
 * rows de-quantizing in registers and the rest from a buffer they fill (the step's 211 matrices,
 * Xeon, 2 threads, alternated twice): 7 rows 15.2-16.0 -> 12.8-13.0 ms, 8 rows 16.4-17.3 -> 15.2-15.5
 * (6 rows 11.2-12.2 either way). */
#define DEFINE_PAIRS512(QB)                                                                           \
    static FLATTEN void pairs512_##QB(int kind, int group, const float *x, int64_t x_t, const uint8_t *w, \
                                     int64_t w_t, int k, float *y, int64_t y_t, float *sc) {          \
        __m256 part[QB][ROWS];                                                                        \
        scales4(kind, group, w, w_t, k, sc);                                                          \
        int half = (int)(ROWS * w_t / 2), lines = prefetch_stride(half, k);                            \
        for (int r0 = 0; r0 < ROWS; r0 += 2)                                                          \
            sweep512_##QB##_pair(kind, group, x, x_t, w, w_t, k, sc, r0,                              \
                                 (const char *)(w + ROWS * w_t) + r0 / 2 * half, lines, part);        \
        for (int i = 0; i < QB; i++) _mm_storeu_ps(y + i * y_t, sum4(part[i][0], part[i][1], part[i][2], part[i][3])); \
    }
DEFINE_PAIRS512(7)
DEFINE_PAIRS512(8)

/* The block's 4 weight rows de-quantized into `keep` (4 rows of k floats, 64-byte aligned), as the
 * sweeps de-quantize them, prefetching AHEAD_512 blocks ahead as they do. */
static FLATTEN void dequant512(int kind, int group, const uint8_t *w, int64_t w_t, int k, float *sc, float *keep) {
    scales4(kind, group, w, w_t, k, sc);
    const int runs = group / RUN, rb = run_bytes(kind), stride = prefetch_stride(ROWS * w_t, k);
    const int64_t bytes = block_bytes(kind, group);
    const char *ahead = (const char *)(w + AHEAD_512 * ROWS * w_t);
    const uint8_t *block = w + header(kind), *q = block;
    const float *scale = sc;
    for (int e = 0, s = 0; e < k; e += RUN) {
        ahead = prefetch_run(kind, ahead, stride);
        _Pragma("GCC unroll 4") for (int j = 0; j < ROWS; j++) {
            zf table = block_table(kind, scale + 2 * j);
            z_store(keep + j * (int64_t)k + e, weights16(kind, q + j * w_t, 0, table));
            z_store(keep + j * (int64_t)k + e + 16, weights16(kind, q + j * w_t, 1, table));
        }
        if (++s < runs) {
            q += rb;
        } else {
            s = 0, block += bytes, q = block, scale += 8;
        }
    }
}

/* linear.c's AVX-512 block over the de-quantized rows in cache. */
#define DEFINE_FLOAT512(QB)                                                                           \
    static inline void float512_##QB(const float *x, int64_t x_t, const float *w, int k, float *y, int64_t y_t) { \
        zf a[QB][ROWS];                                                                               \
        for (int i = 0; i < QB; i++)                                                                  \
            for (int r = 0; r < ROWS; r++) a[i][r] = z_zero();                                        \
        for (int e = 0; e < k; e += 16) {                                                             \
            zf v0 = z_load(w + e), v1 = z_load(w + k + e), v2 = z_load(w + 2 * k + e), v3 = z_load(w + 3 * k + e); \
            for (int i = 0; i < QB; i++) {                                                            \
                zf u = z_loadu(x + i * x_t + e);                                                      \
                a[i][0] = z_fma(u, v0, a[i][0]), a[i][1] = z_fma(u, v1, a[i][1]);                     \
                a[i][2] = z_fma(u, v2, a[i][2]), a[i][3] = z_fma(u, v3, a[i][3]);                     \
            }                                                                                         \
        }                                                                                             \
        for (int i = 0; i < QB; i++)                                                                  \
            _mm_storeu_ps(y + i * y_t, sum4(z_fold(a[i][0]), z_fold(a[i][1]), z_fold(a[i][2]), z_fold(a[i][3]))); \
    }
DEFINE_FLOAT512(1)
DEFINE_FLOAT512(2)
DEFINE_FLOAT512(3)
DEFINE_FLOAT512(4)
DEFINE_FLOAT512(5)
DEFINE_FLOAT512(6)
/* Passes of up to 6 rows de-quantize each weight once in registers for all of them (6 rows: 24
 * accumulators of the 32 registers), 7-8 rows too, 2 weight rows at a time (pairs512); larger ones
 * de-quantize the block into `buf` first (dequant512) and run every row in passes of up to 6 over
 * it, from cache. Against de-quantizing in registers for up to 3 rows only, the rest from `buf`
 * (the step's 211 matrices, Xeon with AVX-512, 2 threads, `bench/quant_kernels.py --step-rows`): 5
 * rows 14.5 -> 9.4 ms, 8 rows 19.3 -> 16.4, 16 rows 30.4 -> 23.3, 1 row 6.9 either way. From 9 rows
 * on, de-quantizing into `buf` alone and running all rows from it beat running the first 6 in
 * registers while storing the weights (that loop spilled pointers and stored as it computed; EPYC,
 * `bench/quant_step.c`, 2 threads, alternated twice): 9 rows 10.4 -> 8.9-9.8 ms, 10 rows
 * 10.1-10.4 -> 8.3, 16 rows 13.7 -> 11.2-12.0, 48 rows 33.6-34.3 -> 31.8-32.4 (a 200-row prefill's
 * layers 102 -> 97 ms); 7-8 rows gained less there (5 %, 12 %) and stay as measured on the Xeon. */
static FLATTEN void rows_block512(int kind, int group, int m, const float *x, int64_t x_t, const uint8_t *w, int64_t w_t,
                          int k, float *y, int64_t y_t, float *buf) {
    float *sc = buf + ROWS * (int64_t)k;
    switch (m) {
    case 1: direct512_1(kind, group, x, x_t, w, w_t, k, y, y_t, sc); return;
    case 2: direct512_2(kind, group, x, x_t, w, w_t, k, y, y_t, sc); return;
    case 3: direct512_3(kind, group, x, x_t, w, w_t, k, y, y_t, sc); return;
    case 4: direct512_4(kind, group, x, x_t, w, w_t, k, y, y_t, sc); return;
    case 5: direct512_5(kind, group, x, x_t, w, w_t, k, y, y_t, sc); return;
    case 6: direct512_6(kind, group, x, x_t, w, w_t, k, y, y_t, sc); return;
    case 7: pairs512_7(kind, group, x, x_t, w, w_t, k, y, y_t, sc); return;
    case 8: pairs512_8(kind, group, x, x_t, w, w_t, k, y, y_t, sc); return;
    }
    dequant512(kind, group, w, w_t, k, sc, buf);
    for (int i = 0, most = 6; i < m; i += most) {
        const float *xi = x + i * x_t;
        float *yi = y + i * y_t;
        switch (m - i < most ? m - i : most) {
        case 6: float512_6(xi, x_t, buf, k, yi, y_t); break;
        case 5: float512_5(xi, x_t, buf, k, yi, y_t); break;
        case 4: float512_4(xi, x_t, buf, k, yi, y_t); break;
        case 3: float512_3(xi, x_t, buf, k, yi, y_t); break;
        case 2: float512_2(xi, x_t, buf, k, yi, y_t); break;
        default: float512_1(xi, x_t, buf, k, yi, y_t);
        }
    }
}

static void rows_block_kind(int kind, int group, int m, const float *x, int64_t x_t, const uint8_t *w, int64_t w_t,
                            int k, float *y, int64_t y_t, float *buf) {
    if (kind == ASYM4) rows_block512(ASYM4, group, m, x, x_t, w, w_t, k, y, y_t, buf);
    else if (kind == SYM8) rows_block512(SYM8, group, m, x, x_t, w, w_t, k, y, y_t, buf);
    else rows_block512(SYM4, group, m, x, x_t, w, w_t, k, y, y_t, buf);
}
#else
static void rows_block_kind(int kind, int group, int m, const float *x, int64_t x_t, const uint8_t *w, int64_t w_t,
                            int k, float *y, int64_t y_t, float *buf) {
    /* One kind at a time: the compiler specialises the loops for it. */
    if (kind == ASYM4) rows_block(ASYM4, group, m, x, x_t, w, w_t, k, y, y_t, buf);
    else if (kind == SYM8) rows_block(SYM8, group, m, x, x_t, w, w_t, k, y, y_t, buf);
    else rows_block(SYM4, group, m, x, x_t, w, w_t, k, y, y_t, buf);
}
#endif
#else
#define VECTOR 0
static void rows_block_kind(int kind, int group, int m, const float *x, int64_t x_t, const uint8_t *w, int64_t w_t,
                            int k, float *y, int64_t y_t, float *buf) {
    (void)kind, (void)group, (void)m, (void)x, (void)x_t, (void)w, (void)w_t, (void)k, (void)y, (void)y_t, (void)buf;
}
#endif


#define MOST_WEIGHTS 16

/* Where flat block b (of ROWS weight rows) or tail row b lies: weight i, its b-th block / tail row. */
static inline int locate(int count, const int64_t *starts, int64_t *b) {
    int i = 0;
    while (i + 1 < count && *b >= starts[i + 1]) i++;
    *b -= starts[i];
    return i;
}

/* y[:, column_i + j] for every weight i of `ws` and row j < n_i: all the weights' blocks of 4 rows
 * as one range split over the threads (one parallel region a fused projection, not one a weight),
 * then the rows past their last whole block. */
int specdec_qlinear_many_f32(int count, const specdec_qweight *ws, int m, int k, const float *x, int64_t x_t,
                             float *y, int64_t y_t, int threads) {
    int64_t blocks[MOST_WEIGHTS + 1] = {0}, tails[MOST_WEIGHTS + 1] = {0};
    size_t need = 0;
    if (count < 1 || count > MOST_WEIGHTS) return SPECDEC_BAD_SHAPE;
    for (int i = 0; i < count; i++) {
        if (!valid(ws[i].kind, ws[i].group, m, ws[i].n, k)) return SPECDEC_BAD_SHAPE;
        int64_t whole = VECTOR ? ws[i].n / ROWS : 0;
        blocks[i + 1] = blocks[i] + whole;
        tails[i + 1] = tails[i] + ws[i].n - whole * ROWS;
        size_t floats = (size_t)(ROWS * k + 8 * (k / ws[i].group));
        if (floats > need) need = floats;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = scratch(need);
        failed = !buf; /* every thread still meets both loops (OpenMP requires it), skipping their work */
#pragma omp for schedule(static)
        for (int64_t f = 0; f < blocks[count]; f++) {
            if (buf) {
                int64_t b = f;
                const specdec_qweight *q = ws + locate(count, blocks, &b);
                rows_block_kind(q->kind, q->group, m, x, x_t, q->w + b * ROWS * q->w_t, q->w_t, k,
                                y + q->column + b * ROWS, y_t, buf);
            }
        }
#pragma omp for schedule(static)
        for (int64_t f = 0; f < tails[count]; f++) {
            if (buf) {
                int64_t j = f;
                int i = locate(count, tails, &j);
                const specdec_qweight *q = ws + i;
                j += (blocks[i + 1] - blocks[i]) * ROWS; /* past the weight's whole blocks */
                decode_row(q->kind, q->group, q->w + j * q->w_t, k, buf);
                rows_one(m, x, x_t, buf, k, y + q->column + j, y_t);
            }
        }
    }
    return failed ? SPECDEC_NO_MEMORY : SPECDEC_OK;
}

/* The same products with float64 activations and sums (plain loops, one weight row at a time). */
int specdec_qlinear_many_f64(int count, const specdec_qweight *ws, int m, int k, const double *x, int64_t x_t,
                             double *y, int64_t y_t, int threads) {
    int64_t rows[MOST_WEIGHTS + 1] = {0};
    if (count < 1 || count > MOST_WEIGHTS) return SPECDEC_BAD_SHAPE;
    for (int i = 0; i < count; i++) {
        if (!valid(ws[i].kind, ws[i].group, m, ws[i].n, k)) return SPECDEC_BAD_SHAPE;
        rows[i + 1] = rows[i] + ws[i].n;
    }
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *row = scratch((size_t)k);
        failed = !row;
#pragma omp for schedule(static)
        for (int64_t f = 0; f < rows[count]; f++) {
            if (row) {
                int64_t j = f;
                const specdec_qweight *q = ws + locate(count, rows, &j);
                decode_row(q->kind, q->group, q->w + j * q->w_t, k, row);
                for (int i = 0; i < m; i++) {
                    const double *u = x + i * x_t;
                    double sum = 0;
#pragma omp simd reduction(+ : sum)
                    for (int e = 0; e < k; e++) sum += u[e] * (double)row[e];
                    y[i * y_t + q->column + j] = sum;
                }
            }
        }
    }
    return failed ? SPECDEC_NO_MEMORY : SPECDEC_OK;
}

/* out[r] = the de-quantized weight row rows[r] (r < count): the embedding's gather, or a whole
 * matrix de-quantized (rows 0 .. n - 1). */
int specdec_qrows_f32(int kind, int group, int count, const int64_t *rows, int k, const uint8_t *w, int64_t w_t,
                      float *out, int64_t out_t, int threads) {
    if (!valid(kind, group, 1, 1, k) || count < 0) return SPECDEC_BAD_SHAPE;
#pragma omp parallel for schedule(static) num_threads(threads) if (count > 64)
    for (int r = 0; r < count; r++) decode_row(kind, group, w + rows[r] * w_t, k, out + r * out_t);
    return SPECDEC_OK;
}
