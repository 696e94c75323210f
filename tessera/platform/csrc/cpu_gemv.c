/* y = x w^T (+ b) in float32 for few rows of x: the decode step's projections on a CPU.
 *
 * x [M, K], w [N, K] (a Linear's weight, row-major), b [N] or NULL, y [M, N]. At a few rows the product is
 * bound by reading w once from memory; MKL ran it on one core and oneDNN reached ~18 GB/s of this machine's
 * ~28 GB/s read bandwidth. Here each OpenMP thread (torch's own pool: the library links the libgomp torch
 * has loaded) streams its share of w's rows once, in tiles of 4 weight rows x TILE_C rows of x, VL lanes per
 * accumulator (cpu_vec.h: AVX-512, AVX, NEON, whatever -march=native offers). From a few rows up the tile's
 * arithmetic is the bound, so AVX-512's 32 registers take 4 x 4 tiles (16 sums, 8 loads per 16 multiply-adds)
 * where AVX2's 16 take 4 x 2. The tile's loaded vectors are pinned to registers (cpu_vec.h loadv_pinned): otherwise
 * GCC re-reads x from memory in every multiply-add and the loop is bound by loads.
 * Built by tessera/platform/cpu_kernels.py.
 */
#include "cpu_vec.h"

static inline __attribute__((always_inline)) vf load_prefetched(const float *p) {
    PREFETCH_AHEAD(p);
    return loadv_pinned(p);
}

/* Rows n0 .. n0+R-1 of w against rows m0 .. m0+C-1 of x, R <= 4, C <= TILE_C; inlined with constant R and C
 * so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *y, long N, long K,
                                                      long n0, long m0, int R, int C) {
    vf acc[4][TILE_C] = {{{0}}};
    long k = 0;
    TILE_VECTOR_LOOP(acc, k, K, R, C, c, x + (m0 + c) * K + k, r, load_prefetched(w + (n0 + r) * K + k));
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = sumv(acc[r][c]);
            for (long t = k; t < K; t++) s += w[(n0 + r) * K + t] * x[(m0 + c) * K + t];
            y[(m0 + c) * N + n0 + r] = s;
        }
}

/* Every row of x against weight rows n0 .. n0+R-1 (R constant: 4, or 1 at the edge). */
static inline __attribute__((always_inline)) void rows_of_x(const float *x, const float *w, float *y, long M,
                                                           long N, long K, long n0, int R) {
    long m = 0;
    for (; m + TILE_C <= M; m += TILE_C) tile(x, w, y, N, K, n0, m, R, TILE_C);
    switch (M - m) { /* a constant C for each remainder (below TILE_C: the min only keeps dead cases in bounds) */
    case 3: tile(x, w, y, N, K, n0, m, R, TILE_MIN(3)); break;
    case 2: tile(x, w, y, N, K, n0, m, R, TILE_MIN(2)); break;
    case 1: tile(x, w, y, N, K, n0, m, R, 1); break;
    }
}

/* One row of x (a batch-1 decode) against one weight row, read start to end with four accumulators: each thread
 * then reads one sequential stream instead of the tile's four interleaved rows. bench-medium's 48 projections,
 * twelve alternations in one process: 9.2-9.8 against 10.3-12.4 ms (docs/benchmarks.md; cpu_gemv16.c and the
 * int8 kernel found the same). */
static inline float row1(const float *x, const float *wr, long K) {
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long k = 0;
    for (; k + 4 * VL <= K; k += 4 * VL) {
        PREFETCH_AHEAD(wr + k);
        PREFETCH_AHEAD(wr + k + VL);
        PREFETCH_AHEAD(wr + k + 2 * VL);
        PREFETCH_AHEAD(wr + k + 3 * VL);
        a0 += loadv(wr + k) * loadv(x + k);
        a1 += loadv(wr + k + VL) * loadv(x + k + VL);
        a2 += loadv(wr + k + 2 * VL) * loadv(x + k + 2 * VL);
        a3 += loadv(wr + k + 3 * VL) * loadv(x + k + 3 * VL);
    }
    for (; k + VL <= K; k += VL) a0 += loadv(wr + k) * loadv(x + k);
    float s = sumv((a0 + a1) + (a2 + a3));
    for (; k < K; k++) s += wr[k] * x[k];
    return s;
}

void tessera_gemv_f32(const float *x, const float *w, const float *b, float *y, long M, long N, long K,
                      int threads) {
    if (M == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++) y[n] = row1(x, w + n * K, K) + (b ? b[n] : 0.0f);
        return;
    }
    long blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long blk = 0; blk < blocks; blk++) {
        long n0 = blk * 4, rows = N - n0 < 4 ? N - n0 : 4;
        if (rows == 4)
            rows_of_x(x, w, y, M, N, K, n0, 4);
        else
            for (long r = 0; r < rows; r++) rows_of_x(x, w, y, M, N, K, n0 + r, 1);
        if (b)
            for (long m = 0; m < M; m++)
                for (long r = 0; r < rows; r++) y[m * N + n0 + r] += b[n0 + r];
    }
}
