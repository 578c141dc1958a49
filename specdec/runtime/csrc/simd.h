/* AVX2 helpers shared by the kernels (included where __AVX2__ and __FMA__ are defined). */
#ifndef SPECDEC_SIMD_H
#define SPECDEC_SIMD_H

#include <immintrin.h>

/* The four sums of a, b, c, d (8 lanes each), in that order. */
static inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

#ifdef __AVX512F__
/* The sum of a's two 8-lane halves (with sum4: a 16-lane accumulator's lanes in one fixed order). */
static inline __m256 fold(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#endif

#endif
