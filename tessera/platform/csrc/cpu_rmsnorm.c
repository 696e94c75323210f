/* RMSNorm in float32 with the residual add fused: one call where torch's CPU path runs about ten operators
 * (add, pow, sum, div, add, rsqrt, mul, mul, casts), each a few microseconds at a decode step's few rows.
 *
 * x, residual (or NULL), w: [M, H], [M, H], [H]; h = x (+ residual), written to sum_out when residual is
 * given (the next layer's residual); out = w * (h * (1 / sqrt(mean(h^2) + eps))), transformers' order of the
 * multiplications. Built by tessera/platform/cpu_kernels.py.
 */
#include <math.h>

#include "cpu_vec.h"

void tessera_rmsnorm_f32(const float *x, const float *residual, float *sum_out, const float *w, float *out, long M,
                         long H, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M * H >= 65536)
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * H, *hr = xr;
        if (residual) {
            const float *rr = residual + m * H;
            float *sr = sum_out + m * H;
            long i = 0;
            for (; i + 8 <= H; i += 8) store8(sr + i, load8(xr + i) + load8(rr + i));
            for (; i < H; i++) sr[i] = xr[i] + rr[i];
            hr = sr;
        }
        v8 acc = {0};
        long i = 0;
        for (; i + 8 <= H; i += 8) {
            v8 h = load8(hr + i);
            acc += h * h;
        }
        float s = sum8(acc);
        for (; i < H; i++) s += hr[i] * hr[i];
        float r = 1.0f / sqrtf(s / (float)H + eps);
        v8 rv = {r, r, r, r, r, r, r, r};
        float *o = out + m * H;
        for (i = 0; i + 8 <= H; i += 8) store8(o + i, load8(w + i) * (load8(hr + i) * rv));
        for (; i < H; i++) o[i] = w[i] * (hr[i] * r);
    }
}
