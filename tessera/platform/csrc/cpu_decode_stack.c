/* A whole decode step of the shared decoder stack (layers/decoder.py) in one call: every layer's norms,
 * projections, rotary, K/V write, attention and SwiGLU, then the final norm, for a few rows in float32.
 *
 * Why: at batch 1 each of a layer's ~10 steps is a Python call, a torch.empty and a ctypes crossing, 20-40 us
 * apiece; over a model's layers that was about a quarter of the step on bench-medium and most of it on a small
 * model, while llama.cpp runs the same graph from C. This file adds no arithmetic of its own: it calls the
 * kernels the layer-by-layer path calls (their addresses come in a table from Python, each still built as its
 * own library), on the same operands in the same order, so its results are those of that path. The one
 * difference: products over small weights, which that path leaves to torch, run in our gemv here too.
 *
 * Layout per row: qkv = [q heads | k heads | v heads]; q is rotated into a [rows, Hq, D] buffer, k rotated
 * straight into its K/V slot and v copied there; attention reads the pool in place (cpu_decode_attention.c).
 * LoRA (layers/lora/slots.py): a step whose rows use adapters adds each row's own adapter product to the
 * qkv, o, gate-up and down outputs, x A[slot]^T then B[slot], the rows of one slot gathered so that its A is one
 * few-row product (Punica's segments; no row computes another slot's terms).
 * Built by cpu_kernels.py; driven by layers/decode_stack.py, which decides when it applies.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*gemv_fn)(const float *x, const void *w, const float *b, float *y, long M, long N, long K, int threads);
typedef void (*int_gemv_fn)(const float *x, const void *q, const float *sc, const float *zs, const float *b, float *y,
                            long M, long N, long K, long gs, int threads);
typedef void (*rmsnorm_fn)(const float *x, const float *residual, float *sum_out, const float *w, float *out, long M,
                           long H, float eps, int threads);
typedef void (*rotary_fn)(const float *x, long x_row, long x_head, const float *cos, const float *sin, long cs_row,
                          float *out, long T, long H, long D, int threads);
typedef void (*silu_mul_fn)(const float *x, long x_row, float *out, long M, long d, int threads);
typedef void (*attention_fn)(const float *q, const float *k, const float *v, const long *slots, long slots_stride,
                             const long *lens, float *out, long B, long Hkv, long G, long D, long key_stride,
                             long head_stride, float scale, long window, int threads);

/* The kernels, by address (Python fills it from the loaded libraries; a kind's entry may be NULL when no weight
 * of that kind is in the model). Every field is pointer-sized, so ctypes lays it out as C does. */
typedef struct {
    gemv_fn f32, bf16, f16;
    int_gemv_fn int8, int4;
    rmsnorm_fn rmsnorm;
    rotary_fn rotary;
    silu_mul_fn silu_mul;
    attention_fn attention;
} kernels_t;

enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2, W_INT8 = 3, W_INT4 = 4 };

/* One projection's weight [n, k] in its stored form: float (w), 16-bit (w) or packed int (w = q, with scale and
 * zs per group of `group` inputs, cpu_int_gemv.c's layout); bias or NULL. */
typedef struct {
    long kind;
    const void *w;
    const float *scale, *zs, *bias;
    long n, k, group;
} weight_t;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q_norm / k_norm NULL without QK-norm */
    weight_t qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* this layer's pool buffers [slots, Hkv, D], heads adjacent */
    long window;              /* sliding window in tokens, 0 for full attention */
} layer_t;

/* One projection's LoRA stacks: A [slots, width, k] and Bt [slots, width, n] (B transposed, its scaling folded
 * in), float32; A is NULL where no adapter targets the projection. */
typedef struct {
    const float *A, *Bt;
    long width;
} lora_t;

/* The step's adapter rows grouped by slot: rows order[starts[s] .. starts[s + 1]) use slot s. */
typedef struct {
    long *order, *starts;
    long slots;
    float *xs, *t, *d; /* scratch: gathered rows [M, k], their shrink [M, width], one row's expand [n] */
} lora_rows_t;

/* y[r] += (x[r] A[s]^T) Bt[s] for every adapter row r (slot s); the product is summed apart and then added, as
 * the layer-by-layer path's addmm does. */
static void lora_add(const kernels_t *kn, const lora_t *lo, const lora_rows_t *lr, const float *x, float *y,
                     long N, long K) {
    if (!lr || !lo->A) return;
    long W = lo->width;
    for (long s = 0; s < lr->slots; s++) {
        long cnt = lr->starts[s + 1] - lr->starts[s];
        const long *rows = lr->order + lr->starts[s];
        if (!cnt) continue;
        for (long i = 0; i < cnt; i++) memcpy(lr->xs + i * K, x + rows[i] * K, sizeof(float) * K);
        /* one thread: a few rows against a few rank rows, smaller than a thread team's start-up */
        kn->f32(lr->xs, lo->A + s * W * K, NULL, lr->t, cnt, W, K, 1);
        const float *B = lo->Bt + s * W * N;
        for (long i = 0; i < cnt; i++) {
            const float *t = lr->t + i * W;
            float *d = lr->d, *yr = y + rows[i] * N;
            for (long o = 0; o < N; o++) d[o] = t[0] * B[o];
            for (long j = 1; j < W; j++) {
                const float a = t[j], *b = B + j * N;
                for (long o = 0; o < N; o++) d[o] += a * b[o];
            }
            for (long o = 0; o < N; o++) yr[o] += d[o];
        }
    }
}

static void product(const kernels_t *kn, const weight_t *w, const float *x, float *y, long M, int threads) {
    switch (w->kind) {
    case W_F32: kn->f32(x, w->w, w->bias, y, M, w->n, w->k, threads); break;
    case W_BF16: kn->bf16(x, w->w, w->bias, y, M, w->n, w->k, threads); break;
    case W_F16: kn->f16(x, w->w, w->bias, y, M, w->n, w->k, threads); break;
    case W_INT8: kn->int8(x, w->w, w->scale, w->zs, w->bias, y, M, w->n, w->k, w->group, threads); break;
    default: kn->int4(x, w->w, w->scale, w->zs, w->bias, y, M, w->n, w->k, w->group, threads); break;
    }
}

/* x [M, H]: the step's input embeddings; out [M, H]: the final norm of the last layer's residual sum.
 * cos, sin [M, D / 2] (row stride cs_row); loc [M]: each row's new K/V slot; slots [M, >= lens[m]] (row stride
 * slots_stride) and lens [M]: each row's keys after this step's token is written. lora [L * 4] (qkv, o, gate-up,
 * down per layer) and row_slots [M] (-1: no adapter), or NULL without adapter rows; num_slots bounds the slots.
 * Returns 0, or -1 when the scratch memory could not be had (nothing was written then). */
int tessera_decode_stack_f32(const kernels_t *kn, const layer_t *layers, long L, const float *final_norm,
                             const float *x, float *out, const float *cos, const float *sin, long cs_row,
                             const long *loc, const long *slots, long slots_stride, const long *lens, long M,
                             long H, long Hq, long Hkv, long D, long I, float eps, float scale, int threads,
                             const lora_t *lora, const long *row_slots, long num_slots) {
    long qkv_w = (Hq + 2 * Hkv) * D, q_w = Hq * D, kv_w = Hkv * D, G = Hq / Hkv;
    long need = M * (qkv_w + 2 * q_w + 4 * H + 3 * I) + Hq * D;
    lora_rows_t lr_store, *lr = NULL;
    long width = 0, kmax = H > q_w ? H : q_w, nmax = qkv_w > 2 * I ? qkv_w : 2 * I;
    if (kmax < I) kmax = I;
    if (nmax < H) nmax = H;
    if (lora && row_slots) {
        for (long i = 0; i < 4 * L; i++)
            if (lora[i].A && lora[i].width > width) width = lora[i].width;
        need += M * (kmax + width) + nmax;
    }
    float *buf = malloc(sizeof(float) * need);
    if (!buf) return -1;
    if (lora && row_slots && width > 0) { /* a counting sort of the adapter rows by slot */
        lr = &lr_store;
        lr->order = malloc(sizeof(long) * (M + num_slots + 1));
        if (!lr->order) {
            free(buf);
            return -1;
        }
        lr->slots = num_slots;
        lr->xs = buf + M * (qkv_w + 2 * q_w + 4 * H + 3 * I) + Hq * D;
        lr->t = lr->xs + M * kmax;
        lr->d = lr->t + M * width;
        lr->starts = lr->order + M;
        memset(lr->starts, 0, sizeof(long) * (num_slots + 1));
        for (long m = 0; m < M; m++)
            if (row_slots[m] >= 0 && row_slots[m] < num_slots) lr->starts[row_slots[m] + 1]++;
        for (long s = 0; s < num_slots; s++) lr->starts[s + 1] += lr->starts[s];
        for (long m = 0; m < M; m++)
            if (row_slots[m] >= 0 && row_slots[m] < num_slots) lr->order[lr->starts[row_slots[m]]++] = m;
        for (long s = num_slots; s > 0; s--) lr->starts[s] = lr->starts[s - 1];
        lr->starts[0] = 0;
    }
    float *qkv = buf, *q = qkv + M * qkv_w, *attn = q + M * q_w, *h = attn + M * q_w, *res = h + M * H,
          *sum = res + M * H, *normed = sum + M * H, *gu = normed + M * H, *act = gu + 2 * M * I,
          *qk_tmp = act + M * I;
    const float *resid = x; /* layer 0's residual is its input */
    for (long l = 0; l < L; l++) {
        const layer_t *ly = layers + l;
        if (l == 0) {
            kn->rmsnorm(x, NULL, NULL, ly->input_norm, normed, M, H, eps, threads);
        } else {
            kn->rmsnorm(h, resid, sum, ly->input_norm, normed, M, H, eps, threads);
            float *t = res; /* the sum is the next residual: swap the buffers */
            res = sum;
            sum = t;
            resid = res;
        }
        const lora_t *lo = lora ? lora + 4 * l : NULL;
        product(kn, &ly->qkv, normed, qkv, M, threads);
        if (lr) lora_add(kn, lo, lr, normed, qkv, qkv_w, H);
        for (long m = 0; m < M; m++) {
            const float *row = qkv + m * qkv_w, *c = cos + m * cs_row, *s = sin + m * cs_row;
            float *k_slot = ly->k_cache + loc[m] * kv_w, *v_slot = ly->v_cache + loc[m] * kv_w;
            if (ly->q_norm) { /* RMSNorm over each head of q and of k (its own rows of D), then RoPE */
                kn->rmsnorm(row, NULL, NULL, ly->q_norm, qk_tmp, Hq, D, eps, threads);
                kn->rotary(qk_tmp, 0, D, c, s, 0, q + m * q_w, 1, Hq, D, threads);
                kn->rmsnorm(row + q_w, NULL, NULL, ly->k_norm, qk_tmp, Hkv, D, eps, threads);
                kn->rotary(qk_tmp, 0, D, c, s, 0, k_slot, 1, Hkv, D, threads);
            } else {
                kn->rotary(row, 0, D, c, s, 0, q + m * q_w, 1, Hq, D, threads);
                kn->rotary(row + q_w, 0, D, c, s, 0, k_slot, 1, Hkv, D, threads);
            }
            memcpy(v_slot, row + q_w + kv_w, sizeof(float) * kv_w);
        }
        kn->attention(q, ly->k_cache, ly->v_cache, slots, slots_stride, lens, attn, M, Hkv, G, D, kv_w, D, scale,
                      ly->window, threads);
        product(kn, &ly->o, attn, h, M, threads);
        if (lr) lora_add(kn, lo + 1, lr, attn, h, H, q_w);
        kn->rmsnorm(h, resid, sum, ly->post_norm, normed, M, H, eps, threads);
        float *t = res;
        res = sum;
        sum = t;
        resid = res;
        product(kn, &ly->gate_up, normed, gu, M, threads);
        if (lr) lora_add(kn, lo + 2, lr, normed, gu, 2 * I, H);
        kn->silu_mul(gu, 2 * I, act, M, I, threads);
        product(kn, &ly->down, act, h, M, threads);
        if (lr) lora_add(kn, lo + 3, lr, act, h, H, I);
    }
    if (L == 0)
        kn->rmsnorm(x, NULL, NULL, final_norm, out, M, H, eps, threads);
    else
        kn->rmsnorm(h, resid, sum, final_norm, out, M, H, eps, threads);
    if (lr) free(lr->order);
    free(buf);
    return 0;
}
