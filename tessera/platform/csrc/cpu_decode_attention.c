/* Decode attention in float32 over the paged KV pool, read in place: one query token per request, each KV
 * head serving a group of G query heads, keys read once per (request, KV head) for the whole group.
 *
 * Why: torch's ops need each request's K/V contiguous, so the engine kept a second copy of them (the decode
 * mirror, layers/attention/decode_mirror.py) and ran q k^T, softmax and p v over it as batched GEMMs of
 * [G, D] x [D, L] tiles, ~3x the time the bytes take at demo-vl's batch 64, plus a mask, a scale and a
 * permutation per layer. Here each request (or request and KV head, when requests are few) is one task on
 * torch's OpenMP threads: blocks of 64 keys (the next block's rows prefetched through the slot table while one
 * computes), scores for four keys at a time, an online softmax (running max and sum, rescaled per block), p v in
 * four vector lanes.
 *
 * q, out [B, Hkv, G, D] contiguous; k, v the pool's buffers of one layer ([slots, Hkv, D]); request b's key j
 * in slot slots[b * slots_stride + j], its keys [0, lens[b]) (the last `window` of them when window > 0), key
 * j of KV head h at k + slot * key_stride + h * head_stride. D a multiple of 8, at most MAX_D; G at most
 * MAX_ROWS. Built by cpu_kernels.py.
 */
#include <math.h>

#include "cpu_vec.h"

#define BLOCK 64
#define MAX_ROWS 16 /* query rows per task: KV heads per task x G */
#define MAX_D 512

/* s[j] = scale * q . k[j] for j < n, four keys per pass (four independent accumulators). */
static void scores(const float *q, const float *const *k, long D, long n, float scale, float *s) {
    long j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = k[j], *k1 = k[j + 1], *k2 = k[j + 2], *k3 = k[j + 3];
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
        for (long c = 0; c < D; c += 8) a += load8(q + c) * load8(k[j] + c);
        s[j] = sum8(a) * scale;
    }
}

/* acc += sum_j p[j] v[j] over n keys. */
static void accumulate(const float *p, const float *const *v, long D, long n, float *acc) {
    long c = 0;
    for (; c + 32 <= D; c += 32) {
        v8 o0 = load8(acc + c), o1 = load8(acc + c + 8), o2 = load8(acc + c + 16), o3 = load8(acc + c + 24);
        for (long j = 0; j < n; j++) {
            const float *vj = v[j] + c;
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
        for (long j = 0; j < n; j++) o += splat8(p[j]) * load8(v[j] + c);
        store8(acc + c, o);
    }
}

/* Request b's keys: key j of KV head h at k + slots[j] * key_stride + h * head_stride (v alike). */
typedef struct {
    const float *k, *v;
    const long *slots;
    long key_stride, head_stride;
} keys_t;

/* Requests K and V rows of keys [from, to) ahead of their use: they sit wherever the allocator put them, so the
 * hardware's prefetcher cannot guess them. Each block asks for the next one while it computes. */
static void prefetch_rows(keys_t keys, long heads, long D, long from, long to) {
    for (long j = from; j < to; j++) {
        const float *kr = keys.k + keys.slots[j] * keys.key_stride, *vr = keys.v + keys.slots[j] * keys.key_stride;
        for (long h = 0; h < heads; h++)
            for (long c = 0; c < D; c += 16) { /* one 64-byte line per 16 floats */
                __builtin_prefetch(kr + h * keys.head_stride + c);
                __builtin_prefetch(vr + h * keys.head_stride + c);
            }
    }
}

/* Query rows [heads x G, D] of one request over its keys [lo, hi) of `heads` KV heads. A request's KV heads
 * share a task when there are requests enough to keep the threads busy: in the pool a key's heads are
 * adjacent, so one task reads each slot's K and V rows whole. */
static void attend(const float *q, keys_t keys, long heads, float *out, long G, long D, long lo, long hi,
                   float scale) {
    float acc[MAX_ROWS * MAX_D], s[BLOCK], m[MAX_ROWS], l[MAX_ROWS];
    long off[BLOCK];
    const float *kp[BLOCK], *vp[BLOCK];
    long R = heads * G;
    for (long r = 0; r < R; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    for (long i = 0; i < R * D; i++) acc[i] = 0.0f;
    prefetch_rows(keys, heads, D, lo, lo + BLOCK < hi ? lo + BLOCK : hi);
    for (long j0 = lo; j0 < hi; j0 += BLOCK) {
        long n = hi - j0 < BLOCK ? hi - j0 : BLOCK;
        for (long j = 0; j < n; j++) off[j] = keys.slots[j0 + j] * keys.key_stride;
        prefetch_rows(keys, heads, D, j0 + BLOCK, j0 + 2 * BLOCK < hi ? j0 + 2 * BLOCK : hi);
        for (long h = 0; h < heads; h++) {
            for (long j = 0; j < n; j++) {
                kp[j] = keys.k + off[j] + h * keys.head_stride;
                vp[j] = keys.v + off[j] + h * keys.head_stride;
            }
            for (long r = h * G; r < (h + 1) * G; r++) {
                float *ar = acc + r * D;
                scores(q + r * D, kp, D, n, scale, s);
                float mx = m[r];
                for (long j = 0; j < n; j++) mx = s[j] > mx ? s[j] : mx;
                if (mx > m[r]) { /* a new running max: rescale what was summed under the old one */
                    float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - mx);
                    l[r] *= alpha;
                    for (long c = 0; c < D; c += 8) store8(ar + c, load8(ar + c) * splat8(alpha));
                    m[r] = mx;
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
                l[r] += sum8(sum) + tail;
                accumulate(s, vp, D, n, ar);
            }
        }
    }
    for (long r = 0; r < R; r++) {
        float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (long c = 0; c < D; c += 8) store8(out + r * D + c, load8(acc + r * D + c) * splat8(inv));
    }
}

void tessera_decode_attention_f32(const float *q, const float *k, const float *v, const long *slots, long slots_stride,
                                  const long *lens, float *out, long B, long Hkv, long G, long D, long key_stride,
                                  long head_stride, float scale, long window, int threads) {
    /* Waking a second thread costs more than a few small heads take: on the Xeon of the first measurement 1
     * request x 150 keys took 9 us on one thread, 17 on two; on the 2-vCPU EPYC (Zen 5) of issue 33's later
     * passes, 4 KV heads x 3 x 64 at 100 / 150 / 256 keys took 14 / 15-18 / 30-38 us on one thread and 10-12 /
     * 12-14 / 17-20 on two (warm caches), so the threshold sits under 100 such keys. */
    long total = 0;
    for (long b = 0; b < B; b++) total += lens[b];
    int parallel = total * Hkv * G * D >= (1L << 16);
    /* KV heads per task: as many as fit MAX_ROWS query rows, once there are a few requests per thread. */
    long heads = 1;
    if (!parallel || B >= 4L * threads)
        for (long h = Hkv; h >= 1; h--)
            if (Hkv % h == 0 && h * G <= MAX_ROWS) {
                heads = h;
                break;
            }
    long per_req = Hkv / heads;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 2) if (parallel)
    for (long t = 0; t < B * per_req; t++) {
        long b = t / per_req, h = (t % per_req) * heads, hi = lens[b];
        long lo = window > 0 && hi > window ? hi - window : 0;
        keys_t keys = {k + h * head_stride, v + h * head_stride, slots + b * slots_stride, key_stride, head_stride};
        long at = (b * Hkv + h) * G * D;
        attend(q + at, keys, heads, out + at, G, D, lo, hi, scale);
    }
}
