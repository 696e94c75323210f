/* y = x w^T (+ b) for few rows of float32 x over a 16-bit weight (bfloat16 or float16): the decode step's
 * projections on a CPU for a bf16/fp16 checkpoint kept in 16 bits.
 *
 * x [M, K] float32, w [N, K] as raw 16-bit values (row-major), b [N] float32 or NULL, y [M, N] float32.
 * At a few rows the product is bound by reading w, so half the bytes of float32 is the whole gain: each weight
 * value is widened to float32 in registers (bfloat16: its bits shifted left by 16; float16: F16C's vcvtph2ps)
 * and multiplied-added in float32, so the result is the float32 product of the upcast weight. The loop
 * structure is cpu_gemv.c's: OpenMP (torch's pool) over blocks of 4 weight rows, tiles of 4 x TILE_C rows of x,
 * VL lanes (cpu_vec.h); one row of x reads the weight row by row instead (row1).
 * Built by tessera/platform/cpu_kernels.py.
 */
#include <stdint.h>

#include "cpu_vec.h"

#if defined(__AVX2__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t vu16 __attribute__((vector_size(VL * 2)));
typedef uint32_t vu32 __attribute__((vector_size(VL * 4)));

static inline vf widen_bf16(const uint16_t *p) {
#if VL == 16
    vf r;
    __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    __builtin_memcpy(&r, &v, sizeof r);
    return r;
#elif defined(__AVX2__)
    /* GCC's vector-extension form below compiled to a slower sequence (measured: 8.4 vs 5.4 ms, see
     * docs/benchmarks.md); zero-extend and shift in two instructions. */
    vf r;
    __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    __builtin_memcpy(&r, &v, sizeof r);
    return r;
#else
    vu16 h;
    __builtin_memcpy(&h, p, sizeof h);
    return (vf)(__builtin_convertvector(h, vu32) << 16);
#endif
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> float by its fields (normals, subnormals, inf/NaN): the scalar tail, and the vector path where
 * the CPU has no conversion instruction. */
static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise the mantissa */
        int e = 113;
        while (!(man & 0x400)) {
            man <<= 1;
            e--;
        }
        u = sign | ((uint32_t)e << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

static inline vf widen_f16(const uint16_t *p) {
    vf r;
#if VL == 16
    __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    __builtin_memcpy(&r, &v, sizeof r);
#elif defined(__F16C__)
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __builtin_memcpy(&r, &v, sizeof r);
#else
    for (int i = 0; i < VL; i++) r[i] = f16_to_f32(p[i]);
#endif
    return r;
}

/* VL weights at p (column k of their row) widened to float32. */
static inline __attribute__((always_inline)) vf load_widened(const uint16_t *p, long k, int HALF) {
    if (k % (2 * VL) == 0) PREFETCH_AHEAD(p); /* a 64-byte line per two steps */
    return HALF ? widen_f16(p) : widen_bf16(p);
}

/* Rows n0 .. n0+R-1 of w against rows m0 .. m0+C-1 of x, R <= 4, C <= TILE_C; inlined with constant R, C and
 * HALF (1: float16, 0: bfloat16) so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(const float *x, const uint16_t *w, float *y, long N, long K,
                                                      long n0, long m0, int R, int C, int HALF) {
    vf acc[4][TILE_C] = {{{0}}};
    long k = 0;
    TILE_VECTOR_LOOP(acc, k, K, R, C, c, x + (m0 + c) * K + k, r, load_widened(w + (n0 + r) * K + k, k, HALF));
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float s = sumv(acc[r][c]);
            for (long t = k; t < K; t++) {
                uint16_t h = w[(n0 + r) * K + t];
                s += (HALF ? f16_to_f32(h) : bf16_to_f32(h)) * x[(m0 + c) * K + t];
            }
            y[(m0 + c) * N + n0 + r] = s;
        }
}

/* Every row of x against weight rows n0 .. n0+R-1 (R constant: 4, or 1 at the edge). */
static inline __attribute__((always_inline)) void rows_of_x(const float *x, const uint16_t *w, float *y, long M,
                                                           long N, long K, long n0, int R, int HALF) {
    long m = 0;
    for (; m + TILE_C <= M; m += TILE_C) tile(x, w, y, N, K, n0, m, R, TILE_C, HALF);
    switch (M - m) { /* a constant C for each remainder (below TILE_C: the min only keeps dead cases in bounds) */
    case 3: tile(x, w, y, N, K, n0, m, R, TILE_MIN(3), HALF); break;
    case 2: tile(x, w, y, N, K, n0, m, R, TILE_MIN(2), HALF); break;
    case 1: tile(x, w, y, N, K, n0, m, R, 1, HALF); break;
    }
}

/* One block of 4 weight rows (fewer at the end) against every row of x. */
static inline __attribute__((always_inline)) void block(const float *x, const uint16_t *w, const float *b, float *y,
                                                       long M, long N, long K, long blk, int HALF) {
    long n0 = blk * 4, rows = N - n0 < 4 ? N - n0 : 4;
    if (rows == 4)
        rows_of_x(x, w, y, M, N, K, n0, 4, HALF);
    else
        for (long r = 0; r < rows; r++) rows_of_x(x, w, y, M, N, K, n0 + r, 1, HALF);
    if (b)
        for (long m = 0; m < M; m++)
            for (long r = 0; r < rows; r++) y[m * N + n0 + r] += b[n0 + r];
}

/* One row of x (a batch-1 decode): each weight row read start to end with four accumulators, so that a
 * thread's share of w (adjacent rows) is one sequential stream. Four interleaved rows of 16-bit values (the
 * tiles above) read ~30-40% slower here: 10.4-10.6 against 13.6-14.1 GB/s over bench-medium's weights. */
static inline __attribute__((always_inline)) void row1(const float *x, const uint16_t *w, const float *b, float *y,
                                                      long N, long K, long n, int HALF) {
    const uint16_t *wr = w + n * K;
    vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    long k = 0;
    for (; k + 4 * VL <= K; k += 4 * VL) {
        PREFETCH_AHEAD(wr + k);
        PREFETCH_AHEAD(wr + k + 2 * VL);
        a0 += (HALF ? widen_f16(wr + k) : widen_bf16(wr + k)) * loadv(x + k);
        a1 += (HALF ? widen_f16(wr + k + VL) : widen_bf16(wr + k + VL)) * loadv(x + k + VL);
        a2 += (HALF ? widen_f16(wr + k + 2 * VL) : widen_bf16(wr + k + 2 * VL)) * loadv(x + k + 2 * VL);
        a3 += (HALF ? widen_f16(wr + k + 3 * VL) : widen_bf16(wr + k + 3 * VL)) * loadv(x + k + 3 * VL);
    }
    for (; k + VL <= K; k += VL) a0 += (HALF ? widen_f16(wr + k) : widen_bf16(wr + k)) * loadv(x + k);
    float s = sumv((a0 + a1) + (a2 + a3));
    for (; k < K; k++) s += (HALF ? f16_to_f32(wr[k]) : bf16_to_f32(wr[k])) * x[k];
    y[n] = b ? s + b[n] : s;
}

/* Each entry point has its own parallel loops, written once here with HALF a constant: OpenMP outlines a loop's
 * body into one function, and a shared one would take HALF as a run-time value, testing it inside the innermost
 * loop (measured 1.3x slower). */
#define GEMV16_ENTRY(NAME, HALF)                                                                             \
    void NAME(const float *x, const uint16_t *w, const float *b, float *y, long M, long N, long K,            \
              int threads) {                                                                                  \
        if (M == 1) {                                                                                         \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")                                 \
            for (long n = 0; n < N; n++) row1(x, w, b, y, N, K, n, HALF);                                     \
            return;                                                                                           \
        }                                                                                                     \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                                     \
        for (long blk = 0; blk < (N + 3) / 4; blk++) block(x, w, b, y, M, N, K, blk, HALF);                   \
    }

GEMV16_ENTRY(tessera_gemv_bf16, 0)
GEMV16_ENTRY(tessera_gemv_f16, 1)
