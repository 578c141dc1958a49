/* The attention entry point and its work items for one element type. attend.c includes this file
 * once per type, with S (the stored element of queries, keys, values and outputs), T (the type it
 * computes in: S, or float for bfloat16), KIND (the suffix: f32, f64, bf16), EXP (T's exp function),
 * TO_T and TO_S (one element from S to T and back) defined, and with scores_KIND and values_KIND (the
 * loops over a chunk's keys and values) in scope. A header
 * included per type rather than one macro, so that a debugger steps through it line by line. */

#define ATTEND_CAT_(a, b) a##_##b
#define ATTEND_CAT(a, b) ATTEND_CAT_(a, b)
#define FN(name) ATTEND_CAT(name, KIND)

/* Copy the G * n queries of `row` at key/value head `head` into `qs` (query (g, j) is number g * n + j)
 * and count, for each, the keys of p0 .. p1 - 1 it sees (query j sees keys 0 .. past + j). */
static void FN(load_queries)(const row_t *row, int head, int groups, int dim, const S *q, int64_t q_t,
                             int64_t q_h, int64_t p0, int64_t p1, T *qs, int64_t *seen) {
    int n = row->queries;
    for (int g = 0; g < groups; g++)
        for (int j = 0; j < n; j++) {
            int i = g * n + j;
            const S *src = q + (row->first_query + j) * q_t + (head * groups + g) * q_h;
            for (int e = 0; e < dim; e++) qs[i * dim + e] = TO_T(src[e]);
            int64_t end = row->past + j + 1 < p1 ? row->past + j + 1 : p1;
            seen[i] = end > p0 ? end - p0 : 0;
        }
}

/* Point keys[p - p0] and values[p - p0] at the rows of positions p0 .. p1 - 1 of `layer` and `head`,
 * in whichever of the row's segments holds each. */
static void FN(point_rows)(const row_t *row, const segment_t *segs, int layer, int head, int64_t p0, int64_t p1,
                           const S **keys, const S **values) {
    for (int s = 0; s < row->segments; s++) {
        const segment_t *seg = segs + row->first_segment + s;
        int64_t a = seg->start > p0 ? seg->start : p0;
        int64_t b = seg->start + seg->width < p1 ? seg->start + seg->width : p1;
        const S *at = (const S *)seg->base + layer * seg->layer_stride + head * seg->head_stride;
        for (int64_t p = a; p < b; p++) {
            keys[p - p0] = at + (p - seg->start) * seg->pos_stride;
            values[p - p0] = keys[p - p0] + seg->kv_stride;
        }
    }
}

/* Each query's scores become exp(score - m) over the keys it sees and 0 over the others (a masked key
 * is left out, never set to -inf: -ffast-math assumes finite numbers); m and l = their sum. */
static void FN(exp_scores)(int nq, int64_t width, const int64_t *seen, T *scores, T *m, T *l) {
    for (int i = 0; i < nq; i++) {
        T *sc = scores + i * CHUNK, top = sc[0], sum = 0;
        int64_t w = seen[i];
        for (int64_t p = 1; p < w; p++) top = sc[p] > top ? sc[p] : top;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < w; p++) {
            T e = EXP(sc[p] - top);
            sc[p] = e, sum += e;
        }
        for (int64_t p = w; p < width; p++) sc[p] = 0;
        m[i] = w ? top : 0, l[i] = sum;
    }
}

/* One work item: row `row`, head `head`, key positions p0 .. p1 - 1. `state`: m[nq], l[nq], acc[nq][dim]. */
static void FN(attend_item)(const row_t *row, const segment_t *segs, int layer, int head, int groups, int dim,
                            const S *q, int64_t q_t, int64_t q_h, T scale, int64_t p0, int64_t p1, T *state,
                            T *scores, const S **keys, const S **values) {
    int nq = groups * row->queries;
    int64_t seen[MAXQ];
    T qs[MAXQ * MAXDIM];
    FN(load_queries)(row, head, groups, dim, q, q_t, q_h, p0, p1, qs, seen);
    FN(point_rows)(row, segs, layer, head, p0, p1, keys, values);
    FN(scores)(qs, nq, dim, keys, p1 - p0, scale, scores);
    FN(exp_scores)(nq, p1 - p0, seen, scores, state, state + nq);
    FN(values)(scores, nq, dim, values, p1 - p0, state + 2 * nq);
}

/* Store the rows' new keys and values (`k`, `v`: [T, heads_kv, dim] with strides) at their positions in
 * their own buffers. */
static void FN(store_new)(int rows, const row_t *row, const segment_t *segs, int layer, int heads_kv, int dim,
                          const S *k, int64_t k_t, int64_t k_h, const S *v, int64_t v_t, int64_t v_h) {
    for (int r = 0; r < rows; r++) {
        const segment_t *own = OWN(segs, row + r);
        for (int j = 0; j < row[r].queries; j++)
            for (int h = 0; h < heads_kv; h++) {
                S *dst = (S *)own->base + layer * own->layer_stride + h * own->head_stride +
                         (row[r].past + j - own->start) * own->pos_stride;
                int64_t at = row[r].first_query + j;
                memcpy(dst, k + at * k_t + h * k_h, sizeof(S) * dim);
                memcpy(dst + own->kv_stride, v + at * v_t + h * v_h, sizeof(S) * dim);
            }
    }
}

/* This thread's share of the work items (item `it` of row r is head (it - first[r]) / chunks, chunk
 * (it - first[r]) % chunks). Call from every thread of a parallel region: its `omp for` binds to it. */
static void FN(run_items)(int rows, const row_t *row, const segment_t *segs, const int64_t *first, int layer,
                          int heads_kv, int groups, int dim, const S *q, int64_t q_t, int64_t q_h, T scale,
                          T *state, int64_t stride, int *failed) {
    T *scores = scratch_bytes(0, sizeof(T) * MAXQ * CHUNK);
    const S **ptrs = scratch_bytes(1, sizeof(S *) * 2 * CHUNK);
    int64_t items = first[rows];
    int r = 0;
    if (!scores || !ptrs) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        if (*failed) continue;
        while (first[r + 1] <= it) r++;
        while (first[r] > it) r--;
        int64_t chunks = (first[r + 1] - first[r]) / heads_kv, local = it - first[r];
        int64_t c = local % chunks, keys = row[r].past + row[r].queries;
        int64_t p0 = c * CHUNK, p1 = p0 + CHUNK < keys ? p0 + CHUNK : keys;
        FN(attend_item)(row + r, segs, layer, (int)(local / chunks), groups, dim, q, q_t, q_h, scale, p0, p1,
                        state + it * stride, scores, ptrs, ptrs + CHUNK);
    }
}

/* Query i's output from its chunks' states (`base`, one every `stride`): the flash-decoding merge,
 * sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c, into `dst`. */
static void FN(merge_query)(const T *base, int64_t chunks, int64_t stride, int nq, int i, int dim, S *dst) {
    T top = 0, total = 0, o[MAXDIM];
    int any = 0;
    for (int64_t c = 0; c < chunks; c++) {
        const T *st = base + c * stride;
        if (st[nq + i] > 0 && (!any || st[i] > top)) top = st[i], any = 1;
    }
    memset(o, 0, sizeof(T) * dim);
    for (int64_t c = 0; c < chunks; c++) {
        const T *st = base + c * stride, *a = st + 2 * nq + i * dim;
        if (!(st[nq + i] > 0)) continue; /* a chunk this query sees none of */
        T f = EXP(st[i] - top);
        total += f * st[nq + i];
        for (int e = 0; e < dim; e++) o[e] += f * a[e];
    }
    for (int e = 0; e < dim; e++) dst[e] = TO_S(o[e] / total);
}

/* This thread's share of the merges, one (row, head) at a time; called as `run_items` is. */
static void FN(merge_items)(int rows, const row_t *row, const int64_t *first, int heads_kv, int groups, int dim,
                            const T *state, int64_t stride, S *out, int64_t o_t, int64_t o_h, const int *failed) {
#pragma omp for collapse(2)
    for (int rr = 0; rr < rows; rr++)
        for (int h = 0; h < heads_kv; h++) {
            if (*failed) continue;
            int n = row[rr].queries, nq = groups * n;
            int64_t chunks = (first[rr + 1] - first[rr]) / heads_kv;
            const T *base = state + (first[rr] + h * chunks) * stride;
            for (int i = 0; i < nq; i++)
                FN(merge_query)(base, chunks, stride, nq, i, dim,
                                out + (row[rr].first_query + i % n) * o_t + (h * groups + i / n) * o_h);
        }
}

/* The entry point (see the top of attend.c): a `specdec_status`. `segs`: `nsegs` segments; q, out (and
 * k, v: the new keys and values to store, or null) hold `tokens` rows. */
int FN(specdec_attend)(int rows, const row_t *row, int nsegs, const segment_t *segs, int layer, int heads_kv,
                       int groups, int dim, int64_t tokens, const rows_t *q, const rows_t *k, const rows_t *v,
                       const rows_t *out, double scale, int threads) {
    int status = check_call(rows, row, nsegs, segs, layer, heads_kv, groups, dim, tokens, q, k, v, out, sizeof(S));
    if (status != SPECDEC_OK) return status;
    int storing = k && k->base;
    int64_t *first = scratch_bytes(2, sizeof(int64_t) * (rows + 1)); /* first item of each row */
    if (!first) return SPECDEC_NO_MEMORY;
    int64_t stride = (int64_t)(2 + dim) * plan_items(rows, row, heads_kv, groups, first);
    T *state = scratch_bytes(3, sizeof(T) * stride * first[rows]);
    if (storing && state)
        FN(store_new)(rows, row, segs, layer, heads_kv, dim, (const S *)k->base, k->t_stride, k->h_stride,
                      (const S *)v->base, v->t_stride, v->h_stride);
    int failed = !state;
    const S *qs = (const S *)q->base;
#pragma omp parallel if (!failed) num_threads(threads)
    {
        FN(run_items)(rows, row, segs, first, layer, heads_kv, groups, dim, qs, q->t_stride, q->h_stride, (T)scale,
                      state, stride, &failed);
        FN(merge_items)(rows, row, first, heads_kv, groups, dim, state, stride, (S *)out->base, out->t_stride,
                        out->h_stride, &failed);
    }
    return failed ? SPECDEC_NO_MEMORY : SPECDEC_OK;
}

#undef FN
#undef ATTEND_CAT
#undef ATTEND_CAT_
#undef S
#undef T
#undef KIND
#undef EXP
#undef TO_T
#undef TO_S
