/* A decoder layer's elementwise work on the CPU in float32 or bfloat16, one call where torch
 * runs a chain of small ops (each its own dispatch, allocation and pass over memory):
 *
 *   add_rms_norm  sum = x + delta (when delta), out = w * (sum * rsqrt(mean(sum^2) + eps))
 *   rotary        out = q * cos + rotate_half(q) * sin, per head, for q's and k's heads
 *
 * The products and sums are rounded where Hugging Face's ops round them (no fused multiply-
 * add: contraction is off in this file), so rotary is bit-identical to torch's; the norm's mean
 * sums in another order, a last-bit difference of the kind oneDNN's GEMM already makes. Rows
 * run on torch's OpenMP threads. (SiLU-and-mul stays torch's: its exp is compute-bound, and a
 * vectorized exp here ran no faster than torch's two ops.)
 *
 * The _bf16 functions take bfloat16 tensors (uint16 storage: bf16.h), widen each element in
 * registers, compute in float32 and round to bf16 after every op torch runs in bf16 (the
 * residual sum, the normalized row before the weight, each product and sum of rotary), so
 * rotary is bit-identical to torch's bf16 ops too, and the norm up to its mean's order.
 */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>

#include "bf16.h"

void add_rms_norm_f32(const float *x, int64_t x_row, const float *delta, int64_t delta_row,
                      const float *w, float eps, float *sum, int64_t sum_row, float *out,
                      int64_t out_row, int T, int H) {
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const float *xr = x + t * x_row;
        float *orow = out + t * out_row;
        if (delta) {  /* the residual stream first: what the norm reads */
            const float *dr = delta + t * delta_row;
            float *sr = sum + t * sum_row;
#pragma omp simd
            for (int h = 0; h < H; h++) sr[h] = xr[h] + dr[h];
            xr = sr;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int h = 0; h < H; h++) squares += xr[h] * xr[h];
        const float r = 1.0f / sqrtf(squares / (float)H + eps);
#pragma omp simd
        for (int h = 0; h < H; h++) orow[h] = w[h] * (xr[h] * r);
    }
}

/* src: [T, heads, D] at (row, head) strides; dst: [T, heads, D] contiguous; cos, sin: [T, D]. */
static void rotate(const float *src, int64_t row, int64_t head, int heads, float *dst,
                   const float *cos, const float *sin, int T, int D) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
        for (int n = 0; n < heads; n++) {
            const float *v = src + t * row + n * head;
            float *o = dst + ((int64_t)t * heads + n) * D;
#pragma omp simd
            for (int i = 0; i < half; i++) o[i] = v[i] * c[i] + (-v[i + half]) * s[i];
#pragma omp simd
            for (int i = half; i < D; i++) o[i] = v[i] * c[i] + v[i - half] * s[i];
        }
    }
}

void rotary_f32(const float *q, int64_t q_row, int64_t q_head, int q_heads, const float *k,
                int64_t k_row, int64_t k_head, int k_heads, const float *cos, const float *sin,
                float *q_out, float *k_out, int T, int D) {
    rotate(q, q_row, q_head, q_heads, q_out, cos, sin, T, D);
    rotate(k, k_row, k_head, k_heads, k_out, cos, sin, T, D);
}

/* As add_rms_norm_f32, rounding where Hugging Face's bf16 RMSNorm does: sum = bf16(x + delta),
 * out = bf16(w * bf16(sum * r)), r from the float32 mean of the rounded sum's squares. */
void add_rms_norm_bf16(const bf16 *x, int64_t x_row, const bf16 *delta, int64_t delta_row,
                       const bf16 *w, float eps, bf16 *sum, int64_t sum_row, bf16 *out,
                       int64_t out_row, int T, int H) {
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const bf16 *xr = x + t * x_row;
        bf16 *orow = out + t * out_row;
        if (delta) {
            const bf16 *dr = delta + t * delta_row;
            bf16 *sr = sum + t * sum_row;
#pragma omp simd
            for (int h = 0; h < H; h++)
                sr[h] = f32_to_bf16(bf16_to_f32(xr[h]) + bf16_to_f32(dr[h]));
            xr = sr;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int h = 0; h < H; h++) squares += bf16_to_f32(xr[h]) * bf16_to_f32(xr[h]);
        const float r = 1.0f / sqrtf(squares / (float)H + eps);
#pragma omp simd
        for (int h = 0; h < H; h++) {
            const float normed = bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[h]) * r));
            orow[h] = f32_to_bf16(bf16_to_f32(w[h]) * normed);
        }
    }
}

/* bf16(bf16(v * c) + bf16(turned * s)): one rotary element as torch's bf16 ops round it */
static inline bf16 rotated_bf16(bf16 v, bf16 c, float turned, bf16 s) {
    const float a = bf16_to_f32(f32_to_bf16(bf16_to_f32(v) * bf16_to_f32(c)));
    const float b = bf16_to_f32(f32_to_bf16(turned * bf16_to_f32(s)));
    return f32_to_bf16(a + b);
}

/* rotate over bfloat16 */
static void rotate_bf16(const bf16 *src, int64_t row, int64_t head, int heads, bf16 *dst,
                        const bf16 *cos, const bf16 *sin, int T, int D) {
    const int half = D / 2;
#pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const bf16 *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
        for (int n = 0; n < heads; n++) {
            const bf16 *v = src + t * row + n * head;
            bf16 *o = dst + ((int64_t)t * heads + n) * D;
#pragma omp simd
            for (int i = 0; i < half; i++)
                o[i] = rotated_bf16(v[i], c[i], -bf16_to_f32(v[i + half]), s[i]);
#pragma omp simd
            for (int i = half; i < D; i++)
                o[i] = rotated_bf16(v[i], c[i], bf16_to_f32(v[i - half]), s[i]);
        }
    }
}

void rotary_bf16(const bf16 *q, int64_t q_row, int64_t q_head, int q_heads, const bf16 *k,
                 int64_t k_row, int64_t k_head, int k_heads, const bf16 *cos, const bf16 *sin,
                 bf16 *q_out, bf16 *k_out, int T, int D) {
    rotate_bf16(q, q_row, q_head, q_heads, q_out, cos, sin, T, D);
    rotate_bf16(k, k_row, k_head, k_heads, k_out, cos, sin, T, D);
}
