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

int specdec_rms_norm_f32(int t, int n, float *x, int64_t x_t, const float *delta, int64_t delta_t, const float *w,
                         float eps, float *out, int64_t out_t, int threads) {
    if (t < 0 || n < 1) return SPECDEC_BAD_SHAPE;
#pragma omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)
    for (int r = 0; r < t; r++) {
        float *u = x + r * x_t, *y = out + r * out_t;
        if (delta) {
            const float *e = delta + r * delta_t;
#pragma omp simd
            for (int j = 0; j < n; j++) u[j] = u[j] + e[j];
        }
        double squares = 0;
#pragma omp simd reduction(+ : squares)
        for (int j = 0; j < n; j++) squares += (double)u[j] * (double)u[j];
        float scale = 1.0f / sqrtf((float)(squares / n) + eps);
#pragma omp simd
        for (int j = 0; j < n; j++) y[j] = w[j] * (u[j] * scale);
    }
    return SPECDEC_OK;
}

/* Rows of `heads` heads of d floats (row r's head h at qk + r * row_t + h * d), rotated in place by
 * row r's cos and sin (`[t, d]` rows `cs_t` apart). */
int specdec_rope_f32(int t, int heads, int d, float *qk, int64_t row_t, const float *cos, const float *sin,
                     int64_t cs_t, int threads) {
    if (t < 0 || heads < 1 || d < 2 || d % 2 || d > 1024) return SPECDEC_BAD_SHAPE;
    int half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)
    for (int r = 0; r < t; r++) {
        const float *c = cos + r * cs_t, *s = sin + r * cs_t;
        for (int h = 0; h < heads; h++) {
            float *v = qk + r * row_t + (int64_t)h * d;
            float lo[512];
#pragma omp simd
            for (int j = 0; j < half; j++) lo[j] = v[j];
#pragma omp simd
            for (int j = 0; j < half; j++) v[j] = v[j] * c[j] + (-v[j + half]) * s[j];
#pragma omp simd
            for (int j = 0; j < half; j++) v[j + half] = v[j + half] * c[j + half] + lo[j] * s[j + half];
        }
    }
    return SPECDEC_OK;
}

/* out[r, j] = silu(gu[r, j]) * gu[r, n + j]: the gate's activation times the up projection. */
int specdec_silu_mul_f32(int t, int n, const float *gu, int64_t gu_t, float *out, int64_t out_t, int threads) {
    if (t < 0 || n < 1) return SPECDEC_BAD_SHAPE;
#pragma omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)
    for (int r = 0; r < t; r++) {
        const float *g = gu + r * gu_t, *u = g + n;
        float *y = out + r * out_t;
#pragma omp simd
        for (int j = 0; j < n; j++) y[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
    return SPECDEC_OK;
}

int specdec_rms_norm_bf16(int t, int n, uint16_t *x, int64_t x_t, const uint16_t *delta, int64_t delta_t,
                          const uint16_t *w, float eps, uint16_t *out, int64_t out_t, int threads) {
    if (t < 0 || n < 1) return SPECDEC_BAD_SHAPE;
#pragma omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)
    for (int r = 0; r < t; r++) {
        uint16_t *u = x + r * x_t, *y = out + r * out_t;
        if (delta) {
            const uint16_t *e = delta + r * delta_t;
#pragma omp simd
            for (int j = 0; j < n; j++) u[j] = f32_to_bf16(bf16_to_f32(u[j]) + bf16_to_f32(e[j]));
        }
        double squares = 0;
#pragma omp simd reduction(+ : squares)
        for (int j = 0; j < n; j++) squares += (double)bf16_to_f32(u[j]) * (double)bf16_to_f32(u[j]);
        float scale = 1.0f / sqrtf((float)(squares / n) + eps);
#pragma omp simd
        for (int j = 0; j < n; j++)
            y[j] = f32_to_bf16(bf16_to_f32(w[j]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(u[j]) * scale)));
    }
    return SPECDEC_OK;
}

int specdec_rope_bf16(int t, int heads, int d, uint16_t *qk, int64_t row_t, const uint16_t *cos, const uint16_t *sin,
                      int64_t cs_t, int threads) {
    if (t < 0 || heads < 1 || d < 2 || d % 2 || d > 1024) return SPECDEC_BAD_SHAPE;
    int half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)
    for (int r = 0; r < t; r++) {
        const uint16_t *c = cos + r * cs_t, *s = sin + r * cs_t;
        for (int h = 0; h < heads; h++) {
            uint16_t *v = qk + r * row_t + (int64_t)h * d;
            float lo[512];
#pragma omp simd
            for (int j = 0; j < half; j++) lo[j] = bf16_to_f32(v[j]);
#pragma omp simd
            for (int j = 0; j < half; j++) {
                float a = bf16_to_f32(f32_to_bf16(lo[j] * bf16_to_f32(c[j])));
                float b = bf16_to_f32(f32_to_bf16(-bf16_to_f32(v[j + half]) * bf16_to_f32(s[j])));
                v[j] = f32_to_bf16(a + b);
            }
#pragma omp simd
            for (int j = 0; j < half; j++) {
                float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(v[j + half]) * bf16_to_f32(c[j + half])));
                float b = bf16_to_f32(f32_to_bf16(lo[j] * bf16_to_f32(s[j + half])));
                v[j + half] = f32_to_bf16(a + b);
            }
        }
    }
    return SPECDEC_OK;
}

int specdec_silu_mul_bf16(int t, int n, const uint16_t *gu, int64_t gu_t, uint16_t *out, int64_t out_t, int threads) {
    if (t < 0 || n < 1) return SPECDEC_BAD_SHAPE;
#pragma omp parallel for schedule(static) num_threads(threads) if (t >= PARALLEL_ROWS)
    for (int r = 0; r < t; r++) {
        const uint16_t *g = gu + r * gu_t, *u = g + n;
        uint16_t *y = out + r * out_t;
#pragma omp simd
        for (int j = 0; j < n; j++) {
            float x = bf16_to_f32(g[j]);
            y[j] = f32_to_bf16(bf16_to_f32(f32_to_bf16(x / (1.0f + expf(-x)))) * bf16_to_f32(u[j]));
        }
    }
    return SPECDEC_OK;
}
