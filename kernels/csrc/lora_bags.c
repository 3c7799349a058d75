/* LoRA deltas of a group of decode tokens on the CPU, each token through its own slot, from
 * the pool laid out as bag tables (kernels/cpu_dispatch.py BagTables, float32), x and out float32
 * (lora_bags_f32) or bfloat16 (lora_bags_bf16, uint16 storage: bf16.h):
 *
 *   y = x[row] @ A_s          A_s: slot s's H rows of `a` ([S * H, sum_r]: every slice's
 *                             ranks side by side), summed over h in order
 *   delta_i = y[cols_i] @ B_i,s   B_i,s: slot s's R_i rows of b_i ([S * R_i, width_i], scales
 *                             folded in), summed over r in order
 *   out[row, lo_i : lo_i + width_i] += delta_i   for each slice i with a table (b_i != 0)
 *
 * What F.embedding_bag(..., per_sample_weights) computes per bag, fused: one call per
 * projection instead of a bag per slice plus the casts, copies and adds around them. Each
 * delta is complete before it is added to out, as PEFT adds lora_B(lora_A(x)) * scale to the
 * base output. In bfloat16 each x element is widened in registers, the sums stay float32, and
 * the delta is rounded to bf16 before a bf16 add, as torch's `delta.to(out.dtype)` and `+=`
 * round it (kernels/reference.py). Tokens run on torch's OpenMP threads (the libgomp torch
 * loaded).
 *
 * With many adapters a step reads every token's own A and B from memory: the kernel is bound
 * by the bandwidth one thread draws. A thread walks up to MAX_GROUP tokens side by side (row h
 * of each one's A, then row r of each one's B), so that many streams are in flight at once:
 * ~20% faster than one token at a time at 32 tokens of 32 adapters on 2 cores (4 side by side;
 * 8 is slower again). Each token's sums keep their order, so results do not depend on it.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_GROUP 4

/* x and out float32 (is_bf16 == 0) or bfloat16: the element type is tested where x is read and
 * out written, once per row of A and per slice, outside the loops over its columns. */
static int bags(const void *x, int64_t x_row, void *out, int64_t out_row, const int64_t *rows,
                const int64_t *slots, int L, int H, const float *a, int sum_r, int n,
                const int32_t *cols, const int32_t *lo, const int32_t *width, const int64_t *b,
                int is_bf16) {
    int max_width = 1, failed = 0;
    for (int i = 0; i < n; i++) max_width = width[i] > max_width ? width[i] : max_width;
    /* tokens side by side: as many as keep every thread busy, at most MAX_GROUP */
    int group = L / omp_get_max_threads();
    group = group < 1 ? 1 : group > MAX_GROUP ? MAX_GROUP : group;
    const int num_groups = (L + group - 1) / group;
#pragma omp parallel
    {
        float *y = malloc(sizeof(float) * MAX_GROUP * (sum_r > 0 ? sum_r : 1));
        float *delta = malloc(sizeof(float) * MAX_GROUP * max_width);
        if (y == NULL || delta == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int p = 0; p < num_groups; p++) {
            if (y == NULL || delta == NULL) continue;
            const int first = p * group, m = L - first < group ? L - first : group;
            int64_t row[MAX_GROUP], slot[MAX_GROUP];
            for (int g = 0; g < m; g++) {
                row[g] = rows ? rows[first + g] : first + g;
                slot[g] = slots[first + g];
            }
            memset(y, 0, sizeof(float) * m * sum_r);
            for (int h = 0; h < H; h++) {
                for (int g = 0; g < m; g++) {
                    const int64_t at = row[g] * x_row + h;
                    const float xv = is_bf16 ? bf16_to_f32(((const bf16 *)x)[at])
                                             : ((const float *)x)[at];
                    const float *ar = a + (slot[g] * H + h) * sum_r;
                    float *yg = y + g * sum_r;
#pragma omp simd
                    for (int c = 0; c < sum_r; c++) yg[c] += xv * ar[c];
                }
            }
            for (int i = 0; i < n; i++) {
                if (!b[i]) continue;
                const int R = cols[i + 1] - cols[i], W = width[i];
                const float *bi = (const float *)(intptr_t)b[i];
                for (int g = 0; g < m; g++) memset(delta + g * max_width, 0, sizeof(float) * W);
                for (int r = 0; r < R; r++) {
                    for (int g = 0; g < m; g++) {
                        const float w = y[g * sum_r + cols[i] + r];
                        const float *br = bi + (slot[g] * R + r) * (int64_t)W;
                        float *d = delta + g * max_width;
#pragma omp simd
                        for (int o = 0; o < W; o++) d[o] += w * br[o];
                    }
                }
                for (int g = 0; g < m; g++) {
                    const int64_t at = row[g] * out_row + lo[i];
                    const float *d = delta + g * max_width;
                    if (is_bf16) {
                        bf16 *orow = (bf16 *)out + at;
#pragma omp simd
                        for (int o = 0; o < W; o++)
                            orow[o] = f32_to_bf16(bf16_to_f32(orow[o]) +
                                                  bf16_to_f32(f32_to_bf16(d[o])));
                    } else {
                        float *orow = (float *)out + at;
#pragma omp simd
                        for (int o = 0; o < W; o++) orow[o] += d[o];
                    }
                }
            }
        }
        free(y);
        free(delta);
    }
    return failed;
}

int lora_bags_f32(const float *x, int64_t x_row, float *out, int64_t out_row,
                  const int64_t *rows, const int64_t *slots, int L, int H, const float *a,
                  int sum_r, int n, const int32_t *cols, const int32_t *lo,
                  const int32_t *width, const int64_t *b) {
    return bags(x, x_row, out, out_row, rows, slots, L, H, a, sum_r, n, cols, lo, width, b, 0);
}

int lora_bags_bf16(const bf16 *x, int64_t x_row, bf16 *out, int64_t out_row,
                   const int64_t *rows, const int64_t *slots, int L, int H, const float *a,
                   int sum_r, int n, const int32_t *cols, const int32_t *lo,
                   const int32_t *width, const int64_t *b) {
    return bags(x, x_row, out, out_row, rows, slots, L, H, a, sum_r, n, cols, lo, width, b, 1);
}
