/* The machine's float32 multiply-add rate: each OpenMP thread runs 12 independent chains of
 * vector FMAs (enough to keep every FMA unit busy whatever its latency), nothing read from
 * memory. Prints GFLOP/s (2 per multiply-add), the best of 5 runs. Built by bench/engine.py with
 * `cc -O2 -march=native -fopenmp`; the vector width is the widest -march=native allows. */
#include <omp.h>
#include <stdio.h>
#include <time.h>

#if defined(__AVX512F__)
#define WIDTH 16
#elif defined(__AVX2__)
#define WIDTH 8
#else
#define WIDTH 4
#endif
typedef float vec __attribute__((vector_size(WIDTH * 4)));
#define CHAINS 12

static float sink[256];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    const long steps = 20000000;
    double best = 0;
    for (int run = 0; run < 5; run++) {
        double start = now();
#pragma omp parallel
        {
            vec a[CHAINS], x, y;
            for (int i = 0; i < WIDTH; i++) x[i] = 0.999999f, y[i] = 1e-7f;
            for (int c = 0; c < CHAINS; c++)
                for (int i = 0; i < WIDTH; i++) a[c][i] = 1.0f + 0.1f * c + i;
            for (long s = 0; s < steps; s++) {
#pragma GCC unroll 12
                for (int c = 0; c < CHAINS; c++) a[c] = a[c] * x + y; /* contracted to one FMA */
            }
            float total = 0;
            for (int c = 0; c < CHAINS; c++)
                for (int i = 0; i < WIDTH; i++) total += a[c][i];
            sink[omp_get_thread_num() % 256] += total;
        }
        double rate = (double)omp_get_max_threads() * steps * CHAINS * WIDTH * 2 / (now() - start) / 1e9;
        if (rate > best) best = rate;
    }
    printf("%.1f %g\n", best, sink[0]);
    return 0;
}
