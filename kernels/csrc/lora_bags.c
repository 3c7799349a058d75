/* LoRA deltas of a group of decode tokens on the CPU, each token through its own slot, from
 * the pool laid out as bag tables (kernels/cpu_dispatch.py BagTables), float32:
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
 * base output. Tokens run on torch's OpenMP threads (the libgomp torch loaded).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int lora_bags_f32(const float *x, int64_t x_row, float *out, int64_t out_row,
                  const int64_t *rows, const int64_t *slots, int L, int H, const float *a,
                  int sum_r, int n, const int32_t *cols, const int32_t *lo,
                  const int32_t *width, const int64_t *b) {
    int max_width = 1, failed = 0;
    for (int i = 0; i < n; i++) max_width = width[i] > max_width ? width[i] : max_width;
#pragma omp parallel
    {
        float *y = malloc(sizeof(float) * (sum_r > 0 ? sum_r : 1));
        float *delta = malloc(sizeof(float) * max_width);
        if (y == NULL || delta == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int t = 0; t < L; t++) {
            if (y == NULL || delta == NULL) continue;
            const int64_t row = rows ? rows[t] : t, s = slots[t];
            const float *xr = x + row * x_row, *as = a + s * H * sum_r;
            memset(y, 0, sizeof(float) * sum_r);
            for (int h = 0; h < H; h++) {
                const float xv = xr[h], *ar = as + (int64_t)h * sum_r;
#pragma omp simd
                for (int c = 0; c < sum_r; c++) y[c] += xv * ar[c];
            }
            for (int i = 0; i < n; i++) {
                if (!b[i]) continue;
                const int R = cols[i + 1] - cols[i], W = width[i];
                const float *bs = (const float *)(intptr_t)b[i] + s * R * W;
                memset(delta, 0, sizeof(float) * W);
                for (int r = 0; r < R; r++) {
                    const float w = y[cols[i] + r], *br = bs + (int64_t)r * W;
#pragma omp simd
                    for (int o = 0; o < W; o++) delta[o] += w * br[o];
                }
                float *orow = out + row * out_row + lo[i];
#pragma omp simd
                for (int o = 0; o < W; o++) orow[o] += delta[o];
            }
        }
        free(y);
        free(delta);
    }
    return failed;
}
