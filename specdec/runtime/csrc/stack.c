/* A short pass's Llama layers in one call: the same kernel calls, in the same order, as the pass
 * makes from Python (`PackedForward._native_layers`), made from here.
 *
 * A decode step of a small model is ~270 kernel calls between its layers' matrices (4 projections,
 * 3 elementwise calls and the attention of each of 30 layers); from Python each costs the
 * interpreter and ctypes a few microseconds around the kernel (about 1.4 ms of a 6-7 ms step of the
 * packed model here). Every call is the entry point Python would have made, with the same
 * arguments, so the results are the same bits; the first status that is not SPECDEC_OK ends the
 * pass and is returned (the Python side raises it, as it does for a call of its own).
 *
 * Per layer (x the residual stream, updated in place):
 *   h = norm_in(x)            (the previous layer's last call computes it, fused with its residual add)
 *   qkv = h W_qkv^T;  rope(q, k);  attended = attention(q; the rows' keys/values + k, v)
 *   delta = attended W_o^T;  x += delta;  h = norm_post(x)
 *   gate_up = h W_gate_up^T;  act = silu(gate) * up;  delta = act W_down^T
 *   x += delta;  h = the next layer's norm_in(x)   (after the last layer: x += delta only)
 * Buffers are contiguous rows: x, h, delta [t, hidden]; qkv [t, (heads + 2 kv_heads) dim] (q, k, v
 * side by side); attended [t, heads dim]; gate_up [t, 2 inter]; act [t, inter]; cos, sin [t, dim]. */

#include <stdint.h>

#include "kernels.h"
#include "status.h"

/* One layer's weights: its fused projections (arrays of `specdec_qweight`, as the pass's
 * `QuantizedProjection`s hold them) and its two RMSNorms. */
typedef struct {
    int32_t qkv_count, o_count, gate_up_count, down_count;
    const specdec_qweight *qkv, *o, *gate_up, *down;
    const float *norm_in, *norm_post;
    float eps_in, eps_post;
} specdec_llama_layer;

int specdec_llama_layers_f32(int layers, const specdec_llama_layer *layer, int t, int hidden, int inter, int heads,
                             int kv_heads, int dim, float *x, float *h, float *delta, float *qkv, float *attended,
                             float *gate_up, float *act, const float *cos, const float *sin, int rows,
                             const row_t *row, int nsegs, const segment_t *segs, double scale, int threads) {
    if (layers < 1 || t < 1 || hidden < 1 || inter < 1 || heads < 1 || kv_heads < 1 || heads % kv_heads || dim < 2)
        return SPECDEC_BAD_SHAPE;
    int64_t q_width = (int64_t)heads * dim, kv_width = (int64_t)kv_heads * dim, width = q_width + 2 * kv_width;
    /* q, k and v as the attention kernel reads them: views of qkv, each to its end */
    rows_t q = {qkv, width, dim, (int64_t)sizeof(float) * t * width};
    rows_t k = {qkv + q_width, width, dim, q.bytes - (int64_t)sizeof(float) * q_width};
    rows_t v = {qkv + q_width + kv_width, width, dim, k.bytes - (int64_t)sizeof(float) * kv_width};
    rows_t out = {attended, q_width, dim, (int64_t)sizeof(float) * t * q_width};
    int rc = specdec_rms_norm_f32(t, hidden, x, hidden, 0, 0, layer[0].norm_in, layer[0].eps_in, h, hidden, threads);
    for (int l = 0; l < layers && rc == SPECDEC_OK; l++) {
        const specdec_llama_layer *w = layer + l;
        if ((rc = specdec_qlinear_many_f32(w->qkv_count, w->qkv, t, hidden, h, hidden, qkv, width, threads)) ||
            (rc = specdec_rope_f32(t, heads + kv_heads, dim, qkv, width, cos, sin, dim, threads)) ||
            (rc = specdec_attend_f32(rows, row, nsegs, segs, l, kv_heads, heads / kv_heads, dim, t, &q, &k, &v, &out,
                                     scale, threads)) ||
            (rc = specdec_qlinear_many_f32(w->o_count, w->o, t, (int)q_width, attended, q_width, delta, hidden,
                                           threads)) ||
            (rc = specdec_rms_norm_f32(t, hidden, x, hidden, delta, hidden, w->norm_post, w->eps_post, h, hidden,
                                       threads)) ||
            (rc = specdec_qlinear_many_f32(w->gate_up_count, w->gate_up, t, hidden, h, hidden, gate_up, 2 * inter,
                                           threads)) ||
            (rc = specdec_silu_mul_f32(t, inter, gate_up, 2 * inter, act, inter, threads)) ||
            (rc = specdec_qlinear_many_f32(w->down_count, w->down, t, inter, act, inter, delta, hidden, threads)))
            break;
        if (l + 1 < layers) {
            rc = specdec_rms_norm_f32(t, hidden, x, hidden, delta, hidden, layer[l + 1].norm_in, layer[l + 1].eps_in, h,
                                      hidden, threads);
        } else {
            for (int64_t i = 0; i < (int64_t)t * hidden; i++) x[i] += delta[i];
        }
    }
    return rc;
}
