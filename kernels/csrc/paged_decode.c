/* Paged decode attention on the CPU: each decode row's one query against its context, read in
 * place through its block table (no gathered copy of K/V), float32.
 *
 *   out[b, h] = softmax(cap(scale * q[b, h] . K[b, t, h / G])) @ V[b, t, h / G]
 *   K[b, t] = k_cache[tables[b, t / bs], t % bs], t in [first, lens[b]), first = lens[b] -
 *   window (0 without one); cap(s) = softcap * tanh(s / softcap), the identity when softcap == 0
 *
 * q: [B, H, D] with row stride q_row   k_cache, v_cache: [N, bs, KV, D] contiguous
 * tables: [B, W] int32 contiguous   lens: [B] int32   out: [B, H, D] contiguous
 *
 * One task per row: one pass over its keys, token by token (a token's keys of every head are
 * adjacent, so each block is read front to back), then one over its values; a query head h
 * reads kv head h / G. Scores live in a per-row buffer of H x L floats. Tasks run on the OpenMP threads of the process (torch's runtime:
 * the library links the libgomp torch loaded). Sums over D are reassociated for SIMD
 * (`omp simd reduction`), so results differ from SDPA's in the last bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int paged_decode_f32(const float *q, int64_t q_row, const float *k_cache, const float *v_cache,
                     const int32_t *tables, const int32_t *lens, float *out, int B, int H,
                     int KV, int D, int bs, int W, float scale, int window, float softcap) {
    const int G = H / KV;
    const int64_t block_stride = (int64_t)bs * KV * D, token_stride = (int64_t)KV * D;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int b = 0; b < B; b++) {
        const int len = lens[b];
        const int first = (window > 0 && len > window) ? len - window : 0;
        const int L = len - first;
        float *o = out + (int64_t)b * H * D;
        memset(o, 0, sizeof(float) * H * D);
        if (L <= 0) continue;
        float *scores = malloc(sizeof(float) * (size_t)H * L);  /* [H, L] */
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        const float *qb = q + b * q_row;
        const int32_t *table = tables + (int64_t)b * W;
        for (int t = first; t < len; t++) {  /* a token's keys of every head are adjacent */
            const float *k = k_cache + table[t / bs] * block_stride + (t % bs) * token_stride;
            for (int h = 0; h < H; h++) {
                const float *qh = qb + (int64_t)h * D, *kh = k + (int64_t)(h / G) * D;
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qh[d] * kh[d];
                s *= scale;
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                scores[(int64_t)h * L + (t - first)] = s;
            }
        }
        for (int h = 0; h < H; h++) {  /* softmax in place: max, exp, sum, scale */
            float *p = scores + (int64_t)h * L, m = p[0], sum = 0.0f;
            for (int i = 1; i < L; i++) m = p[i] > m ? p[i] : m;
            for (int i = 0; i < L; i++) {
                p[i] = expf(p[i] - m);
                sum += p[i];
            }
            const float inv = 1.0f / sum;
            for (int i = 0; i < L; i++) p[i] *= inv;
        }
        for (int t = first; t < len; t++) {
            const float *v = v_cache + table[t / bs] * block_stride + (t % bs) * token_stride;
            for (int h = 0; h < H; h++) {
                const float w = scores[(int64_t)h * L + (t - first)];
                const float *vh = v + (int64_t)(h / G) * D;
                float *oh = o + (int64_t)h * D;
#pragma omp simd
                for (int d = 0; d < D; d++) oh[d] += w * vh[d];
            }
        }
        free(scores);
    }
    return failed;
}

/* The step's new keys and values into their cache slots: row t of k and v (KV * D floats each,
 * rows `k_row` / `v_row` floats apart) to slot slots[t] of k_cache and v_cache. */
void cache_store_f32(const float *k, int64_t k_row, const float *v, int64_t v_row,
                     float *k_cache, float *v_cache, const int64_t *slots, int T, int width) {
    for (int t = 0; t < T; t++) {
        memcpy(k_cache + slots[t] * width, k + t * k_row, sizeof(float) * width);
        memcpy(v_cache + slots[t] * width, v + t * v_row, sizeof(float) * width);
    }
}
