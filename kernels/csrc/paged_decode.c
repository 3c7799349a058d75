/* Paged decode attention on the CPU: each decode row's one query against its context, read in
 * place through its block table (no gathered copy of K/V), in float32 or bfloat16.
 *
 *   out[b, h] = softmax(cap(scale * q[b, h] . K[b, t, h / G])) @ V[b, t, h / G]
 *   K[b, t] = k_cache[tables[b, t / bs], t % bs], t in [first, lens[b]), first = lens[b] -
 *   window (0 without one); cap(s) = softcap * tanh(s / softcap), the identity when softcap == 0
 *
 * q: [B, H, D] with row stride q_row   k_cache, v_cache: [N, bs, KV, D] contiguous
 * tables: [B, W] int32 contiguous   lens: [B] int32   out: [B, H, D] contiguous
 * q, the caches and out are all float32 (paged_decode_f32) or all bfloat16 (paged_decode_bf16,
 * uint16 storage: bf16.h): a bf16 engine's cache is read as it is held, each element widened
 * in registers, scores, softmax and sums in float32; as torch's bf16 SDPA (the torch decode
 * path, and Hugging Face's attention) each exp(s - max) is rounded to bf16 before it weighs V
 * and the float32 sum divides after, and out is rounded to bf16 at the end.
 *
 * One task per row: one pass over its keys, token by token (a token's keys of every head are
 * adjacent, so each block is read front to back), then one over its values; a query head h
 * reads kv head h / G. Scores live in a per-row buffer of H x L floats. Tasks run on the
 * OpenMP threads of the process (torch's runtime: the library links the libgomp torch
 * loaded). Sums over D are reassociated for SIMD
 * (`omp simd reduction`; vdpbf16ps pairs on AVX-512 BF16), so results differ from SDPA's in
 * the last bits.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

static inline float dot_f32(const float *q, const float *k, int D) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < D; d++) s += q[d] * k[d];
    return s;
}

static inline float dot_bf16(const bf16 *q, const bf16 *k, int D) {
#if defined(__AVX512BF16__)
    /* vdpbf16ps: 32 products a step (each exact in float32), summed in pairs into 16 lanes */
    __m512 acc = _mm512_setzero_ps();
    int d = 0;
    for (; d + 32 <= D; d += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d),
                               (__m512bh)_mm512_loadu_si512(k + d));
    if (d < D) {  /* the tail, zero-filled: 0 * 0 adds nothing */
        const __mmask32 tail = (__mmask32)((1u << (D - d)) - 1u);
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(tail, q + d),
                               (__m512bh)_mm512_maskz_loadu_epi16(tail, k + d));
    }
    return _mm512_reduce_add_ps(acc);
#else
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int d = 0; d < D; d++) s += bf16_to_f32(q[d]) * bf16_to_f32(k[d]);
    return s;
#endif
}

/* o[d] += w * v[d] over D */
static inline void axpy_f32(float *o, float w, const float *v, int D) {
#pragma omp simd
    for (int d = 0; d < D; d++) o[d] += w * v[d];
}

static inline void axpy_bf16(float *o, float w, const bf16 *v, int D) {
#pragma omp simd
    for (int d = 0; d < D; d++) o[d] += w * bf16_to_f32(v[d]);
}

/* Row b of the kernel, over float32 (is_bf16 == 0) or bfloat16 elements of q, the caches and
 * out; inlined into each entry point's parallel loop with is_bf16 a constant. Returns 1 when
 * its score buffer could not be allocated (out[b] is then zeros). */
static inline __attribute__((always_inline)) int decode_row(
        const void *q, int64_t q_row, const void *k_cache, const void *v_cache,
        const int32_t *tables, const int32_t *lens, void *out, int b, int H, int KV, int D,
        int bs, int W, float scale, int window, float softcap, int is_bf16) {
    const int G = H / KV;
    const int64_t block_stride = (int64_t)bs * KV * D, token_stride = (int64_t)KV * D;
    const size_t size = is_bf16 ? sizeof(bf16) : sizeof(float);
    const int len = lens[b];
    const int first = (window > 0 && len > window) ? len - window : 0;
    const int L = len - first;
    char *out_b = (char *)out + (size_t)b * H * D * size;
    memset(out_b, 0, size * H * D);
    if (L <= 0) return 0;
    /* [H, L] scores, then for bf16 the [H, D] float32 sums its out is rounded from */
    float *scores = malloc(sizeof(float) * ((size_t)H * L + (is_bf16 ? (size_t)H * D : 0)));
    if (scores == NULL) return 1;
    float *o = is_bf16 ? scores + (size_t)H * L : (float *)out_b;
    if (is_bf16) memset(o, 0, sizeof(float) * H * D);
    const int64_t q_b = b * q_row;
    const int32_t *table = tables + (int64_t)b * W;
    for (int t = first; t < len; t++) {  /* a token's keys of every head are adjacent */
        const int64_t k_t = table[t / bs] * block_stride + (t % bs) * token_stride;
        for (int h = 0; h < H; h++) {
            const int64_t q_h = q_b + (int64_t)h * D, k_h = k_t + (int64_t)(h / G) * D;
            float s = is_bf16 ? dot_bf16((const bf16 *)q + q_h, (const bf16 *)k_cache + k_h, D)
                              : dot_f32((const float *)q + q_h, (const float *)k_cache + k_h, D);
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
        if (is_bf16)  /* SDPA's bf16 kernel rounds exp(s - max) to bf16 before it weighs V */
            for (int i = 0; i < L; i++) p[i] = bf16_to_f32(f32_to_bf16(p[i])) * inv;
        else
            for (int i = 0; i < L; i++) p[i] *= inv;
    }
    for (int t = first; t < len; t++) {
        const int64_t v_t = table[t / bs] * block_stride + (t % bs) * token_stride;
        for (int h = 0; h < H; h++) {
            const float w = scores[(int64_t)h * L + (t - first)];
            const int64_t v_h = v_t + (int64_t)(h / G) * D;
            if (is_bf16)
                axpy_bf16(o + (int64_t)h * D, w, (const bf16 *)v_cache + v_h, D);
            else
                axpy_f32(o + (int64_t)h * D, w, (const float *)v_cache + v_h, D);
        }
    }
    if (is_bf16) {
        bf16 *ob = (bf16 *)out_b;
#pragma omp simd
        for (int i = 0; i < H * D; i++) ob[i] = f32_to_bf16(o[i]);
    }
    free(scores);
    return 0;
}

int paged_decode_f32(const float *q, int64_t q_row, const float *k_cache, const float *v_cache,
                     const int32_t *tables, const int32_t *lens, float *out, int B, int H,
                     int KV, int D, int bs, int W, float scale, int window, float softcap) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int b = 0; b < B; b++)
        if (decode_row(q, q_row, k_cache, v_cache, tables, lens, out, b, H, KV, D, bs, W, scale,
                       window, softcap, 0)) failed = 1;
    return failed;
}

int paged_decode_bf16(const bf16 *q, int64_t q_row, const bf16 *k_cache, const bf16 *v_cache,
                      const int32_t *tables, const int32_t *lens, bf16 *out, int B, int H,
                      int KV, int D, int bs, int W, float scale, int window, float softcap) {
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int b = 0; b < B; b++)
        if (decode_row(q, q_row, k_cache, v_cache, tables, lens, out, b, H, KV, D, bs, W, scale,
                       window, softcap, 1)) failed = 1;
    return failed;
}

/* The step's new keys and values into their cache slots: row t of k and v (`width` elements of
 * `size` bytes each, rows `k_row` / `v_row` elements apart) to slot slots[t] of the caches. */
static void store(const char *k, int64_t k_row, const char *v, int64_t v_row, char *k_cache,
                  char *v_cache, const int64_t *slots, int T, int width, size_t size) {
    const size_t bytes = size * width;
    for (int t = 0; t < T; t++) {
        memcpy(k_cache + slots[t] * bytes, k + t * k_row * size, bytes);
        memcpy(v_cache + slots[t] * bytes, v + t * v_row * size, bytes);
    }
}

void cache_store_f32(const float *k, int64_t k_row, const float *v, int64_t v_row,
                     float *k_cache, float *v_cache, const int64_t *slots, int T, int width) {
    store((const char *)k, k_row, (const char *)v, v_row, (char *)k_cache, (char *)v_cache,
          slots, T, width, sizeof(float));
}

void cache_store_bf16(const bf16 *k, int64_t k_row, const bf16 *v, int64_t v_row,
                      bf16 *k_cache, bf16 *v_cache, const int64_t *slots, int T, int width) {
    store((const char *)k, k_row, (const char *)v, v_row, (char *)k_cache, (char *)v_cache,
          slots, T, width, sizeof(bf16));
}
