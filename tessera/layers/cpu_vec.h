/* Eight float32 lanes through GCC/Clang vector extensions (AVX on x86, NEON pairs on Arm, whatever
 * -march=native offers), shared by the CPU kernels built in tessera/layers/cpu_kernels.py. */
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

#endif
