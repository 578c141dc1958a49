/* The block kernels' 4-bit projections on AMX tiles, against the vector loops: an experiment, kept
 * so that its figures can be measured again (docs/benchmarks.md, "AMX for the block kernels").
 *
 * A tile multiply-add (TDPBF16PS) multiplies bfloat16 and sums in float32. The weights go in exactly
 * as their integers (q of q4_1, q - 8 of q4_0: 4 bits), each block's d (and m times the inputs' sum)
 * applied to its sums in float32; the float32 activations go in as three bfloat16 terms, x = x1 +
 * x2 + x3 exactly. So every product is exact and the sums are float32's, in another order than the
 * vector loops': the error is float32's (this program checks it against float64), a row's result
 * does not depend on the other rows of its pass, but the bits are not the vector loops'.
 *
 * Layout: the inputs are the tile multiply-add's first operand (their 3 terms the tile's rows, up to
 * 5 inputs a tile), the weights its second: a run of 32 weights of 16 weight rows, transposed from
 * the GGUF rows (two levels of vpermt2b) and spread to bfloat16 pairs (vpermb), made in memory a
 * tile at a time; software-pipelined (a run's weights' tile made 2 runs ahead of its multiply-add,
 * its sums added 2 runs behind) and the next group's weights prefetched. The packaged model's
 * 4-bit projections of a decode step (the shapes of bench/quant_step.c; the q8_0 output layer is
 * left out of both) are timed through the engine's kernel (specdec_qlinear_many_f32) and through
 * the tiles, in turn.
 *
 *   cc -O3 -ffast-math -fopenmp -march=native -mtune=generic -Ispecdec/runtime/csrc \
 *       bench/amx_step.c -o /tmp/amx_step
 *   /tmp/amx_step ROWS THREADS STEPS          # e.g. 5 2 20; needs a CPU with AMX-BF16 and AVX512-VBMI
 */
#include "../specdec/runtime/csrc/quant.c"

#include <math.h>
#include <stdio.h>
#include <time.h>

#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__) || !defined(__AVX512VBMI__)
#error "needs a compiler and -march with AMX-TILE, AMX-BF16, AVX512-BF16 and AVX512-VBMI"
#endif
#include <sys/syscall.h>
#include <unistd.h>
#define TILE 16       /* weight rows a tile multiply-add (the columns of its sums) */
#define SPLITS 3      /* bfloat16 terms of an activation */
#define AMX_CHUNK 5   /* input rows a tile multiply-add: their 3 terms are its 15 rows */
#define AMX_INPUTS 60 /* input rows prepared at once */

/* vpermb/vpermt2b indices: a 16 x 16 byte transpose in two levels, and a transposed row's bytes
 * spread to 4 a weight row (see amx_weights). */
static uint8_t amx_level1[2][64], amx_level2[2][64], amx_spread[4][64], amx_pattern[64];

static int amx_enable(void) {
    for (int h = 0; h < 2; h++)
        for (int jj = 0; jj < 8; jj++)
            for (int n = 0; n < 8; n++) amx_level1[h][jj * 8 + n] = (uint8_t)((n / 4) * 64 + (n % 4) * 16 + 8 * h + jj);
    for (int p = 0; p < 2; p++)
        for (int jj = 0; jj < 4; jj++)
            for (int n = 0; n < 16; n++) amx_level2[p][jj * 16 + n] = (uint8_t)((n < 8 ? 0 : 64) + (4 * p + jj) * 8 + n % 8);
    for (int jj = 0; jj < 4; jj++)
        for (int n = 0; n < 16; n++)
            for (int c = 0; c < 4; c++) amx_spread[jj][4 * n + c] = (uint8_t)(jj * 16 + n);
    for (int i = 0; i < 64; i++) amx_pattern[i] = (uint8_t)((i & 1) ? 16 : 0);
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): Linux hands the tile state to a
     * process that asks for it; without it the first tile instruction faults. */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* tmm0 and tmm3: the inputs' terms (m rows of 16 pairs); tmm1 and tmm4: the weights (16 pairs of
 * rows x 16 weight rows); tmm2 and tmm5: the sums (m x 16 weight rows, float32). Two of each, for
 * even and odd runs: a run's tiles need not wait for the last run's to be read. */
static void amx_configure(int m) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 6; t++) c.rows[t] = (uint8_t)(t % 3 == 1 ? TILE : m), c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* Rows per input tile of a pass of `rows` inputs: the three terms of up to AMX_CHUNK inputs. */
static inline int amx_tile_rows(int rows) { return SPLITS * (rows < AMX_CHUNK ? rows : AMX_CHUNK); }

/* The inputs x[0 .. rows) as tiles: for chunk c of AMX_CHUNK inputs and run r, m = amx_tile_rows
 * rows at tiles + (c * runs + r) * m * 32, term s of input c * AMX_CHUNK + i at row s * m / 3 + i,
 * each the run's 16 pairs (x[j], x[j + 16]) as bfloat16; zero past the last input. And
 * sums[(c * runs + r) * AMX_CHUNK + i], the run's sum. Each input's terms and sums come from it alone. */
static void amx_inputs(int rows, int k, const float *x, int64_t x_t, uint16_t *tiles, float *sums) {
    const int runs = k / RUN, chunks = (rows + AMX_CHUNK - 1) / AMX_CHUNK, m = amx_tile_rows(rows);
    memset(tiles, 0, (size_t)chunks * runs * m * 32 * sizeof(uint16_t));
    memset(sums, 0, (size_t)chunks * runs * AMX_CHUNK * sizeof(float));
    for (int i = 0; i < rows; i++) {
        const int c = i / AMX_CHUNK, at = i % AMX_CHUNK;
        for (int r = 0; r < runs; r++) {
            const float *u = x + i * x_t + r * RUN;
            __m512 lo = _mm512_loadu_ps(u), hi = _mm512_loadu_ps(u + 16); /* x[j], x[j + 16] */
            sums[(c * runs + r) * AMX_CHUNK + at] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
            uint16_t *tile = tiles + (int64_t)(c * runs + r) * m * 32;
            for (int s = 0; s < SPLITS; s++) {
                __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(lo));
                __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(hi));
                _mm512_storeu_si512(tile + (s * m / SPLITS + at) * 32, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
                lo = _mm512_sub_ps(lo, _mm512_castsi512_ps(_mm512_slli_epi32(a, 16))); /* exact: what is left */
                hi = _mm512_sub_ps(hi, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
            }
        }
    }
}

/* bfloat16 of a nibble's integer (q, or q - 8 for sym4), byte by byte: table[q] its low byte,
 * table[16 + q] its high byte. */
static inline __m512i nibble_bytes(int kind) {
    uint8_t t[64] = {0};
    for (int q = 0; q < 16; q++) {
        float v = (float)(kind == SYM4 ? q - 8 : q);
        uint32_t bits;
        memcpy(&bits, &v, 4);
        t[q] = (uint8_t)(bits >> 16), t[16 + q] = (uint8_t)(bits >> 24); /* exact: at most 4 significant bits */
    }
    return _mm512_loadu_si512(t);
}

/* The weights' tile of one run: 16 weight rows at q (`w_t` bytes apart, 16 bytes of nibbles each,
 * byte j holding weights j and j + 16) as 16 tile rows, row j = for each weight row n the pair
 * (w_n[j], w_n[j + 16]) as bfloat16. The 16 x 16 bytes transposed in two levels of two-source byte
 * permutes, then each row's 16 bytes spread to 4 (one pair of bfloat16 a weight row): the high
 * nibble shifted down in the pair's second half, the nibble and the half's place in the pair made an
 * index into `bytes`. */
static inline void amx_weights(const uint8_t *q, int64_t w_t, __m512i bytes, uint16_t *out) {
    __m512i z[4];
    for (int k4 = 0; k4 < 4; k4++) {
        const uint8_t *p = q + 4 * k4 * w_t;
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + w_t)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 2 * w_t)), 2);
        z[k4] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + 3 * w_t)), 3);
    }
    const __m512i l0 = _mm512_loadu_si512(amx_level1[0]), l1 = _mm512_loadu_si512(amx_level1[1]);
    const __m512i m0 = _mm512_loadu_si512(amx_level2[0]), m1 = _mm512_loadu_si512(amx_level2[1]);
    __m512i p01[2] = {_mm512_permutex2var_epi8(z[0], l0, z[1]), _mm512_permutex2var_epi8(z[0], l1, z[1])};
    __m512i p23[2] = {_mm512_permutex2var_epi8(z[2], l0, z[3]), _mm512_permutex2var_epi8(z[2], l1, z[3])};
    const __m512i low = _mm512_set1_epi8(15), pattern = _mm512_loadu_si512(amx_pattern);
    for (int t = 0; t < 4; t++) { /* rows 4t .. 4t + 3 */
        __m512i rows4 = _mm512_permutex2var_epi8(p01[t / 2], t % 2 ? m1 : m0, p23[t / 2]); /* [j][n] */
        for (int jj = 0; jj < 4; jj++) {
            __m512i v = _mm512_permutexvar_epi8(_mm512_loadu_si512(amx_spread[jj]), rows4); /* byte 4n + c: w_n's byte */
            v = _mm512_mask_srli_epi16(v, 0xAAAAAAAA, v, 4);                          /* c = 2, 3: the high nibble */
            v = _mm512_ternarylogic_epi32(v, low, pattern, 0xEA);                      /* (v & 15) | 16 (c odd) */
            _mm512_store_si512(out + (4 * t + jj) * 32, _mm512_permutexvar_epi8(v, bytes));
        }
    }
}

/* One run (r) of one group of 16 weight rows against every chunk of inputs, on tiles TA (inputs), TB
 * (weights) and TC (sums): the weights' tile from `b`, then per chunk its inputs' tile and one tile
 * multiply-add, the sums stored at out + 256 c. */
#define AMX_RUN(TA, TB, TC)                                                                           \
    do {                                                                                              \
        _tile_loadd(TB, b, 64);                                                                       \
        for (int c = 0; c < chunks; c++) {                                                            \
            _tile_loadd(TA, tiles + (int64_t)(c * runs + r) * m * 32, 64);                            \
            _tile_zero(TC);                                                                           \
            _tile_dpbf16ps(TC, TA, TB);                                                               \
            _tile_stored(TC, out + 256 * c, 64);                                                      \
        }                                                                                             \
    } while (0)

/* A run's sums (`out`, as AMX_RUN stored them) into acc[i][j]: d * (the three terms' sums) + m * the
 * input's sum of the run (`sx`, amx_inputs'), in float32. */
static inline void amx_add(int kind, int rows, int per, int chunks, int runs, const float *out, const float *sx,
                           __m512 d, __m512 mn, float *acc) {
    for (int c = 0; c < chunks; c++, out += 256, sx += runs * AMX_CHUNK) {
        const int here = rows - c * AMX_CHUNK < per ? rows - c * AMX_CHUNK : per;
        for (int i = 0; i < here; i++) {
            __m512 v = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(out + 16 * i), _mm512_load_ps(out + 16 * (per + i))),
                                     _mm512_load_ps(out + 16 * (2 * per + i)));
            float *a = acc + (c * AMX_CHUNK + i) * 16;
            v = _mm512_fmadd_ps(d, v, _mm512_load_ps(a));
            if (kind == ASYM4) v = _mm512_fmadd_ps(mn, _mm512_set1_ps(sx[i]), v);
            _mm512_store_ps(a, v);
        }
    }
}

#define AMX_LEAD 2 /* runs a weights' tile is made ahead of its multiply-add, and its sums added behind it */
#define AMX_RING 4 /* buffers of each (a power of 2 above AMX_LEAD) */
#define AMX_OUT (256 * (AMX_INPUTS / AMX_CHUNK)) /* floats of one run's sums, every chunk */

/* y[i, j] for 16 weight rows j at w (`w_t` bytes apart) and `rows` inputs (prepared by amx_inputs),
 * run by run; acc[i][j] in float32, the block's scales applied to each run's sums. Software-pipelined:
 * a run's weights' tile is made AMX_LEAD runs ahead, and its sums added AMX_LEAD runs behind, so that
 * a tile load never waits for stores just made (it reads the cache, not the store buffer: the
 * stores must have retired) and the sums' loads never wait for the tile store. The next group's
 * weights are prefetched a share a run. */
static void amx_group(int kind, int group, int rows, int k, const uint8_t *w, int64_t w_t, const uint16_t *tiles,
                      const float *sums, float *y, int64_t y_t, float *work) {
    const int runs = k / RUN, chunks = (rows + AMX_CHUNK - 1) / AMX_CHUNK, per_block = group / RUN;
    const int m = amx_tile_rows(rows), per = m / SPLITS, rb = run_bytes(kind), hb = header(kind);
    const int64_t bytes = block_bytes(kind, group);
    float *acc = work, *outs = acc + AMX_INPUTS * 16, *scales = outs + AMX_RING * AMX_OUT; /* d, m by run */
    uint16_t *wt = (uint16_t *)(scales + AMX_RING * 32);                                    /* weights' tiles */
    const __m512i table = nibble_bytes(kind);
    const __m512i at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32((int)w_t));
    const char *ahead = (const char *)(w + TILE * w_t);
    const int lines = prefetch_lines(TILE * w_t, k);
    memset(acc, 0, (size_t)rows * 16 * sizeof(float));
    __m512 d = _mm512_setzero_ps(), mn = d;
    for (int r = 0; r < AMX_LEAD && r < runs; r++)
        amx_weights(w + (r / per_block) * bytes + hb + (r % per_block) * rb, w_t, table, wt + r * 512);
    for (int r = 0; r < runs + AMX_LEAD; r++) {
        if (r < runs) {
            const int s = r % per_block;
            if (s == 0) { /* the 16 rows' d (and m) of this block, converted at once */
                __m512i pairs = _mm512_i32gather_epi32(at, w + (r / per_block) * bytes, 1);
                d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
                mn = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
            }
            _mm512_store_ps(scales + (r % AMX_RING) * 32, d);
            _mm512_store_ps(scales + (r % AMX_RING) * 32 + 16, mn);
            for (int l = 0; l < lines; l++, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T0);
            const int n = r + AMX_LEAD;
            if (n < runs)
                amx_weights(w + (n / per_block) * bytes + hb + (n % per_block) * rb, w_t, table,
                            wt + (n % AMX_RING) * 512);
            const uint16_t *b = wt + (r % AMX_RING) * 512;
            float *out = outs + (r % AMX_RING) * AMX_OUT;
            if (r & 1) AMX_RUN(3, 4, 5);
            else AMX_RUN(0, 1, 2);
        }
        const int done = r - AMX_LEAD;
        if (done >= 0) {
            const float *sc = scales + (done % AMX_RING) * 32;
            amx_add(kind, rows, per, chunks, runs, outs + (done % AMX_RING) * AMX_OUT, sums + done * AMX_CHUNK,
                    _mm512_load_ps(sc), _mm512_load_ps(sc + 16), acc);
        }
    }
    for (int i = 0; i < rows; i++) _mm512_storeu_ps(y + i * y_t, _mm512_load_ps(acc + i * 16));
}

/* Floats of a thread's work buffer for amx_group. */
#define AMX_WORK (AMX_INPUTS * 16 + AMX_RING * (AMX_OUT + 32 + 256))

/* The inputs' tiles and sums of one pass of at most AMX_INPUTS rows of k <= MOST_K elements: prepared
 * by the calling thread before each pass, read by every thread. */
#define MOST_K 1536
static uint8_t inputs_buf[(AMX_INPUTS + AMX_CHUNK - 1) / AMX_CHUNK * (MOST_K / RUN) *
                          (SPLITS * AMX_CHUNK * 32 * sizeof(uint16_t) + AMX_CHUNK * sizeof(float))]
    __attribute__((aligned(64)));

/* y[:, column_i + j] for every weight (4-bit, rows a multiple of 16) through the tiles, as
 * specdec_qlinear_many_f32 lays them out: the inputs prepared once a pass, the groups of 16 rows of
 * every weight split over the threads. */
static int amx_linear(int count, const specdec_qweight *ws, int m, int k, const float *x, int64_t x_t, float *y,
                      int64_t y_t, int threads) {
    int64_t groups[MOST_WEIGHTS + 1] = {0};
    for (int i = 0; i < count; i++) {
        if (ws[i].kind == SYM8 || ws[i].n % TILE) return SPECDEC_BAD_SHAPE;
        groups[i + 1] = groups[i] + ws[i].n / TILE;
    }
    for (int i0 = 0; i0 < m; i0 += AMX_INPUTS) {
        const int rows = m - i0 < AMX_INPUTS ? m - i0 : AMX_INPUTS;
        const int chunks = (rows + AMX_CHUNK - 1) / AMX_CHUNK, runs = k / RUN;
        size_t tile_bytes = (size_t)chunks * runs * amx_tile_rows(rows) * 32 * sizeof(uint16_t);
        if (k > MOST_K) return SPECDEC_BAD_SHAPE;
        uint8_t *inputs = inputs_buf;
        const uint16_t *tiles = (const uint16_t *)inputs;
        const float *sums = (const float *)(inputs + tile_bytes);
        amx_inputs(rows, k, x + i0 * x_t, x_t, (uint16_t *)inputs, (float *)(inputs + tile_bytes));
#pragma omp parallel num_threads(threads)
        {
            float *work = scratch(AMX_WORK);
            amx_configure(amx_tile_rows(rows));
#pragma omp for schedule(static)
            for (int64_t f = 0; f < groups[count]; f++) {
                int64_t g = f;
                const specdec_qweight *q = ws + locate(count, groups, &g);
                amx_group(q->kind, q->group, rows, k, q->w + g * TILE * q->w_t, q->w_t, tiles, sums,
                          y + i0 * y_t + q->column + g * TILE, y_t, work);
            }
            _tile_release();
        }
    }
    return SPECDEC_OK;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* An n x k q4_1 weight, its nibbles pseudo-random, its scales finite. */
static specdec_qweight make(int n, int k, uint32_t *seed) {
    int64_t w_t = k / 32 * 20;
    uint8_t *w = aligned_alloc(64, (n * w_t + 63) / 64 * 64);
    for (int64_t i = 0; i < n * w_t; i++) w[i] = (uint8_t)((*seed = *seed * 1664525u + 1013904223u) >> 24);
    for (int64_t b = 0; b < n * w_t; b += 20) {
        uint16_t d = (uint16_t)(0x2000 + (w[b + 4] & 0x3ff)), mn = (uint16_t)(0xa000 + (w[b + 5] & 0x3ff));
        memcpy(w + b, &d, 2);
        memcpy(w + b + 2, &mn, 2);
    }
    return (specdec_qweight){ASYM4, 32, n, 0, w_t, 0, w};
}

typedef int (*linear_fn)(int, const specdec_qweight *, int, int, const float *, int64_t, float *, int64_t, int);

static void step(linear_fn f, specdec_qweight layer[30][7], int m, const float *x, float *y, int threads) {
    for (int l = 0; l < 30; l++) {
        f(3, &layer[l][0], m, 576, x, 1536, y, 960, threads);
        f(1, &layer[l][3], m, 576, x, 1536, y, 576, threads);
        f(2, &layer[l][4], m, 576, x, 1536, y, 3072, threads);
        f(1, &layer[l][6], m, 1536, x, 1536, y, 576, threads);
    }
}

static int by_value(const void *a, const void *b) {
    double u = *(const double *)a, v = *(const double *)b;
    return u < v ? -1 : u > v;
}

int main(int argc, char **argv) {
    int m = argc > 1 ? atoi(argv[1]) : 1, threads = argc > 2 ? atoi(argv[2]) : 2, steps = argc > 3 ? atoi(argv[3]) : 20;
    if (m < 1 || m > 120 || threads < 1 || steps < 1 || steps > 1000) {
        fprintf(stderr, "usage: %s ROWS(1-120) THREADS STEPS(1-1000)\n", argv[0]);
        return 2;
    }
    if (!amx_enable()) {
        fprintf(stderr, "the kernel did not grant the AMX tile state\n");
        return 2;
    }
    uint32_t seed = 1;
    specdec_qweight layer[30][7];
    for (int l = 0; l < 30; l++) {
        int shapes[7][2] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
        for (int i = 0; i < 7; i++) layer[l][i] = make(shapes[i][0], shapes[i][1], &seed);
        layer[l][1].column = 576, layer[l][2].column = 768, layer[l][5].column = 1536;
    }
    float *x = aligned_alloc(64, sizeof(float) * 1536 * m), *y = aligned_alloc(64, sizeof(float) * 3072 * m);
    float *y2 = aligned_alloc(64, sizeof(float) * 3072 * m);
    for (int i = 0; i < 1536 * m; i++) x[i] = ((float)((seed = seed * 1664525u + 1013904223u) >> 8) / 16777216.0f - 0.5f);

    /* Error of both against float64, relative to sum |x w|, on the gate/up weights of layer 0. */
    double *xd = malloc(sizeof(double) * 576 * m), *yd = malloc(sizeof(double) * 3072 * m), worst[2] = {0, 0};
    float *wd = malloc(sizeof(float) * 3072 * 576);
    int64_t *at = malloc(sizeof(int64_t) * 1536);
    for (int i = 0; i < m; i++)
        for (int e = 0; e < 576; e++) xd[i * 576 + e] = x[i * 1536 + e];
    specdec_qlinear_many_f64(2, &layer[0][4], m, 576, xd, 576, yd, 3072, threads);
    specdec_qlinear_many_f32(2, &layer[0][4], m, 576, x, 1536, y, 3072, threads);
    amx_linear(2, &layer[0][4], m, 576, x, 1536, y2, 3072, threads);
    for (int j = 0; j < 1536; j++) at[j] = j;
    specdec_qrows_f32(ASYM4, 32, 1536, at, 576, layer[0][4].w, layer[0][4].w_t, wd, 576, threads);
    specdec_qrows_f32(ASYM4, 32, 1536, at, 576, layer[0][5].w, layer[0][5].w_t, wd + 1536 * 576, 576, threads);
    int invariant = 1;
    for (int i = 0; i < m; i++) {
        float one[3072];
        amx_linear(2, &layer[0][4], 1, 576, x + i * 1536, 1536, one, 3072, threads);
        invariant &= !memcmp(one, y2 + i * 3072, sizeof one);
        for (int j = 0; j < 3072; j++) {
            double size = 0;
            for (int e = 0; e < 576; e++) size += fabs(xd[i * 576 + e] * wd[j * 576 + e]);
            double ref = yd[i * 3072 + j];
            worst[0] = fmax(worst[0], fabs(y[i * 3072 + j] - ref) / size);
            worst[1] = fmax(worst[1], fabs(y2[i * 3072 + j] - ref) / size);
        }
    }
    printf("error / sum |x w| against float64: vector loops %.2e, tiles %.2e; tiles' rows alone the same bits: %s\n",
           worst[0], worst[1], invariant ? "yes" : "NO");

    double times[2][1000];
    for (int s = -3; s < steps; s++) /* 3 of warm-up; the two kinds in turn */
        for (int kind = 0; kind < 2; kind++) {
            double start = now();
            step(kind ? amx_linear : specdec_qlinear_many_f32, layer, m, x, y, threads);
            if (s >= 0) times[kind][s] = now() - start;
        }
    for (int kind = 0; kind < 2; kind++) {
        qsort(times[kind], steps, sizeof(double), by_value);
        printf("rows %d, threads %d, %s: median %.3f ms, min %.3f ms\n", m, threads, kind ? "tiles" : "vector loops",
               times[kind][steps / 2] * 1e3, times[kind][0] * 1e3);
    }
    return 0;
}
