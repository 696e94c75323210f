/* Eight float32 lanes through GCC/Clang vector extensions (AVX on x86, NEON pairs on Arm, whatever
 * -march=native offers), shared by the CPU kernels built in tessera/platform/cpu_kernels.py. */
#ifndef TESSERA_CPU_VEC_H
#define TESSERA_CPU_VEC_H

typedef float v8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    __builtin_memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline void store8(float *p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

static inline float sum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }

typedef int v8i __attribute__((vector_size(32)));

/* Lanes of a where mask (a comparison's -1 / 0 lanes), else b. */
static inline v8 select8(v8i mask, v8 a, v8 b) { return (v8)((mask & (v8i)a) | (~mask & (v8i)b)); }

/* exp of eight lanes, Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, exp(r) from a degree-6 polynomial,
 * 2^n built in the exponent bits; within 2 ulp of libm's expf. Inputs are clamped to [-87.3, 88.7], so
 * -inf gives ~1e-38 rather than 0 (harmless in a softmax, whose largest term is 1). */
static inline v8 exp8(v8 x) {
    x = select8(x < splat8(-87.3f), splat8(-87.3f), x);
    x = select8(x > splat8(88.7f), splat8(88.7f), x);
    v8 t = x * splat8(1.44269504088896341f) + splat8(0.5f);
    v8i n = __builtin_convertvector(t, v8i); /* truncates toward zero: floor for t < 0 needs a step down */
    n += (v8i)(__builtin_convertvector(n, v8) > t);  /* the comparison's -1 lanes */
    v8 fn = __builtin_convertvector(n, v8);
    v8 r = x - fn * splat8(0.693359375f) + fn * splat8(2.12194440e-4f);
    v8 p = splat8(1.9875691500e-4f);
    p = p * r + splat8(1.3981999507e-3f);
    p = p * r + splat8(8.3334519073e-3f);
    p = p * r + splat8(4.1665795894e-2f);
    p = p * r + splat8(1.6666665459e-1f);
    p = p * r + splat8(5.0000001201e-1f);
    p = p * r * r + r + splat8(1.0f);
    return p * (v8)((n + 127) << 23);
}

/* The widest float vector the products use (vf, VL lanes): 16 lanes where the compiler targets AVX-512 (one
 * instruction does twice the work of AVX2's, and 32 registers hold larger tiles), else the eight above. Only the
 * few-row products (cpu_gemv*.c, cpu_int_gemv.c) use it; figures in docs/benchmarks.md, "AVX-512". */
#if defined(__AVX512F__)
#define VL 16
typedef float vf __attribute__((vector_size(64)));
static inline float sumv(vf v) {
    return sum8((v8){v[0] + v[8], v[1] + v[9], v[2] + v[10], v[3] + v[11], v[4] + v[12], v[5] + v[13],
                     v[6] + v[14], v[7] + v[15]});
}
#else
#define VL 8
typedef v8 vf;
static inline float sumv(vf v) { return sum8(v); }
#endif

/* Rows of x per tile of the few-row products (against 4 weight rows): AVX-512's 32 registers hold 4 x 4
 * accumulators, AVX2's 16 hold 4 x 2. TILE_MIN keeps a remainder's constant within the tile (dead cases). */
#if VL == 16
#define TILE_C 4
#else
#define TILE_C 2
#endif
#define TILE_MIN(c) ((c) < TILE_C ? (c) : TILE_C)

static inline vf loadv(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void storev(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

static inline vf splatv(float x) { return x - (vf){0}; }

/* A load kept in its register: an empty asm makes the vector opaque to the compiler, which otherwise folds a
 * tile's x loads into every multiply-add as a memory operand (8 loads of x per 8 multiply-adds of a 4 x 2 tile
 * instead of 2) and makes AVX2's few-row products bound by loads rather than multiply-adds (docs/benchmarks.md,
 * "Back on an AVX2 EPYC"). Only where one register holds a vf (AVX: 256 bits, AVX-512: 512); a build without AVX
 * splits vf into halves, and there it is a plain load. */
static inline vf loadv_pinned(const float *p) {
    vf v = loadv(p);
#if defined(__AVX__)
    __asm__("" : "+v"(v));
#endif
    return v;
}

/* The vector loop of every few-row product tile: for each whole vector of columns from k up to end, the C rows of x
 * loaded once and pinned (X: row c's pointer at column k, an expression of c and k), and each weight row r < R's
 * VL values at column k as floats (WEIGHT, an expression of r and k: read, prefetched, widened or dequantized as
 * the format needs) multiplied into acc[r][c]. k is left at the first column the caller's scalar tail finishes.
 * A macro, so that R, C and the weight format stay constants of each inlined tile and its accumulators stay in
 * registers. */
#define TILE_VECTOR_LOOP(acc, k, end, R, C, c, X, r, WEIGHT)                                                \
    for (; (k) + VL <= (end); (k) += VL) {                                                                  \
        vf tile_x_[TILE_C];                                                                                 \
        for (int c = 0; c < (C); c++) tile_x_[c] = loadv_pinned(X);                                         \
        for (int r = 0; r < (R); r++) {                                                                     \
            vf tile_w_ = (WEIGHT);                                                                          \
            for (int c = 0; c < (C); c++) (acc)[r][c] += tile_w_ * tile_x_[c];                              \
        }                                                                                                   \
    }

/* Software prefetch of a weight stream WEIGHT_PREFETCH_BYTES ahead of where a tile reads it, in AVX-512 builds
 * (measured there: 1.07-1.25x at 4-16 rows of x, level at one row, on an AMD EPYC VM whose hardware
 * prefetchers fell behind 4 interleaved rows under the tiles' arithmetic); a no-op elsewhere (not measured). */
#define WEIGHT_PREFETCH_BYTES 4096
#if VL == 16
#define PREFETCH_AHEAD(p) __builtin_prefetch((const char *)(p) + WEIGHT_PREFETCH_BYTES)
#else
#define PREFETCH_AHEAD(p) ((void)0)
#endif

#endif
