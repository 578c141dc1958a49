/* The elementwise work of a Llama layer between its matrix products, float32, one call each.
 *
 * A decode step of a small model is a few hundred of these between its 121 projections, and each
 * made through torch's operators costs several operator calls (RMSNorm alone: a square, a mean,
 * an add, a reciprocal square root, two products and a conversion, ~8 dispatches of 3-10 us for
 * 576 floats); here each is one call into C writing into buffers the pass keeps:
 *
 *   specdec_rms_norm_f32   x += delta (the residual, optional), then out = w * (x * rsqrt(mean(x^2) + eps))
 *   specdec_rope_f32       q and k rotated in place: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
 *   specdec_silu_mul_f32   out = silu(gate) * up, gate and up side by side in one row
 *
 * The arithmetic is transformers' Llama in float32, operation by operation (each product and sum
 * rounded to float32 as torch's operators round it; the sum of squares is accumulated in double,
 * where torch sums floats in an order of its own), so the results agree with the module path to
 * float32 rounding, not bit for bit. Rows are split over `threads` OpenMP threads when there are
 * enough of them to pay for a parallel region (a prefill chunk); a decode row stays on this thread.
 *
 * The _bf16 entry points are the same for a model in bfloat16 (--dtype bfloat16), rounding where
 * torch's bfloat16 operators round: every tensor they make is bfloat16, each computed in float32 from
 * its widened inputs and rounded once (the residual sum, each product and sum of the rotation, SiLU
 * and its product with up); RMSNorm in float32 as the module computes it (it widens its input), the
 * normalised row rounded to bfloat16 before the weight's product, as the module does. Each of these
 * calls replaces several of torch's operators (~3-10 us each, ~25 a layer). */

#include <math.h>
#include <stdint.h>

#include "bf16.h"
#include "kernels.h"
#include "status.h"

#define PARALLEL_ROWS 16 /* fewer rows run on the calling thread */

/* Compiled without contraction: x * cos + r * sin is two products and a sum, each rounded, as torch
 * computes q * cos + rotate_half(q) * sin (a fused multiply-add would round once less). */
#pragma GCC optimize("fp-contract=off")

/* The three entry points for elements of type S (float32 or bfloat16's uint16_t), computed in float:
 * LD widens an element, RND rounds an intermediate to S's precision (float32: nothing to do), ST
 * narrows a result. With float32 these are the plain expressions, each product and sum rounded once. */
#define DEFINE_LAYER_OPS(KIND, S, LD, RND, ST)                                                        \
    int specdec_rms_norm_##KIND(int t, int n, S *x, int64_t x_t, const S *delta, int64_t delta_t, const S *w, \
                                float eps, S *out, int64_t out_t, int threads) {                      \
        if (t < 0 || n < 1) return SPECDEC_BAD_SHAPE;                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)")     \
        for (int r = 0; r < t; r++) {                                                                 \
            S *u = x + r * x_t, *y = out + r * out_t;                                                 \
            if (delta) {                                                                              \
                const S *e = delta + r * delta_t;                                                     \
                _Pragma("omp simd") for (int j = 0; j < n; j++) u[j] = ST(LD(u[j]) + LD(e[j]));       \
            }                                                                                         \
            double squares = 0;                                                                       \
            _Pragma("omp simd reduction(+ : squares)") for (int j = 0; j < n; j++)                    \
                squares += (double)LD(u[j]) * (double)LD(u[j]);                                       \
            float scale = 1.0f / sqrtf((float)(squares / n) + eps);                                   \
            _Pragma("omp simd") for (int j = 0; j < n; j++) y[j] = ST(LD(w[j]) * RND(LD(u[j]) * scale)); \
        }                                                                                             \
        return SPECDEC_OK;                                                                            \
    }                                                                                                 \
                                                                                                      \
    /* Rows of `heads` heads of d elements (row r's head h at qk + r * row_t + h * d), rotated in      \
     * place by row r's cos and sin (`[t, d]` rows `cs_t` apart). */                                  \
    int specdec_rope_##KIND(int t, int heads, int d, S *qk, int64_t row_t, const S *cos, const S *sin, \
                            int64_t cs_t, int threads) {                                              \
        if (t < 0 || heads < 1 || d < 2 || d % 2 || d > 1024) return SPECDEC_BAD_SHAPE;               \
        int half = d / 2;                                                                             \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)")     \
        for (int r = 0; r < t; r++) {                                                                 \
            const S *c = cos + r * cs_t, *s = sin + r * cs_t;                                         \
            for (int h = 0; h < heads; h++) {                                                         \
                S *v = qk + r * row_t + (int64_t)h * d;                                               \
                float lo[512];                                                                        \
                _Pragma("omp simd") for (int j = 0; j < half; j++) lo[j] = LD(v[j]);                  \
                _Pragma("omp simd") for (int j = 0; j < half; j++)                                    \
                    v[j] = ST(RND(lo[j] * LD(c[j])) + RND(-LD(v[j + half]) * LD(s[j])));              \
                _Pragma("omp simd") for (int j = 0; j < half; j++)                                    \
                    v[j + half] = ST(RND(LD(v[j + half]) * LD(c[j + half])) + RND(lo[j] * LD(s[j + half]))); \
            }                                                                                         \
        }                                                                                             \
        return SPECDEC_OK;                                                                            \
    }                                                                                                 \
                                                                                                      \
    /* out[r, j] = silu(gu[r, j]) * gu[r, n + j]: the gate's activation times the up projection. */  \
    int specdec_silu_mul_##KIND(int t, int n, const S *gu, int64_t gu_t, S *out, int64_t out_t, int threads) { \
        if (t < 0 || n < 1) return SPECDEC_BAD_SHAPE;                                                 \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)")     \
        for (int r = 0; r < t; r++) {                                                                 \
            const S *g = gu + r * gu_t, *u = g + n;                                                   \
            S *y = out + r * out_t;                                                                   \
            _Pragma("omp simd") for (int j = 0; j < n; j++) {                                         \
                float a = LD(g[j]);                                                                   \
                y[j] = ST(RND(a / (1.0f + expf(-a))) * LD(u[j]));                                     \
            }                                                                                         \
        }                                                                                             \
        return SPECDEC_OK;                                                                            \
    }

#define F32_SAME(x) (x)
#define BF16_ROUND(x) bf16_to_f32(f32_to_bf16(x))
DEFINE_LAYER_OPS(f32, float, F32_SAME, F32_SAME, F32_SAME)
DEFINE_LAYER_OPS(bf16, uint16_t, bf16_to_f32, BF16_ROUND, f32_to_bf16)
