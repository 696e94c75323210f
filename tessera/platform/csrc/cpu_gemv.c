/* y = x w^T (+ b) in float32 for few rows of x: the decode step's projections on a CPU.
 *
 * x [M, K], w [N, K] (a Linear's weight, row-major), b [N] or NULL, y [M, N]. At a few rows the product is
 * bound by reading w once from memory; MKL ran it on one core and oneDNN reached ~18 GB/s of this machine's
 * ~28 GB/s read bandwidth. Here each OpenMP thread (torch's own pool: the library links the libgomp torch
 * has loaded) streams its share of w's rows once, in tiles of 4 rows x 2 rows of x, eight lanes per
 * accumulator (GCC/Clang vector extensions: AVX on x86, NEON on Arm, whatever -march=native offers).
 * Built by tessera/platform/cpu_kernels.py.
 */
#include "cpu_vec.h"

/* Rows n0 .. n0+R-1 of w against rows m0 .. m0+C-1 of x, R <= 4, C <= 2; inlined with constant R and C
 * so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *y, long N, long K,
                                                      long n0, long m0, int R, int C) {
    v8 acc[4][2] = {{{0}}};
    long k = 0;
    for (; k + 8 <= K; k += 8) {
        v8 xv[2];
        for (int c = 0; c < C; c++) xv[c] = load8(x + (m0 + c) * K + k);
        for (int r = 0; r < R; r++) {
            v8 wv = load8(w + (n0 + r) * K + k);
            for (int c = 0; c < C; c++) acc[r][c] += wv * xv[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = sum8(acc[r][c]);
            for (long t = k; t < K; t++) s += w[(n0 + r) * K + t] * x[(m0 + c) * K + t];
            y[(m0 + c) * N + n0 + r] = s;
        }
}

void tessera_gemv_f32(const float *x, const float *w, const float *b, float *y, long M, long N, long K,
                      int threads) {
    long blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long blk = 0; blk < blocks; blk++) {
        long n0 = blk * 4, rows = N - n0 < 4 ? N - n0 : 4, m = 0;
        for (; m + 2 <= M; m += 2) {
            if (rows == 4)
                tile(x, w, y, N, K, n0, m, 4, 2);
            else
                for (long r = 0; r < rows; r++) tile(x, w, y, N, K, n0 + r, m, 1, 2);
        }
        if (m < M) {
            if (rows == 4)
                tile(x, w, y, N, K, n0, m, 4, 1);
            else
                for (long r = 0; r < rows; r++) tile(x, w, y, N, K, n0 + r, m, 1, 1);
        }
        if (b)
            for (m = 0; m < M; m++)
                for (long r = 0; r < rows; r++) y[m * N + n0 + r] += b[n0 + r];
    }
}
