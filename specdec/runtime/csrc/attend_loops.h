/* The loops over a work item's keys and values for one storage type of keys and values. attend.c
 * includes this file once per type, with S (the stored element: float, or uint16_t holding bfloat16),
 * SK (its suffix: f32, bf16), LOAD1 (one stored element as a float), LOAD256 and LOAD512 (8 and 16
 * of them as a vector of floats) defined; queries, scores and sums are float whatever S is, so a
 * bfloat16 key or value is widened exactly and every product and sum is the float32 loops' own.
 * It defines scores_SK and values_SK:
 * scores[i * CHUNK + p] = scale * q_i . k_p; acc[i] = sum_p w[i * CHUNK + p] v_p. */

#define LOOPS_CAT_(a, b) a##_##b
#define LOOPS_CAT(a, b) LOOPS_CAT_(a, b)
#define LFN(name) LOOPS_CAT(name, SK)

#if defined(__AVX2__) && defined(__FMA__)
DEFINE_LOOPS(float, S, LOAD1, LFN(plain_scores), LFN(plain_values)) /* for head sizes the vectors do not divide */

/* Scores of 3 queries against 4 keys (twelve accumulators; dim a multiple of 8). */
static inline void LFN(scores_3x4)(const float *q0, const float *q1, const float *q2, const S *const *k,
                              int dim, __m128 scale, float *d0, float *d1, float *d2) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00,
           a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int e = 0; e < dim; e += 8) {
        __m256 x0 = _mm256_loadu_ps(q0 + e), x1 = _mm256_loadu_ps(q1 + e), x2 = _mm256_loadu_ps(q2 + e), y;
        y = LOAD256(k[0] + e);
        a00 = _mm256_fmadd_ps(x0, y, a00), a10 = _mm256_fmadd_ps(x1, y, a10), a20 = _mm256_fmadd_ps(x2, y, a20);
        y = LOAD256(k[1] + e);
        a01 = _mm256_fmadd_ps(x0, y, a01), a11 = _mm256_fmadd_ps(x1, y, a11), a21 = _mm256_fmadd_ps(x2, y, a21);
        y = LOAD256(k[2] + e);
        a02 = _mm256_fmadd_ps(x0, y, a02), a12 = _mm256_fmadd_ps(x1, y, a12), a22 = _mm256_fmadd_ps(x2, y, a22);
        y = LOAD256(k[3] + e);
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
static inline void LFN(scores_3x8)(const float *q0, const float *q1, const float *q2, const S *const *k, int dim,
                              __m128 scale, float *d0, float *d1, float *d2) {
    __m512 a[3][8];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 8; j++) a[i][j] = _mm512_setzero_ps();
    for (int e = 0; e < dim; e += 16) {
        __m512 x0 = _mm512_loadu_ps(q0 + e), x1 = _mm512_loadu_ps(q1 + e), x2 = _mm512_loadu_ps(q2 + e);
        for (int j = 0; j < 8; j++) {
            __m512 y = LOAD512(k[j] + e);
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

static void LFN(scores_512)(const float *qs, int nq, int dim, const S *const *keys, int64_t count, float scale,
                       float *scores) {
    __m128 s = _mm_set1_ps(scale);
    float spare[16], tail[3][8];
    for (int i = 0; i < nq; i += 3) { /* missing queries of the last triple repeat the first; results dropped */
        const float *q0 = qs + i * dim, *q1 = i + 1 < nq ? q0 + dim : q0, *q2 = i + 2 < nq ? q0 + 2 * dim : q0;
        float *d0 = scores + i * CHUNK;
        int64_t p = 0;
        for (; p + 8 <= count; p += 8) {
            for (int64_t a = p + AHEAD_KEYS; i == 0 && a < p + AHEAD_KEYS + 8 && a < count; a++)
                fetch_row(keys[a], dim * (int)sizeof(S));
            LFN(scores_3x8)(q0, q1, q2, keys + p, dim, s, d0 + p, i + 1 < nq ? d0 + CHUNK + p : spare,
                       i + 2 < nq ? d0 + 2 * CHUNK + p : spare + 8);
        }
        if (p < count) { /* the last 1-7 keys, with the first of them repeated */
            const S *k[8];
            for (int j = 0; j < 8; j++) k[j] = keys[p + j < count ? p + j : p];
            LFN(scores_3x8)(q0, q1, q2, k, dim, s, tail[0], tail[1], tail[2]);
            for (int r = 0; r < 3 && i + r < nq; r++)
                for (int64_t j = 0; p + j < count; j++) d0[r * CHUNK + p + j] = tail[r][j];
        }
    }
}

/* acc[i][e0 .. e0 + 64) += sum_p w[i * CHUNK + p] v_p[e0 ..] for QB queries (4 * QB accumulators),
 * asking for rows ahead[0 .. ahead_n) on the way. */
#define DEFINE_VALUES512(QB)                                                                         \
    static inline void LFN(values512_##QB)(const float *w, const S *const *v, int64_t count, int e0,   \
                                      float *acc, int dim, const S *const *ahead, int64_t ahead_n) {                                         \
        __m512 c[QB][4];                                                                             \
        for (int i = 0; i < QB; i++)                                                                 \
            for (int j = 0; j < 4; j++) c[i][j] = _mm512_loadu_ps(acc + i * dim + e0 + 16 * j);      \
        for (int64_t p = 0; p < count; p++) {                                                        \
            if (p < ahead_n) fetch_row(ahead[p], dim * (int)sizeof(S)); /* the first pass asks for rows ahead */ \
            const S *y = v[p] + e0;                                                              \
            __m512 y0 = LOAD512(y), y1 = LOAD512(y + 16), y2 = LOAD512(y + 32), \
                   y3 = LOAD512(y + 48);                                                     \
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

static void LFN(values_512)(const float *w, int nq, int dim, const S *const *values, int64_t count, float *acc) {
    memset(acc, 0, sizeof(float) * nq * dim);
    for (int64_t p = 0; p < count; p += SUB) {
        int64_t m = count - p < SUB ? count - p : SUB;
        for (int i = 0; i < nq; i += 5)
            for (int e = 0; e < dim; e += 64) {
                const float *wi = w + i * CHUNK + p;
                const S *const *vp = values + p;
                float *ai = acc + i * dim;
                int64_t an = i || e ? 0 : rows_ahead(count, p, m);
                const S *const *ah = an ? vp + AHEAD_VALUES : vp;
                switch (nq - i < 5 ? nq - i : 5) {
                case 1: LFN(values512_1)(wi, vp, m, e, ai, dim, ah, an); break;
                case 2: LFN(values512_2)(wi, vp, m, e, ai, dim, ah, an); break;
                case 3: LFN(values512_3)(wi, vp, m, e, ai, dim, ah, an); break;
                case 4: LFN(values512_4)(wi, vp, m, e, ai, dim, ah, an); break;
                default: LFN(values512_5)(wi, vp, m, e, ai, dim, ah, an);
                }
            }
    }
}
#endif

static void LFN(scores)(const float *qs, int nq, int dim, const S *const *keys, int64_t count, float scale,
                       float *scores) {
#ifdef __AVX512F__
    if (dim % 16 == 0) {
        LFN(scores_512)(qs, nq, dim, keys, count, scale, scores);
        return;
    }
#endif
    if (dim % 8) {
        LFN(plain_scores)(qs, nq, dim, keys, count, scale, scores);
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
                fetch_row(keys[a], dim * (int)sizeof(S));
            LFN(scores_3x4)(q0, q1, q2, keys + p, dim, s, d0 + p, i + 1 < nq ? d0 + CHUNK + p : spare,
                       i + 2 < nq ? d0 + 2 * CHUNK + p : spare + 4);
        }
        if (p < count) { /* the last 1-3 keys, with the first of them repeated */
            const S *k[4];
            for (int j = 0; j < 4; j++) k[j] = keys[p + j < count ? p + j : p];
            LFN(scores_3x4)(q0, q1, q2, k, dim, s, tail[0], tail[1], tail[2]);
            for (int r = 0; r < 3 && i + r < nq; r++)
                for (int64_t j = 0; p + j < count; j++) d0[r * CHUNK + p + j] = tail[r][j];
        }
    }
}

/* acc[i][e0 .. e0 + 32) += sum_p w[i * CHUNK + p] v_p[e0 ..] for QB queries (eight accumulators for QB = 2),
 * asking for rows ahead[0 .. ahead_n) on the way. */
#define DEFINE_VALUES(QB)                                                                            \
    static inline void LFN(values_##QB##x32)(const float *w, const S *const *v, int64_t count, int e0, \
                                        float *acc, int dim, const S *const *ahead, int64_t ahead_n) {                                       \
        __m256 c[QB][4];                                                                             \
        for (int i = 0; i < QB; i++)                                                                 \
            for (int j = 0; j < 4; j++) c[i][j] = _mm256_loadu_ps(acc + i * dim + e0 + 8 * j);       \
        for (int64_t p = 0; p < count; p++) {                                                        \
            if (p < ahead_n) fetch_row(ahead[p], dim * (int)sizeof(S)); /* the first pass asks for rows ahead */ \
            const S *y = v[p] + e0;                                                              \
            __m256 y0 = LOAD256(y), y1 = LOAD256(y + 8), y2 = LOAD256(y + 16), \
                   y3 = LOAD256(y + 24);                                                     \
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

static void LFN(values)(const float *w, int nq, int dim, const S *const *values, int64_t count, float *acc) {
#ifdef __AVX512F__
    if (dim % 64 == 0) {
        LFN(values_512)(w, nq, dim, values, count, acc);
        return;
    }
#endif
    if (dim % 32) {
        LFN(plain_values)(w, nq, dim, values, count, acc);
        return;
    }
    memset(acc, 0, sizeof(float) * nq * dim);
    for (int64_t p = 0; p < count; p += SUB) {
        int64_t m = count - p < SUB ? count - p : SUB;
        for (int i = 0; i < nq; i += 2)
            for (int e = 0; e < dim; e += 32) {
                int64_t an = i || e ? 0 : rows_ahead(count, p, m);
                const S *const *ah = an ? values + p + AHEAD_VALUES : values;
                if (nq - i == 1)
                    LFN(values_1x32)(w + i * CHUNK + p, values + p, m, e, acc + i * dim, dim, ah, an);
                else
                    LFN(values_2x32)(w + i * CHUNK + p, values + p, m, e, acc + i * dim, dim, ah, an);
            }
    }
}
#else
DEFINE_LOOPS(float, S, LOAD1, LFN(scores), LFN(values)) /* the plain loops are the only ones */
#endif

#undef DEFINE_VALUES
#undef DEFINE_VALUES512
#undef LFN
#undef LOOPS_CAT
#undef LOOPS_CAT_
#undef S
#undef SK
#undef LOAD1
#undef LOAD256
#undef LOAD512
