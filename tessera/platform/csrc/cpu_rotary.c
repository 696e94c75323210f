/* Rotary embedding (rotate-half convention) in float32: the decoder layers' q and k before attention.
 *
 * torch's form takes ~8 operators per call (two chunks, four products, a difference, a sum, a concatenation),
 * each over the whole [tokens, heads, head_dim] tensor; a decode step is bound by such small ops (demo-vl,
 * batch 64: ~0.7 ms of a ~15 ms step over 4 layers). Here: one pass, out = [x1 c - x2 s, x2 c + x1 s].
 *
 * x [T, H, D] with row stride x_row and head stride x_head (floats; the last dim contiguous: q and k are column
 * slices of the fused qkv projection), cos, sin [T, D / 2] with row stride cs_row, out [T, H, D] contiguous.
 * Built by cpu_kernels.py.
 */
#include "cpu_vec.h"

/* Products rounded before the sum, as transformers' (x * cos) + (rotate_half(x) * sin): no fused multiply-add,
 * so the result is bit-identical to it. */
#ifdef __clang__
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

void tessera_rotary_f32(const float *x, long x_row, long x_head, const float *cos, const float *sin, long cs_row,
                        float *out, long T, long H, long D, int threads) {
    long half = D / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (T * H * D >= 65536)
    for (long t = 0; t < T; t++) {
        const float *c = cos + t * cs_row, *s = sin + t * cs_row;
        for (long h = 0; h < H; h++) {
            const float *x1 = x + t * x_row + h * x_head, *x2 = x1 + half;
            float *o1 = out + (t * H + h) * D, *o2 = o1 + half;
            long i = 0;
            for (; i + 8 <= half; i += 8) {
                v8 a = load8(x1 + i), b = load8(x2 + i), cv = load8(c + i), sv = load8(s + i);
                store8(o1 + i, a * cv - b * sv);
                store8(o2 + i, b * cv + a * sv);
            }
            for (; i < half; i++) {
                o1[i] = x1[i] * c[i] - x2[i] * s[i];
                o2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        }
    }
}
