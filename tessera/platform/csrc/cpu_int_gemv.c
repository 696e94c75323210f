/* y = x w^T (+ b) in float32 for few rows of x, w stored as 8- or 4-bit integers with float scales: the
 * decode step's projections of a weight-only quantized model (layers/quantization/int_linear.py).
 *
 * A weight [N, K] in groups of gs columns (G = K / gs per row) is dequantized in registers as
 * w = q * scale[n, g] - zs[n, g], where zs = (zero - offset) * scale folds the zero point in (one fused
 * multiply-subtract per eight weights); the packer chooses q's offset:
 *   int8: q is the AffineWeight's q - 128 as a signed byte, [N, K] row-major (a symmetric weight has zs 0);
 *   int4: row n, chunk c of 16 columns is 8 bytes, byte i = q[16c + i] | q[16c + 8 + i] << 4, [N, K / 2];
 *         gs and K are multiples of 16 (the packer sends other shapes elsewhere).
 * At a few rows the product is bound by reading w, so a byte per weight (int8) or half (int4) is the win
 * over float32; the work per weight is a widening load, a conversion and an FMA. Threads over blocks of
 * 4 weight rows (torch's OpenMP pool): one row of x runs row1 over whole weight rows (groups of a multiple
 * of 16 columns; others `tile`), two or more the dequantized strips, edge blocks `tile`. Without AVX2 the
 * same code runs on GCC/Clang vector extensions.
 * tessera_int_dequant_f32 writes the float weight [N, K] (the many-row products run it through torch's
 * matmul). Built by tessera/platform/cpu_kernels.py.
 */
#include <stdint.h>

#include "cpu_vec.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TESSERA_INT_AVX2 1
#endif

/* Eight int8 weights as floats (q itself, not yet scaled). */
static inline v8 cvt8_i8(const int8_t *q) {
#ifdef TESSERA_INT_AVX2
    return (v8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
#else
    v8i b = {q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]};
    return __builtin_convertvector(b, v8);
#endif
}

/* Sixteen int4 weights (one chunk, eight bytes) as floats: columns 0..7 in lo, 8..15 in hi. */
static inline void cvt16_i4(const uint8_t *p, v8 *lo, v8 *hi) {
#ifdef TESSERA_INT_AVX2
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *hi = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
    v8i b = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    *lo = __builtin_convertvector(b & 15, v8);
    *hi = __builtin_convertvector(b >> 4, v8);
#endif
}

static inline v8 fmsub8(v8 a, v8 b, v8 c) {
#ifdef TESSERA_INT_AVX2
    return (v8)_mm256_fmsub_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b - c;
#endif
}

/* Eight int8 weights dequantized. */
static inline v8 deq8_i8(const int8_t *q, v8 s, v8 zs) { return fmsub8(cvt8_i8(q), s, zs); }

/* Sixteen int4 weights dequantized. */
static inline void deq16_i4(const uint8_t *p, v8 s, v8 zs, v8 *lo, v8 *hi) {
    cvt16_i4(p, lo, hi);
    *lo = fmsub8(*lo, s, zs);
    *hi = fmsub8(*hi, s, zs);
}

/* Rows n0 .. n0+R-1 of w against rows m0 .. m0+C-1 of x, R <= 4, C <= 2; inlined with constant R, C and
 * bits so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, const uint8_t *q, const float *sc,
                                                      const float *zs, float *y, long N, long K, long gs,
                                                      long n0, long m0, int R, int C, int bits) {
    long G = K / gs, row_bytes = bits == 8 ? K : K / 2;
    v8 acc[4][2] = {{{0}}};
    float tail[4][2] = {{0}};
    for (long g = 0; g < G; g++) {
        v8 s[4], z[4];
        for (int r = 0; r < R; r++) {
            s[r] = splat8(sc[(n0 + r) * G + g]);
            z[r] = splat8(zs[(n0 + r) * G + g]);
        }
        long k = g * gs, end = k + gs;
        if (bits == 8) {
            for (; k + 8 <= end; k += 8) {
                v8 xv[2];
                for (int c = 0; c < C; c++) xv[c] = load8(x + (m0 + c) * K + k);
                for (int r = 0; r < R; r++) {
                    v8 w = deq8_i8((const int8_t *)q + (n0 + r) * row_bytes + k, s[r], z[r]);
                    for (int c = 0; c < C; c++) acc[r][c] += w * xv[c];
                }
            }
            for (; k < end; k++) /* a group (or row) whose length is not a multiple of 8 */
                for (int r = 0; r < R; r++) {
                    float w = (float)((const int8_t *)q)[(n0 + r) * row_bytes + k] * s[r][0] - z[r][0];
                    for (int c = 0; c < C; c++) tail[r][c] += w * x[(m0 + c) * K + k];
                }
        } else {
            for (; k < end; k += 16) {
                v8 xl[2], xh[2];
                for (int c = 0; c < C; c++) {
                    xl[c] = load8(x + (m0 + c) * K + k);
                    xh[c] = load8(x + (m0 + c) * K + k + 8);
                }
                for (int r = 0; r < R; r++) {
                    v8 lo, hi;
                    deq16_i4(q + (n0 + r) * row_bytes + k / 2, s[r], z[r], &lo, &hi);
                    for (int c = 0; c < C; c++) acc[r][c] += lo * xl[c] + hi * xh[c];
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(m0 + c) * N + n0 + r] = sum8(acc[r][c]) + tail[r][c];
}

/* Columns [k0, k1) of one row of w (q at the row's bytes, sc / zs at its groups) dequantized into out[k0:k1]
 * (for int4, k0 and k1 are multiples of 16). */
static inline __attribute__((always_inline)) void dequant_row(const uint8_t *qr, const float *sc, const float *zs,
                                                             float *out, long k0, long k1, long gs, int bits) {
    for (long g = k0 / gs; g * gs < k1; g++) {
        v8 s = splat8(sc[g]), z = splat8(zs[g]);
        long k = g * gs > k0 ? g * gs : k0, end = g * gs + gs < k1 ? g * gs + gs : k1;
        if (bits == 8) {
            for (; k + 8 <= end; k += 8) store8(out + k, deq8_i8((const int8_t *)qr + k, s, z));
            for (; k < end; k++) out[k] = (float)((const int8_t *)qr)[k] * sc[g] - zs[g];
        } else {
            for (; k < end; k += 16) {
                v8 lo, hi;
                deq16_i4(qr + k / 2, s, z, &lo, &hi);
                store8(out + k, lo);
                store8(out + k + 8, hi);
            }
        }
    }
}

/* Columns [k0, k1) of w's rows n0 .. n0+3 dequantized into buf [4, k1 - k0]. */
static inline __attribute__((always_inline)) void dequant_strip(const uint8_t *q, const float *sc,
                                                               const float *zs, float *buf, long K, long gs,
                                                               long n0, long k0, long k1, int bits) {
    long G = K / gs, row_bytes = bits == 8 ? K : K / 2, width = k1 - k0;
    for (int r = 0; r < 4; r++)
        dequant_row(q + (n0 + r) * row_bytes, sc + (n0 + r) * G, zs + (n0 + r) * G, buf + r * width - k0, k0, k1,
                    gs, bits);
}

/* y[m0 .. m0+C-1, n0 .. n0+3] += x[.., k0:k1] buf^T for a dequantized strip buf [4, k1 - k0]. */
static inline __attribute__((always_inline)) void strip_tile(const float *x, const float *buf, float *y, long N,
                                                            long K, long n0, long m0, long k0, long k1, int C) {
    long width = k1 - k0, k = 0;
    v8 acc[4][2] = {{{0}}};
    for (; k + 8 <= width; k += 8) {
        v8 xv[2];
        for (int c = 0; c < C; c++) xv[c] = load8(x + (m0 + c) * K + k0 + k);
        for (int r = 0; r < 4; r++) {
            v8 wv = load8(buf + r * width + k);
            for (int c = 0; c < C; c++) acc[r][c] += wv * xv[c];
        }
    }
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < C; c++) {
            float s = sum8(acc[r][c]);
            for (long t = k; t < width; t++) s += buf[r * width + t] * x[(m0 + c) * K + k0 + t];
            y[(m0 + c) * N + n0 + r] += s;
        }
}

/* One row of x (a batch-1 decode) against weight row n, read start to end: per group the sum of q x in two
 * accumulators, scaled at the group's end; the zero points' share, sum over groups of zs * sum(x in group),
 * comes from xsum (computed once per call). A thread's rows are adjacent, so it reads one sequential stream:
 * over bench-medium's weights int8 went from 8.4 to 11.1 GB/s against the earlier four interleaved rows (int4 is
 * bound by its unpacking either way: 5.2-6.9 GB/s). */
static inline __attribute__((always_inline)) float row1(const float *x, const float *xsum, const uint8_t *q,
                                                       const float *sc, const float *zs, long K, long gs, long n,
                                                       int bits) {
    long G = K / gs, row_bytes = bits == 8 ? K : K / 2;
    const uint8_t *qr = q + n * row_bytes;
    const float *s = sc + n * G, *z = zs + n * G;
    v8 acc = {0};
    float zsum = 0.0f;
    for (long g = 0; g < G; g++) {
        v8 p0 = {0}, p1 = {0};
        long k = g * gs, end = k + gs;
        if (bits == 8) {
            for (; k + 16 <= end; k += 16) {
                p0 += cvt8_i8((const int8_t *)qr + k) * load8(x + k);
                p1 += cvt8_i8((const int8_t *)qr + k + 8) * load8(x + k + 8);
            }
            for (; k < end; k += 8) p0 += cvt8_i8((const int8_t *)qr + k) * load8(x + k);
        } else {
            for (; k < end; k += 16) {
                v8 lo, hi;
                cvt16_i4(qr + k / 2, &lo, &hi);
                p0 += lo * load8(x + k);
                p1 += hi * load8(x + k + 8);
            }
        }
        acc += (p0 + p1) * splat8(s[g]);
        zsum += xsum[g] * z[g];
    }
    return sum8(acc) - zsum;
}

/* Sums of x over each group of gs columns, for row1. */
static void group_sums(const float *x, long K, long gs, float *out) {
    for (long g = 0; g < K / gs; g++) {
        v8 a = {0};
        long k = g * gs;
        for (; k + 8 <= g * gs + gs; k += 8) a += load8(x + k);
        float t = sum8(a);
        for (; k < g * gs + gs; k++) t += x[k];
        out[g] = t;
    }
}

/* From two rows of x a full block of 4 weight rows is dequantized once per strip of columns (in L1) and
 * multiplied into every row, rather than decoded again for each pair of rows. */
#define STRIP 512

static inline __attribute__((always_inline)) void gemv(const float *x, const uint8_t *q, const float *sc,
                                                      const float *zs, const float *b, float *y, long M,
                                                      long N, long K, long gs, int threads, int bits) {
    if (M == 1 && gs % 16 == 0 && K / gs <= 4096) {
        float xsum[4096];
        group_sums(x, K, gs, xsum);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++) y[n] = row1(x, xsum, q, sc, zs, K, gs, n, bits) + (b ? b[n] : 0.0f);
        return;
    }
    long blocks = (N + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long blk = 0; blk < blocks; blk++) {
        long n0 = blk * 4, rows = N - n0 < 4 ? N - n0 : 4, m = 0;
        if (M >= 2 && rows == 4) {
            float buf[4 * STRIP];
            for (m = 0; m < M; m++)
                for (int r = 0; r < 4; r++) y[m * N + n0 + r] = 0.0f;
            for (long k0 = 0; k0 < K; k0 += STRIP) {
                long k1 = k0 + STRIP < K ? k0 + STRIP : K;
                dequant_strip(q, sc, zs, buf, K, gs, n0, k0, k1, bits);
                for (m = 0; m + 2 <= M; m += 2) strip_tile(x, buf, y, N, K, n0, m, k0, k1, 2);
                if (m < M) strip_tile(x, buf, y, N, K, n0, m, k0, k1, 1);
            }
            m = M;
        }
        for (; m + 2 <= M; m += 2) {
            if (rows == 4)
                tile(x, q, sc, zs, y, N, K, gs, n0, m, 4, 2, bits);
            else
                for (long r = 0; r < rows; r++) tile(x, q, sc, zs, y, N, K, gs, n0 + r, m, 1, 2, bits);
        }
        if (m < M) {
            if (rows == 4)
                tile(x, q, sc, zs, y, N, K, gs, n0, m, 4, 1, bits);
            else
                for (long r = 0; r < rows; r++) tile(x, q, sc, zs, y, N, K, gs, n0 + r, m, 1, 1, bits);
        }
        if (b)
            for (m = 0; m < M; m++)
                for (long r = 0; r < rows; r++) y[m * N + n0 + r] += b[n0 + r];
    }
}

void tessera_int8_gemv_f32(const float *x, const uint8_t *q, const float *sc, const float *zs, const float *b,
                           float *y, long M, long N, long K, long gs, int threads) {
    gemv(x, q, sc, zs, b, y, M, N, K, gs, threads, 8);
}

void tessera_int4_gemv_f32(const float *x, const uint8_t *q, const float *sc, const float *zs, const float *b,
                           float *y, long M, long N, long K, long gs, int threads) {
    gemv(x, q, sc, zs, b, y, M, N, K, gs, threads, 4);
}

/* The float32 weight [N, K] (w = q * scale - zs), rows over the threads. */
void tessera_int_dequant_f32(const uint8_t *q, const float *sc, const float *zs, float *w, long N, long K,
                             long gs, int bits, int threads) {
    long G = K / gs, row_bytes = bits == 8 ? K : K / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) dequant_row(q + n * row_bytes, sc + n * G, zs + n * G, w + n * K, 0, K, gs, bits);
}
