/* SwiGLU's activation in float32: out = silu(gate) * up over x = [gate | up], one pass where torch runs a
 * chunk, silu and a product (two full passes over [tokens, d] and a temporary). silu(g) = g / (1 + exp(-g)),
 * exp from cpu_vec.h's exp8 (within 2 ulp of libm's; torch's own silu differs from it by as much).
 *
 * x [M, 2d] with row stride x_row (floats), out [M, d] contiguous. Built by cpu_kernels.py.
 */
#include <math.h>

#include "cpu_vec.h"

void tessera_silu_mul_f32(const float *x, long x_row, float *out, long M, long d, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (M * d >= 65536)
    for (long m = 0; m < M; m++) {
        const float *g = x + m * x_row, *u = g + d;
        float *o = out + m * d;
        long i = 0;
        for (; i + 8 <= d; i += 8) {
            v8 gv = load8(g + i);
            store8(o + i, gv / (splat8(1.0f) + exp8(-gv)) * load8(u + i));
        }
        for (; i < d; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
