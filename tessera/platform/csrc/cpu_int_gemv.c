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
 * tessera_int4_gemv_bf16x is the int4 product over x rounded to bfloat16 (torchao's int4 weights, which take bf16
 * activations, where bf16 products are on): with AVX512-BF16 it runs bf16 dot products (rows_dp).
 * tessera_int_dequant_f32 writes the float weight [N, K] (the many-row products run it through torch's
 * matmul); tessera_int_dequant_bf16 the same values rounded to bfloat16 (to nearest, ties to even), for
 * oneDNN's bf16 matmul where the CPU has bf16 dot products. Built by tessera/platform/cpu_kernels.py.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "cpu_vec.h"
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if VL == 8 && defined(__AVX2__) && defined(__FMA__)
#define TESSERA_INT_AVX2 1
#endif
#define I4_VECS (16 / VL) /* vectors per chunk of 16 int4 columns */

/* bfloat16 of a float (its top 16 bits, rounded) and back. */
static inline uint16_t bf16_bits(float f) { /* to nearest, ties to even */
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float bf16_value(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* VL int8 weights as floats (q itself, not yet scaled). */
static inline vf cvt_i8(const int8_t *q) {
#if VL == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
#elif defined(TESSERA_INT_AVX2)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
#else
    v8i b = {q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]};
    return __builtin_convertvector(b, v8);
#endif
}

/* Sixteen int4 weights (one chunk, eight bytes) as floats, columns in order over I4_VECS vectors. */
static inline void cvt16_i4(const uint8_t *p, vf out[I4_VECS]) {
#if VL == 16
    __m128i b = _mm_loadl_epi64((const __m128i *)p), m = _mm_set1_epi8(15);
    __m128i cols = _mm_unpacklo_epi64(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));
    out[0] = (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(cols));
#elif defined(TESSERA_INT_AVX2)
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    out[0] = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    out[1] = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
    v8i b = {p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
    out[0] = __builtin_convertvector(b & 15, v8);
    out[1] = __builtin_convertvector(b >> 4, v8);
#endif
}

#if VL == 16
/* Thirty-two int4 weights (two chunks, sixteen bytes) as floats with one widening: lo holds columns 0..7 and
 * 16..23, hi 8..15 and 24..31, which row1 multiplies with x in that order (permute_x). One widening shuffle per
 * 32 columns instead of two per 16 (cvt16_i4): the int4 batch-1 product is bound by these shuffles. */
static inline void cvt32_i4(const uint8_t *p, vf *lo, vf *hi) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *hi = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
}
#endif

/* x with the middle two of every 8 x 4 columns swapped: the column order of cvt32_i4's lo, hi. */
static void permute_x(const float *x, long K, float *out) {
    for (long k = 0; k < K; k += 32) {
        __builtin_memcpy(out + k, x + k, 8 * sizeof(float));
        __builtin_memcpy(out + k + 8, x + k + 16, 8 * sizeof(float));
        __builtin_memcpy(out + k + 16, x + k + 8, 8 * sizeof(float));
        __builtin_memcpy(out + k + 24, x + k + 24, 8 * sizeof(float));
    }
}

static inline vf fmsubv(vf a, vf b, vf c) {
#if defined(TESSERA_INT_AVX2)
    return (vf)_mm256_fmsub_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b - c; /* contracted to one fused instruction where the target has it (AVX-512 does) */
#endif
}

/* VL int8 weights dequantized. */
static inline vf deq_i8(const int8_t *q, vf s, vf zs) { return fmsubv(cvt_i8(q), s, zs); }

/* Sixteen int4 weights dequantized. */
static inline void deq16_i4(const uint8_t *p, vf s, vf zs, vf out[I4_VECS]) {
    cvt16_i4(p, out);
    for (int j = 0; j < I4_VECS; j++) out[j] = fmsubv(out[j], s, zs);
}

/* Rows n0 .. n0+R-1 of w against rows m0 .. m0+C-1 of x, R <= 4, C <= TILE_C; inlined with constant R, C and
 * bits so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, const uint8_t *q, const float *sc,
                                                      const float *zs, float *y, long N, long K, long gs,
                                                      long n0, long m0, int R, int C, int bits) {
    long G = K / gs, row_bytes = bits == 8 ? K : K / 2;
    vf acc[4][TILE_C] = {{{0}}};
    float tail[4][TILE_C] = {{0}};
    for (long g = 0; g < G; g++) {
        vf s[4], z[4];
        for (int r = 0; r < R; r++) {
            s[r] = splatv(sc[(n0 + r) * G + g]);
            z[r] = splatv(zs[(n0 + r) * G + g]);
        }
        long k = g * gs, end = k + gs;
        if (bits == 8) {
            TILE_VECTOR_LOOP(acc, k, end, R, C, c, x + (m0 + c) * K + k, r,
                             deq_i8((const int8_t *)q + (n0 + r) * row_bytes + k, s[r], z[r]));
            for (; k < end; k++) /* a group (or row) whose length is not a multiple of VL */
                for (int r = 0; r < R; r++) {
                    float w = (float)((const int8_t *)q)[(n0 + r) * row_bytes + k] * s[r][0] - z[r][0];
                    for (int c = 0; c < C; c++) tail[r][c] += w * x[(m0 + c) * K + k];
                }
        } else {
            for (; k < end; k += 16) {
                vf xv[TILE_C][I4_VECS];
                for (int c = 0; c < C; c++)
                    for (int j = 0; j < I4_VECS; j++) xv[c][j] = loadv(x + (m0 + c) * K + k + j * VL);
                for (int r = 0; r < R; r++) {
                    vf w[I4_VECS];
                    deq16_i4(q + (n0 + r) * row_bytes + k / 2, s[r], z[r], w);
                    for (int c = 0; c < C; c++)
                        for (int j = 0; j < I4_VECS; j++) acc[r][c] += w[j] * xv[c][j];
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) y[(m0 + c) * N + n0 + r] = sumv(acc[r][c]) + tail[r][c];
}

/* Columns [k0, k1) of one row of w (q at the row's bytes, sc / zs at its groups) dequantized into out[k0:k1]
 * (for int4, k0 and k1 are multiples of 16). */
static inline __attribute__((always_inline)) void dequant_row(const uint8_t *qr, const float *sc, const float *zs,
                                                             float *out, long k0, long k1, long gs, int bits) {
    for (long g = k0 / gs; g * gs < k1; g++) {
        vf s = splatv(sc[g]), z = splatv(zs[g]);
        long k = g * gs > k0 ? g * gs : k0, end = g * gs + gs < k1 ? g * gs + gs : k1;
        if (bits == 8) {
            for (; k + VL <= end; k += VL) {
                if (k % 64 == 0) PREFETCH_AHEAD(qr + k);
                storev(out + k, deq_i8((const int8_t *)qr + k, s, z));
            }
            for (; k < end; k++) out[k] = (float)((const int8_t *)qr)[k] * sc[g] - zs[g];
        } else {
            for (; k < end; k += 16) {
                if (k % 128 == 0) PREFETCH_AHEAD(qr + k / 2);
                vf w[I4_VECS];
                deq16_i4(qr + k / 2, s, z, w);
                for (int j = 0; j < I4_VECS; j++) storev(out + k + j * VL, w[j]);
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
    vf acc[4][TILE_C] = {{{0}}};
    TILE_VECTOR_LOOP(acc, k, width, 4, C, c, x + (m0 + c) * K + k0 + k, r, loadv_pinned(buf + r * width + k));
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < C; c++) {
            float s = sumv(acc[r][c]);
            for (long t = k; t < width; t++) s += buf[r * width + t] * x[(m0 + c) * K + k0 + t];
            y[(m0 + c) * N + n0 + r] += s;
        }
}

/* One row of x (a batch-1 decode) against weight row n, read start to end: per group the sum of q x in two
 * accumulators, scaled at the group's end; the zero points' share, sum over groups of zs * sum(x in group),
 * comes from xsum (computed once per call). A thread's rows are adjacent, so it reads one sequential stream:
 * over bench-medium's weights int8 went from 8.4 to 11.1 GB/s against the earlier four interleaved rows (int4 is
 * bound by its unpacking either way: 5.2-6.9 GB/s). */
static inline __attribute__((always_inline)) float row1(const float *x, const float *xp, const float *xsum,
                                                       const uint8_t *q,
                                                       const float *sc, const float *zs, long K, long gs, long n,
                                                       int bits) {
    long G = K / gs, row_bytes = bits == 8 ? K : K / 2;
    const uint8_t *qr = q + n * row_bytes;
    const float *s = sc + n * G, *z = zs + n * G;
    vf acc = {0};
    float zsum = 0.0f;
    for (long g = 0; g < G; g++) {
        vf p0 = {0}, p1 = {0};
        long k = g * gs, end = k + gs;
        if (bits == 8) {
            for (; k + 2 * VL <= end; k += 2 * VL) {
                if (k % 64 == 0) PREFETCH_AHEAD(qr + k); /* a 64-byte line per 64 weights */
                p0 += cvt_i8((const int8_t *)qr + k) * loadv(x + k);
                p1 += cvt_i8((const int8_t *)qr + k + VL) * loadv(x + k + VL);
            }
            for (; k < end; k += VL) p0 += cvt_i8((const int8_t *)qr + k) * loadv(x + k);
        } else {
#if VL == 16
            /* xp: x in cvt32_i4's order, where groups are whole 32-column blocks (else NULL) */
            for (; xp && k < end; k += 32) {
                vf lo, hi;
                cvt32_i4(qr + k / 2, &lo, &hi);
                p0 += lo * loadv(xp + k);
                p1 += hi * loadv(xp + k + 16);
            }
#endif
            for (; k < end; k += 16) { /* a chunk's halves take the two accumulators with 8 lanes */
                vf w[I4_VECS];
                cvt16_i4(qr + k / 2, w);
                p0 += w[0] * loadv(x + k);
                if (I4_VECS == 2) p1 += w[I4_VECS - 1] * loadv(x + k + 8);
            }
        }
        acc += (p0 + p1) * splatv(s[g]);
        zsum += xsum[g] * z[g];
    }
    return sumv(acc) - zsum;
}

/* Sums of x over each group of gs columns, for row1. */
static void group_sums(const float *x, long K, long gs, float *out) {
    for (long g = 0; g < K / gs; g++) {
        vf a = {0};
        long k = g * gs;
        for (; k + VL <= g * gs + gs; k += VL) a += loadv(x + k);
        float t = sumv(a);
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
        int widen32 = VL == 16 && bits == 4 && gs % 32 == 0 && K <= 16384; /* row1's cvt32_i4 path */
        float xsum[4096], xbuf[widen32 ? K : 1];
        const float *xp = NULL;
        group_sums(x, K, gs, xsum);
        if (widen32) {
            permute_x(x, K, xbuf);
            xp = xbuf;
        }
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++) y[n] = row1(x, xp, xsum, q, sc, zs, K, gs, n, bits) + (b ? b[n] : 0.0f);
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
                for (m = 0; m + TILE_C <= M; m += TILE_C) strip_tile(x, buf, y, N, K, n0, m, k0, k1, TILE_C);
                switch (M - m) { /* a constant C for each remainder (TILE_MIN keeps dead cases in bounds) */
                case 3: strip_tile(x, buf, y, N, K, n0, m, k0, k1, TILE_MIN(3)); break;
                case 2: strip_tile(x, buf, y, N, K, n0, m, k0, k1, TILE_MIN(2)); break;
                case 1: strip_tile(x, buf, y, N, K, n0, m, k0, k1, 1); break;
                }
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

#if VL == 16 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TESSERA_INT4_DPBF16 1
/* Rows of x against int4 weight rows with AVX512-BF16 dot products (x rounded to bfloat16): a 64-byte block
 * of 128 columns is 32 16-bit words whose nibble j, ORed into 0x4300, is the bfloat16 of 128 + q (exact: 7
 * mantissa bits), so a block is one load, three shifts, four ternary logic ops and four dot products, and no
 * shuffle (row1's widening shuffles bound it at about a third of the read rate). Lane l of nibble j holds
 * column 16 (l / 4) + 2 (l % 4) + {0, 8, 1, 9}[j] of the block (the packing's order; xb is x in that order).
 * The 128 offset and the zero points come off per group: sum w x = sum_g s_g sum(e x) - (128 s_g + zs_g) X_g,
 * X_g the sum of the rounded x over group g. A dot product's 32-bit lane i covers chunk i / 2 (16 columns),
 * so groups of 32 or 64 columns are lanes 4g.. or 8g.. of a block, scaled lane by lane. */

/* x [K] -> xb in the blocks' lane order, and xg[g] the sum of the rounded x over group g. Per block the 128
 * columns are rounded in 4 instructions (32 each, to nearest even) and each nibble's lanes gathered by two
 * word permutes: lane l < 16 reads column c < 64 of the block, lane l + 16 column c + 64 (c as above). */
/* Lane l of nibble j reads column (16 (l / 4) + 2 (l % 4) + {0, 8, 1, 9}[j]) % 64 of its half of the block. */
static const uint16_t DP_INDEX[4][32] = {
    {0, 2, 4, 6, 16, 18, 20, 22, 32, 34, 36, 38, 48, 50, 52, 54, 0, 2, 4, 6, 16, 18, 20, 22, 32, 34, 36, 38, 48, 50, 52, 54},
    {8, 10, 12, 14, 24, 26, 28, 30, 40, 42, 44, 46, 56, 58, 60, 62, 8, 10, 12, 14, 24, 26, 28, 30, 40, 42, 44, 46, 56, 58, 60, 62},
    {1, 3, 5, 7, 17, 19, 21, 23, 33, 35, 37, 39, 49, 51, 53, 55, 1, 3, 5, 7, 17, 19, 21, 23, 33, 35, 37, 39, 49, 51, 53, 55},
    {9, 11, 13, 15, 25, 27, 29, 31, 41, 43, 45, 47, 57, 59, 61, 63, 9, 11, 13, 15, 25, 27, 29, 31, 41, 43, 45, 47, 57, 59, 61, 63}};

static void dp_prepare(const float *x, long K, long gs, uint16_t *xb, float *xg) {
    const __m512i odd = _mm512_set1_epi32((int)0xFFFF0000u);
    for (long g = 0; g < K / gs; g++) xg[g] = 0.0f;
    for (long b = 0; b < K / 128; b++) {
        __m512i r[4];
        for (int i = 0; i < 4; i++) {
            const float *p = x + 128 * b + 32 * i;
            r[i] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
            /* the rounded values as floats: even words shifted up, odd words masked */
            __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(r[i], 16));
            __m512 oddv = _mm512_castsi512_ps(_mm512_and_si512(r[i], odd));
            xg[(128 * b + 32 * i) / gs] += _mm512_reduce_add_ps(_mm512_add_ps(even, oddv));
        }
        for (int j = 0; j < 4; j++) {
            __m512i ix = _mm512_loadu_si512((const void *)DP_INDEX[j]);
            __m512i lo = _mm512_permutex2var_epi16(r[0], ix, r[1]), hi = _mm512_permutex2var_epi16(r[2], ix, r[3]);
            _mm512_storeu_si512((void *)(xb + 128 * b + 32 * j), _mm512_mask_blend_epi16(0xFFFF0000u, lo, hi));
        }
    }
}

/* A block's four nibble vectors as bf16 of 128 + q. */
static inline __attribute__((always_inline)) void dp_decode(const uint8_t *p, __m512i e[4]) {
    const __m512i low = _mm512_set1_epi16(0x000F), one28 = _mm512_set1_epi16(0x4300);
    __m512i w = _mm512_loadu_si512((const void *)p);
    e[0] = _mm512_ternarylogic_epi32(w, low, one28, 0xEA); /* (w & 15) | 0x4300 */
    e[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), low, one28, 0xEA);
    e[2] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), low, one28, 0xEA);
    e[3] = _mm512_or_si512(_mm512_srli_epi16(w, 12), one28);
}

static inline __attribute__((always_inline)) __m512 dp_dot(const __m512i e[4], const uint16_t *xb, __m512 acc) {
    for (int j = 0; j < 4; j++)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)e[j], (__m512bh)_mm512_loadu_si512((const void *)(xb + 32 * j)));
    return acc;
}

/* Weight row n against C <= 4 rows of x (xb [C, K] in lane order, xg [C, G]): y[c * N + n], each block decoded
 * once for the C rows (more rows of x: the caller's groups of four re-read the row from L1). */
static inline __attribute__((always_inline)) void rows_dp(const uint16_t *xb, const float *xg, const uint8_t *q,
                                                         const float *sc, const float *zs, const float *bias,
                                                         float *y, long N, long K, long gs, long n, int C) {
    long G = K / gs, blocks = K / 128;
    const uint8_t *qr = q + n * (K / 2);
    const float *s = sc + n * G, *z = zs + n * G;
    __m512 total[4];
    for (int c = 0; c < C; c++) total[c] = _mm512_setzero_ps();
    __m512i e[4];
    if (gs >= 128) {
        long per = gs / 128;
        for (long g = 0; g < G; g++) {
            __m512 acc[4];
            for (int c = 0; c < C; c++) acc[c] = _mm512_setzero_ps();
            for (long b = g * per; b < (g + 1) * per; b++) {
                PREFETCH_AHEAD(qr + 64 * b);
                dp_decode(qr + 64 * b, e);
                for (int c = 0; c < C; c++) acc[c] = dp_dot(e, xb + c * K + 128 * b, acc[c]);
            }
            for (int c = 0; c < C; c++) total[c] = _mm512_fmadd_ps(acc[c], _mm512_set1_ps(s[g]), total[c]);
        }
    } else { /* 2 or 4 groups a block */
        long per = 128 / gs;
        __m512i idx = gs == 32 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                               : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        __mmask16 m = (__mmask16)((1u << per) - 1);
        for (long b = 0; b < blocks; b++) {
            PREFETCH_AHEAD(qr + 64 * b);
            dp_decode(qr + 64 * b, e);
            __m512 sv = _mm512_permutexvar_ps(idx, _mm512_maskz_loadu_ps(m, s + b * per));
            for (int c = 0; c < C; c++)
                total[c] = _mm512_fmadd_ps(dp_dot(e, xb + c * K + 128 * b, _mm512_setzero_ps()), sv, total[c]);
        }
    }
    for (int c = 0; c < C; c++) {
        const float *xgc = xg + c * G;
        __m512 corr = _mm512_setzero_ps();
        long g = 0;
        for (; g + 16 <= G; g += 16)
            corr = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_loadu_ps(s + g), _mm512_set1_ps(128.0f), _mm512_loadu_ps(z + g)),
                                   _mm512_loadu_ps(xgc + g), corr);
        if (g < G) {
            __mmask16 mk = (__mmask16)((1u << (G - g)) - 1);
            corr = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, s + g), _mm512_set1_ps(128.0f),
                                                   _mm512_maskz_loadu_ps(mk, z + g)),
                                   _mm512_maskz_loadu_ps(mk, xgc + g), corr);
        }
        y[c * N + n] = _mm512_reduce_add_ps(total[c]) - _mm512_reduce_add_ps(corr) + (bias ? bias[n] : 0.0f);
    }
}

/* y = x w^T (+ b) for M rows of x over x rounded to bf16 through rows_dp; 0 (nothing done) where the shape does not
 * fit it (K a multiple of 128 up to 16384; groups of 32, 64 or a multiple of 128 columns) or no memory. */
static int gemv_dp(const float *x, const uint8_t *q, const float *sc, const float *zs, const float *b, float *y,
                   long M, long N, long K, long gs, int threads) {
    if (!(K % 128 == 0 && K <= 16384 && (gs == 32 || gs == 64 || gs % 128 == 0)))
        return 0;
    long G = K / gs;
    if (M == 1) { /* a batch-1 decode: x's layout on the stack, no allocation per product */
        uint16_t xb1[K];
        float xg1[G];
        dp_prepare(x, K, gs, xb1, xg1);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long n = 0; n < N; n++) rows_dp(xb1, xg1, q, sc, zs, b, y, N, K, gs, n, 1);
        return 1;
    }
    uint16_t *xb = (uint16_t *)malloc((size_t)(M * K) * sizeof(uint16_t));
    float *xg = (float *)malloc((size_t)(M * G) * sizeof(float));
    if (!xb || !xg) {
        free(xb);
        free(xg);
        return 0;
    }
    for (long m = 0; m < M; m++) dp_prepare(x + m * K, K, gs, xb + m * K, xg + m * G);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++)
        for (long m0 = 0; m0 < M; m0 += 4) {
            const uint16_t *xbm = xb + m0 * K;
            const float *xgm = xg + m0 * G;
            float *ym = y + m0 * N;
            switch (M - m0 < 4 ? M - m0 : 4) { /* a constant row count for each case */
            case 1: rows_dp(xbm, xgm, q, sc, zs, b, ym, N, K, gs, n, 1); break;
            case 2: rows_dp(xbm, xgm, q, sc, zs, b, ym, N, K, gs, n, 2); break;
            case 3: rows_dp(xbm, xgm, q, sc, zs, b, ym, N, K, gs, n, 3); break;
            default: rows_dp(xbm, xgm, q, sc, zs, b, ym, N, K, gs, n, 4); break;
            }
        }
    free(xb);
    free(xg);
    return 1;
}
#endif

void tessera_int8_gemv_f32(const float *x, const uint8_t *q, const float *sc, const float *zs, const float *b,
                           float *y, long M, long N, long K, long gs, int threads) {
    gemv(x, q, sc, zs, b, y, M, N, K, gs, threads, 8);
}

void tessera_int4_gemv_f32(const float *x, const uint8_t *q, const float *sc, const float *zs, const float *b,
                           float *y, long M, long N, long K, long gs, int threads) {
    gemv(x, q, sc, zs, b, y, M, N, K, gs, threads, 4);
}

/* The int4 product with x rounded to bfloat16 (the bf16 products of layers/half_linear.py): rows_dp where the CPU
 * has AVX512-BF16 and the shape fits (K a multiple of 128; groups of 32, 64 or a multiple of 128 columns);
 * otherwise the float32 product over the rounded x, so the numbers mean the same on every CPU up to the order of
 * the sums. */
void tessera_int4_gemv_bf16x(const float *x, const uint8_t *q, const float *sc, const float *zs, const float *b,
                             float *y, long M, long N, long K, long gs, int threads) {
#ifdef TESSERA_INT4_DPBF16
    if (gemv_dp(x, q, sc, zs, b, y, M, N, K, gs, threads))
        return;
#endif
    float *xr = (float *)malloc((size_t)(M * K) * sizeof(float));
    if (!xr) { /* no memory for the copy: the unrounded product (a sum of the same terms, less rounded) */
        gemv(x, q, sc, zs, b, y, M, N, K, gs, threads, 4);
        return;
    }
    for (long i = 0; i < M * K; i++) xr[i] = bf16_value(bf16_bits(x[i]));
    gemv(xr, q, sc, zs, b, y, M, N, K, gs, threads, 4);
    free(xr);
}

/* The float32 weight [N, K] (w = q * scale - zs), rows over the threads. */
void tessera_int_dequant_f32(const uint8_t *q, const float *sc, const float *zs, float *w, long N, long K,
                             long gs, int bits, int threads) {
    long G = K / gs, row_bytes = bits == 8 ? K : K / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) dequant_row(q + n * row_bytes, sc + n * G, zs + n * G, w + n * K, 0, K, gs, bits);
}

#define DEQ_BF16_CHUNK 512 /* columns dequantized to float32 on the stack, then rounded: a multiple of 16 */

void tessera_int_dequant_bf16(const uint8_t *q, const float *sc, const float *zs, uint16_t *w, long N, long K,
                              long gs, int bits, int threads) {
    long G = K / gs, row_bytes = bits == 8 ? K : K / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        float buf[DEQ_BF16_CHUNK];
        for (long k0 = 0; k0 < K; k0 += DEQ_BF16_CHUNK) {
            long k1 = k0 + DEQ_BF16_CHUNK < K ? k0 + DEQ_BF16_CHUNK : K;
            dequant_row(q + n * row_bytes, sc + n * G, zs + n * G, buf - k0, k0, k1, gs, bits);
            uint16_t *out = w + n * K + k0;
            for (long k = 0; k < k1 - k0; k++) out[k] = bf16_bits(buf[k]); /* vectorized by the compiler */
        }
    }
}
