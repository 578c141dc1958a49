/* The decode step's 121 quantized projections of the packaged model's shapes (SmolLM2-135M: 30
 * layers of q4_1 q/k/v, o, gate/up and down, fused as the engine fuses them, and the tied q8_0
 * output layer), called back to back from C as the layer stack calls them: the block kernels'
 * own time at m rows, without Python around them. Synthetic weights (the kernels' time does not
 * depend on the values), fresh buffers per matrix (96.6 MB in all). Prints the median and the
 * minimum of `steps` steps.
 *
 *   cc -O3 -ffast-math -fopenmp -march=native -mtune=generic -Ispecdec/runtime/csrc \
 *       bench/quant_step.c specdec/runtime/csrc/quant.c -o /tmp/quant_step
 *   /tmp/quant_step ROWS THREADS STEPS          # e.g. 1 2 40
 *
 * A/B against another tree's kernels: `git show REV:specdec/runtime/csrc/quant.c > /tmp/quant_old.c`
 * (with that tree's headers in -I), build a second binary from it, and run the two in turn. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels.h"

#define SYM8 2
#define ASYM4 1

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* An n x k weight of blocks of 32 (ASYM4: q4_1, SYM8: q8_0), its scales finite (d = 2^-15 x 2, m < 0). */
static specdec_qweight make(int kind, int n, int k) {
    int block = kind == ASYM4 ? 20 : 34;
    int64_t w_t = k / 32 * block;
    uint8_t *w = aligned_alloc(64, (n * w_t + 63) / 64 * 64);
    for (int64_t i = 0; i < n * w_t; i++) w[i] = (uint8_t)(i * 37 + 11);
    for (int64_t b = 0; b < n * w_t; b += block) {
        uint16_t d = 0x2000, m = 0xa000;
        memcpy(w + b, &d, 2);
        if (kind == ASYM4) memcpy(w + b + 2, &m, 2);
    }
    return (specdec_qweight){kind, 32, n, 0, w_t, 0, w};
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    int m = argc > 1 ? atoi(argv[1]) : 1, threads = argc > 2 ? atoi(argv[2]) : 2, steps = argc > 3 ? atoi(argv[3]) : 40;
    if (m < 1 || m > 48 || threads < 1 || steps < 1 || steps > 1000) {
        fprintf(stderr, "usage: %s ROWS(1-48) THREADS STEPS(1-1000)\n", argv[0]);
        return 2;
    }
    specdec_qweight layer[30][7], head = make(SYM8, 49152, 576);
    for (int l = 0; l < 30; l++) {
        int shapes[7][2] = {{576, 576}, {192, 576}, {192, 576}, {576, 576}, {1536, 576}, {1536, 576}, {576, 1536}};
        for (int i = 0; i < 7; i++) layer[l][i] = make(ASYM4, shapes[i][0], shapes[i][1]);
        layer[l][1].column = 576, layer[l][2].column = 768, layer[l][5].column = 1536; /* fused: q|k|v, gate|up */
    }
    float *x = aligned_alloc(64, sizeof(float) * 1536 * m), *y = aligned_alloc(64, sizeof(float) * 49152 * m);
    for (int i = 0; i < 1536 * m; i++) x[i] = (i % 13) * 0.01f;
    double times[1000];
    for (int s = -3; s < steps; s++) { /* 3 steps of warm-up */
        double start = now();
        for (int l = 0; l < 30; l++) {
            specdec_qlinear_many_f32(3, &layer[l][0], m, 576, x, 1536, y, 960, threads);
            specdec_qlinear_many_f32(1, &layer[l][3], m, 576, x, 1536, y, 576, threads);
            specdec_qlinear_many_f32(2, &layer[l][4], m, 576, x, 1536, y, 3072, threads);
            specdec_qlinear_many_f32(1, &layer[l][6], m, 1536, x, 1536, y, 576, threads);
        }
        specdec_qlinear_many_f32(1, &head, m, 576, x, 1536, y, 49152, threads);
        if (s >= 0) times[s] = now() - start;
    }
    qsort(times, steps, sizeof(double), by_value);
    printf("rows %d, threads %d: median %.3f ms, min %.3f ms\n", m, threads, times[steps / 2] * 1e3, times[0] * 1e3);
    return 0;
}
