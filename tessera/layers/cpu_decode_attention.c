/* Decode attention in float32 over the decode K/V mirror (tessera/layers/attention/decode_mirror.py): one
 * query token per request, each KV head serving a group of G query heads, keys read once per (request, KV
 * head) for the whole group.
 *
 * Why not torch's ops: q k^T, softmax and p v as batched matmuls read each row's K and V through MKL's batched
 * GEMM of [G, D] x [D, L] tiles, ~3x the time the bytes take at demo-vl's batch 64 (and an additive mask per
 * step); SDPA's CPU kernel handles G query rows per KV head worse still. Here each (request, KV head) is one
 * task on torch's OpenMP threads: blocks of 64 keys, scores for four keys at a time, an online softmax (running
 * max and sum, rescaled per block), p v accumulated in four vector lanes per step.
 *
 * q, out [B, Hkv, G, D] contiguous; k, v: [rows, Hkv, keys, D] with any strides but the last (the mirror's
 * buffers, or K/V gathered from the pool): request b reads row rows[b] (rows NULL: row b), key j of KV head h
 * at k + rows[b] * row_stride + h * head_stride + j * key_stride; lens[b] keys valid, the last `window` of them
 * when window > 0. D a multiple of 8, at most MAX_D; G at most MAX_G. Built by cpu_kernels.py.
 */
#include <math.h>

#include "cpu_vec.h"

#define BLOCK 64
#define MAX_G 16
#define MAX_D 512

/* s[j] = scale * q . k_j for j < n (key j at k + j * ks), four keys per pass (four independent accumulators). */
static void scores(const float *q, const float *k, long ks, long D, long n, float scale, float *s) {
    long j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = k + j * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (long c = 0; c < D; c += 8) {
            v8 qv = load8(q + c);
            a0 += qv * load8(k0 + c);
            a1 += qv * load8(k1 + c);
            a2 += qv * load8(k2 + c);
            a3 += qv * load8(k3 + c);
        }
        s[j] = sum8(a0) * scale;
        s[j + 1] = sum8(a1) * scale;
        s[j + 2] = sum8(a2) * scale;
        s[j + 3] = sum8(a3) * scale;
    }
    for (; j < n; j++) {
        v8 a = {0};
        for (long c = 0; c < D; c += 8) a += load8(q + c) * load8(k + j * ks + c);
        s[j] = sum8(a) * scale;
    }
}

/* acc += sum_j p[j] v_j over n keys (key j at v + j * ks). */
static void accumulate(const float *p, const float *v, long ks, long D, long n, float *acc) {
    long c = 0;
    for (; c + 32 <= D; c += 32) {
        v8 o0 = load8(acc + c), o1 = load8(acc + c + 8), o2 = load8(acc + c + 16), o3 = load8(acc + c + 24);
        for (long j = 0; j < n; j++) {
            const float *vj = v + j * ks + c;
            v8 pj = splat8(p[j]);
            o0 += pj * load8(vj);
            o1 += pj * load8(vj + 8);
            o2 += pj * load8(vj + 16);
            o3 += pj * load8(vj + 24);
        }
        store8(acc + c, o0);
        store8(acc + c + 8, o1);
        store8(acc + c + 16, o2);
        store8(acc + c + 24, o3);
    }
    for (; c < D; c += 8) {
        v8 o = load8(acc + c);
        for (long j = 0; j < n; j++) o += splat8(p[j]) * load8(v + j * ks + c);
        store8(acc + c, o);
    }
}

static void one_head(const float *q, const float *k, const float *v, long ks, float *out, long G, long D, long lo,
                     long hi, float scale) {
    float acc[MAX_G * MAX_D], s[BLOCK], m[MAX_G], l[MAX_G];
    for (long g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (long i = 0; i < G * D; i++) acc[i] = 0.0f;
    for (long j0 = lo; j0 < hi; j0 += BLOCK) {
        long n = hi - j0 < BLOCK ? hi - j0 : BLOCK;
        const float *kb = k + j0 * ks, *vb = v + j0 * ks;
        for (long g = 0; g < G; g++) {
            float *ag = acc + g * D;
            scores(q + g * D, kb, ks, D, n, scale, s);
            float mx = m[g];
            for (long j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
            if (mx > m[g]) { /* a new running max: rescale what was summed under the old one */
                float alpha = m[g] == -INFINITY ? 0.0f : expf(m[g] - mx);
                l[g] *= alpha;
                for (long c = 0; c < D; c += 8) store8(ag + c, load8(ag + c) * splat8(alpha));
                m[g] = mx;
            }
            v8 sum = {0};
            long j = 0;
            for (; j + 8 <= n; j += 8) {
                v8 p = exp8(load8(s + j) - splat8(mx));
                store8(s + j, p);
                sum += p;
            }
            float tail = 0.0f;
            for (; j < n; j++) {
                s[j] = expf(s[j] - mx);
                tail += s[j];
            }
            l[g] += sum8(sum) + tail;
            accumulate(s, vb, ks, D, n, ag);
        }
    }
    for (long g = 0; g < G; g++) {
        float r = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
        for (long c = 0; c < D; c += 8) store8(out + g * D + c, load8(acc + g * D + c) * splat8(r));
    }
}

void tessera_decode_attention_f32(const float *q, const float *k, const float *v, const long *rows, const long *lens,
                                  float *out, long B, long Hkv, long G, long D, long row_stride, long head_stride,
                                  long key_stride, float scale, long window, int threads) {
    /* Waking a second thread costs more than a few small heads take (1 request x 150 keys: 9 us on one
     * thread, 17 on two). */
    long keys = 0;
    for (long b = 0; b < B; b++) keys += lens[b];
#pragma omp parallel for num_threads(threads) schedule(dynamic, 2) if (keys * Hkv * G * D >= (1L << 18))
    for (long t = 0; t < B * Hkv; t++) {
        long b = t / Hkv, h = t % Hkv, row = rows ? rows[b] : b, hi = lens[b];
        long lo = window > 0 && hi > window ? hi - window : 0;
        long kv = row * row_stride + h * head_stride;
        one_head(q + t * G * D, k + kv, v + kv, key_stride, out + t * G * D, G, D, lo, hi, scale);
    }
}
