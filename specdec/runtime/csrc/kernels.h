/* The types the kernels' entry points share, and the entry points one kernel file calls in another
 * (stack.c runs a pass's layers through the others). */
#ifndef SPECDEC_KERNELS_H
#define SPECDEC_KERNELS_H

#include <stdint.h>

/* A segment of a row's keys and values (attend.c). */
typedef struct {
    const void *base; /* element [0, 0, 0, 0, 0] of the segment: keys at base, values at base + kv_stride */
    int64_t kv_stride, layer_stride, head_stride, pos_stride; /* in elements */
    int64_t start, width; /* absolute position of its first key; positions the row reads from it */
    int64_t layers, heads, positions, dim; /* its sizes, [2, layers, heads, positions, dim] */
    int64_t bytes; /* of storage from base on: every element its sizes and strides reach lies within */
} segment_t;

/* Queries, outputs, new keys or values: `[tokens, heads, dim]` from base, with strides (dim contiguous). */
typedef struct {
    void *base;
    int64_t t_stride, h_stride; /* in elements */
    int64_t bytes;              /* of storage from base on */
} rows_t;

typedef struct {
    int32_t first_segment, segments; /* into the segment array, in position order */
    int32_t first_query, queries;    /* rows of q and out holding the block's positions */
    int64_t past;                    /* keys before the block: query j sees keys 0 .. past + j */
} row_t;

/* One weight of a call: its blocks' kind and group, its n rows of `w_t` bytes at w, and the column
 * of y where its outputs start (the weights of a fused projection, q/k/v or gate/up, side by side). */
typedef struct {
    int32_t kind, group, n, unused;
    int64_t w_t, column;
    const uint8_t *w;
} specdec_qweight;

int specdec_attend_f32(int rows, const row_t *row, int nsegs, const segment_t *segs, int layer, int heads_kv,
                       int groups, int dim, int64_t tokens, const rows_t *q, const rows_t *k, const rows_t *v,
                       const rows_t *out, double scale, int threads);
int specdec_qlinear_many_f32(int count, const specdec_qweight *ws, int m, int k, const float *x, int64_t x_t,
                             float *y, int64_t y_t, int threads);
int specdec_rms_norm_f32(int t, int n, float *x, int64_t x_t, const float *delta, int64_t delta_t, const float *w,
                         float eps, float *out, int64_t out_t, int threads);
int specdec_rope_f32(int t, int heads, int d, float *qk, int64_t row_t, const float *cos, const float *sin,
                     int64_t cs_t, int threads);
int specdec_silu_mul_f32(int t, int n, const float *gu, int64_t gu_t, float *out, int64_t out_t, int threads);

#endif
