/* A projection through a quantized weight in kernels/quant.py's layout on the CPU, float32,
 * dequantizing in registers as it multiplies (kernels/cpu_quant.py):
 *
 *   W[o, k] = (q[o, k] - z[o, g]) * s[o, g]     g = k / group_size, or g_idx[row_slice[o], k]
 *   y[t, o] = sum_k x[t, k] * W[o, k]  (+ bias[o])
 *
 * Each weight element is the float32 `dequantize` gives (q - z exact, times s: one rounding), so
 * y differs from dequantize-then-F.linear only in the order of the sums. Two ways through, the
 * caller picks (`direct`):
 *   direct  each row's weights dequantized a UNIT of columns at a time and multiplied into up
 *           to DIRECT tokens' accumulators while in registers: nothing written but y (decode)
 *   tiled   a BLOCK_ROWS x CHUNK tile dequantized into a buffer that stays in L1, then
 *           multiplied by TOKENS x ROWS (tokens x rows) at a time, the weights dequantized
 *           once per TOKEN_BLOCK tokens
 * Output rows are split among torch's OpenMP threads. Act order looks each column's group up
 * through g_idx one element at a time (tiled only): correct, not fast.
 *
 * A unit is 2 x LANES columns of one group, from the group's start; the columns a group has
 * past its last whole unit go one at a time. A unit dequantizes to two vectors: int8 and fp8
 * its two halves; int4 its LANES bytes widened once, low nibbles (even columns) then high
 * nibbles (odd columns), so x is read through a copy with each unit's columns in that order (a
 * dot product does not care which order its terms come in). A tile's chunk of columns is whole
 * groups, or CHUNK columns of one group, so every chunk holds whole units.
 *
 * One algorithm over three sets of primitives: AVX-512, AVX2 + FMA + F16C, and scalar. e4m3 is
 * widened through float16: its exponent and mantissa bits moved into a half's, F16C converts,
 * and the 2^8 between the two exponent biases is folded into the scale (exact: a power of two).
 * The two NaN codes (S.1111.111) read as +-480 on every path; quantizers never write them (they
 * clamp at 448).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { INT4, INT8, FP8 };  /* kernels/quant.py KINDS, in order */
#define DIRECT 4           /* tokens one direct pass multiplies each dequantized unit into */
#define BLOCK_ROWS 24      /* rows of one tile (a multiple of ROWS) */
#define CHUNK 256          /* columns of one tile (a multiple of every UNIT): 24 KiB of floats */
#define TOKEN_BLOCK 64     /* tokens per pass over a block's weights (bounds the accumulators) */

static float FP8_VALUE[256];  /* e4m3 bits -> value, for the scalar path and the tails */

__attribute__((constructor)) static void fp8_table(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 15, m = b & 7;
        const float v = e ? ldexpf(8 + m, e - 10) : ldexpf(m, -9);  /* normal : subnormal */
        FP8_VALUE[b] = b & 0x80 ? -v : v;
    }
}

/* W[o, k] for any column k of row `row` (the scalar path, the tails and act order) */
static inline float weight_at(int kind, const uint8_t *row, int64_t k, int z, float s) {
    if (kind == INT4) return (float)(((row[k >> 1] >> (4 * (k & 1))) & 0xF) - 8 - z) * s;
    if (kind == INT8) return (float)((int8_t)row[k] - z) * s;
    return (FP8_VALUE[row[k]] - (float)z) * s;
}

/* Each set of primitives: vec, LANES, the micro-tile (TOKENS x ROWS accumulators, sized to the
 * register file), loads and stores (vload_n: the first n < LANES floats, the rest 0), and
 * dequant_unit: w[0], w[1] = the unit at column k (k even for int4) as the header says (zeroed:
 * whether z is subtracted; int4 always subtracts its 8).
 * REGISTER(v): v loaded into a register once (GCC would fold the load into each FMA that reads
 * v, doubling the micro-tile's loads). */
#if defined(__AVX512F__)
#define TOKENS 3  /* 3 x 6 accumulators + 3 x + 1 w of the 32 registers (4 x 6 spilled) */
#define ROWS 6
#define REGISTER(v) __asm__("" : "+v"(v))
typedef __m512 vec;
#define LANES 16
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline vec vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vec vload_n(const float *p, int n) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline void vstore(float *p, vec v) { _mm512_storeu_ps(p, v); }

static inline void dequant_unit(int kind, int zeroed, const uint8_t *row, int64_t k, int z,
                                float s, vec *w) {
    const vec scale = _mm512_set1_ps(kind == FP8 ? s * 256.0f : s);
    for (int h = 0; h < 2; h++) {
        if (kind == FP8) {
            __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + k + 16 * h)));
            b = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16((short)0xBF80));
            vec q = _mm512_cvtph_ps(b);
            if (zeroed) q = _mm512_sub_ps(q, _mm512_set1_ps(z / 256.0f));
            w[h] = _mm512_mul_ps(q, scale);
            continue;
        }
        __m512i q;
        if (kind == INT4) {
            q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + (k >> 1))));
            q = h ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(0xF));
            q = _mm512_sub_epi32(q, _mm512_set1_epi32(8 + z));
        } else {
            q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + k + 16 * h)));
            if (zeroed) q = _mm512_sub_epi32(q, _mm512_set1_epi32(z));
        }
        w[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale);
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENS 2  /* 2 x 6 accumulators + 2 x + 1 w of the 16 registers */
#define ROWS 6
#define REGISTER(v) __asm__("" : "+x"(v))
typedef __m256 vec;
#define LANES 8
static inline vec vzero(void) { return _mm256_setzero_ps(); }
static inline vec vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vec vload_n(const float *p, int n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
}
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline float vsum(vec v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline void vstore(float *p, vec v) { _mm256_storeu_ps(p, v); }

static inline void dequant_unit(int kind, int zeroed, const uint8_t *row, int64_t k, int z,
                                float s, vec *w) {
    const vec scale = _mm256_set1_ps(kind == FP8 ? s * 256.0f : s);
    for (int h = 0; h < 2; h++) {
        if (kind == FP8) {
            __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(row + k + 8 * h)));
            b = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16((short)0xBF80));
            vec q = _mm256_cvtph_ps(b);
            if (zeroed) q = _mm256_sub_ps(q, _mm256_set1_ps(z / 256.0f));
            w[h] = _mm256_mul_ps(q, scale);
            continue;
        }
        __m256i q;
        if (kind == INT4) {
            q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + (k >> 1))));
            q = h ? _mm256_srli_epi32(q, 4) : _mm256_and_si256(q, _mm256_set1_epi32(0xF));
            q = _mm256_sub_epi32(q, _mm256_set1_epi32(8 + z));
        } else {
            q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + k + 8 * h)));
            if (zeroed) q = _mm256_sub_epi32(q, _mm256_set1_epi32(z));
        }
        w[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), scale);
    }
}

#else
#define TOKENS 2
#define ROWS 6
#define REGISTER(v)
typedef float vec;
#define LANES 1
static inline vec vzero(void) { return 0.0f; }
static inline vec vload(const float *p) { return *p; }
static inline vec vload_n(const float *p, int n) { (void)p, (void)n; return 0.0f; }  /* unused */
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
static inline vec vadd(vec a, vec b) { return a + b; }
static inline float vsum(vec v) { return v; }
static inline void vstore(float *p, vec v) { *p = v; }
static inline void dequant_unit(int kind, int zeroed, const uint8_t *row, int64_t k, int z,
                                float s, vec *w) {
    (void)zeroed;  /* z is 0 without zero points: weight_at needs no second loop */
    w[0] = weight_at(kind, row, k, z, s);  /* a unit of two columns: already in order */
    w[1] = weight_at(kind, row, k + 1, z, s);
}
#endif

enum { UNIT = 2 * LANES };
#define INLINE static inline __attribute__((always_inline))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

struct problem {
    const float *x;   /* [T, I], rows x_row apart; int4: units' columns reordered */
    int64_t x_row;
    float *y;         /* [T, O], rows y_row apart */
    int64_t y_row;
    const float *bias;  /* [O] or NULL */
    int64_t T, O, I;
    int kind;
    const uint8_t *q;   /* [O, I or ceil(I / 2)], rows q_row apart */
    int64_t q_row;
    const float *scales;  /* [O, G] */
    const int8_t *zeros;  /* [O, G] or NULL */
    int64_t G, group_size;
    const int32_t *g_idx, *row_slice;  /* [n, I], [O], or NULL */
};

/* whether the group starting at column `start` goes by units: an int4 vector starts on a byte */
INLINE int has_units(int kind, int64_t start) {
    return LANES == 1 || kind != INT4 || !(start & 1);
}

/* whether x must be read with each unit's columns reordered (int4's nibbles, vectorised) */
static int reordered(const struct problem *p) { return LANES > 1 && p->kind == INT4 && !p->g_idx; }

/* out[t] = x[t] with each unit's columns even first, then odd (out: [T, I]) */
static void reorder_x(const struct problem *p, float *out) {
    for (int64_t t = 0; t < p->T; t++) {
        const float *x = p->x + t * p->x_row;
        float *o = out + t * p->I;
        for (int64_t k = 0, g = 0; k < p->I; g++) {
            const int64_t end = MIN((g + 1) * p->group_size, p->I);
            if (has_units(p->kind, k))
                for (; k + UNIT <= end; k += UNIT)
                    for (int j = 0; j < LANES; j++) {
                        o[k + j] = x[k + 2 * j];
                        o[k + LANES + j] = x[k + 2 * j + 1];
                    }
            for (; k < end; k++) o[k] = x[k];
        }
    }
}

/* a direct pass's sums for nt tokens: two FMA chains a token (four for a lone token, which
 * would otherwise wait on the FMA's latency), and the columns that go alone */
struct sums {
    vec acc[DIRECT][2], more[2];
    float tail[DIRECT];
};

/* sums += W[o, k : end] * x[t, k : end] unit by unit (one group, scale s, zero z); returns the
 * column where whole units stop */
INLINE int64_t direct_units(int kind, int zeroed, int nt, const uint8_t *row, int64_t k,
                            int64_t end, int z, float s, const float **x, struct sums *sum) {
    for (; nt == 1 && k + 2 * UNIT <= end; k += 2 * UNIT) {
        vec w[4];
        dequant_unit(kind, zeroed, row, k, z, s, w);
        dequant_unit(kind, zeroed, row, k + UNIT, z, s, w + 2);
        sum->acc[0][0] = vfma(w[0], vload(x[0] + k), sum->acc[0][0]);
        sum->acc[0][1] = vfma(w[1], vload(x[0] + k + LANES), sum->acc[0][1]);
        sum->more[0] = vfma(w[2], vload(x[0] + k + 2 * LANES), sum->more[0]);
        sum->more[1] = vfma(w[3], vload(x[0] + k + 3 * LANES), sum->more[1]);
    }
    for (; k + UNIT <= end; k += UNIT) {
        vec w[2];
        dequant_unit(kind, zeroed, row, k, z, s, w);
        for (int t = 0; t < nt; t++) {
            sum->acc[t][0] = vfma(w[0], vload(x[t] + k), sum->acc[t][0]);
            sum->acc[t][1] = vfma(w[1], vload(x[t] + k + LANES), sum->acc[t][1]);
        }
    }
    return k;
}

/* y[t0 : t0 + nt, o], each dequantized unit multiplied into the nt tokens' sums; zeroed:
 * whether the weight has zero points (without, int8 and fp8 skip a subtraction) */
INLINE void direct_row(const struct problem *p, int kind, int zeroed, int nt, int64_t o,
                       int64_t t0) {
    const uint8_t *row = p->q + o * p->q_row;
    const float *s = p->scales + o * p->G;
    const int8_t *z = p->zeros ? p->zeros + o * p->G : NULL;
    const int64_t size = p->group_size;
    const float *x[DIRECT];
    struct sums sum;
    sum.more[0] = sum.more[1] = vzero();
    for (int t = 0; t < nt; t++) {
        x[t] = p->x + (t0 + t) * p->x_row;
        sum.acc[t][0] = sum.acc[t][1] = vzero();
        sum.tail[t] = 0.0f;
    }
    /* whole groups of whole units first (every layout the tools write): a loop with no
     * column alone in it */
    const int64_t whole = size % UNIT ? 0 : p->I / size * size;
    int64_t k = 0, g = 0;
    for (; k < whole; g++)
        k = direct_units(kind, zeroed, nt, row, k, k + size, zeroed ? z[g] : 0, s[g], x, &sum);
    for (; k < p->I; g++) {  /* then a ragged last group, or groups of a size units do not fit */
        const int64_t end = MIN((g + 1) * size, p->I);
        const int zg = zeroed ? z[g] : 0;
        if (has_units(kind, k)) k = direct_units(kind, zeroed, nt, row, k, end, zg, s[g], x, &sum);
        for (; k < end; k++) {
            const float w = weight_at(kind, row, k, zg, s[g]);
            for (int t = 0; t < nt; t++) sum.tail[t] += w * x[t][k];
        }
    }
    sum.acc[0][0] = vadd(sum.acc[0][0], vadd(sum.more[0], sum.more[1]));
    for (int t = 0; t < nt; t++)
        p->y[(t0 + t) * p->y_row + o] = vsum(vadd(sum.acc[t][0], sum.acc[t][1])) + sum.tail[t]
                                        + (p->bias ? p->bias[o] : 0.0f);
}

static void direct_rows(const struct problem *p, int64_t o) {
    for (int64_t t0 = 0; t0 < p->T; t0 += DIRECT) {
        const int nt = (int)MIN(p->T - t0, DIRECT);
#define CASE(K, Z, N) case (K * 2 + Z) * 8 + N: direct_row(p, K, Z, N, o, t0); break;
#define CASES(K, Z) CASE(K, Z, 1) CASE(K, Z, 2) CASE(K, Z, 3) CASE(K, Z, 4)
        switch ((p->kind * 2 + (p->zeros != NULL)) * 8 + nt) {  /* a loop each */
            CASES(INT4, 0) CASES(INT4, 1) CASES(INT8, 0) CASES(INT8, 1) CASES(FP8, 0) CASES(FP8, 1)
        }
#undef CASES
#undef CASE
    }
}

/* where the chunk starting at c0 ends: whole groups, or CHUNK columns of one group */
static int64_t chunk_end(const struct problem *p, int64_t c0) {
    const int64_t size = p->group_size;
    const int64_t end = size < CHUNK ? c0 + CHUNK / size * size
                                     : MIN(c0 + CHUNK, (c0 / size + 1) * size);
    return MIN(end, p->I);
}

/* out[k - c0 : end - c0] = W[o, k : end] unit by unit (one group, scale s, zero z); returns the
 * column where whole units stop */
INLINE int64_t dequant_units(int kind, int zeroed, const uint8_t *row, int64_t k, int64_t end,
                             int z, float s, float *out) {
    for (; k + UNIT <= end; k += UNIT, out += UNIT) {
        vec w[2];
        dequant_unit(kind, zeroed, row, k, z, s, w);
        vstore(out, w[0]);
        vstore(out + LANES, w[1]);
    }
    return k;
}

/* out[0 : c1 - c0] = W[o, c0 : c1], each unit's columns in x's order */
INLINE void dequant_chunk(const struct problem *p, int kind, int zeroed, int64_t o, int64_t c0,
                          int64_t c1, float *out) {
    const uint8_t *row = p->q + o * p->q_row;
    const float *s = p->scales + o * p->G;
    const int8_t *z = p->zeros ? p->zeros + o * p->G : NULL;
    const int64_t size = p->group_size;
    if (p->g_idx) {
        const int32_t *g = p->g_idx + (int64_t)p->row_slice[o] * p->I;
        for (int64_t k = c0; k < c1; k++)
            out[k - c0] = weight_at(kind, row, k, zeroed ? z[g[k]] : 0, s[g[k]]);
        return;
    }
    int64_t k = c0, g = c0 / size;
    if (size % UNIT == 0)  /* whole units to the chunk's end, but in a ragged last group */
        for (const int64_t whole = MIN(c1, p->I / size * size); k < whole; g++)
            k = dequant_units(kind, zeroed, row, k, MIN((g + 1) * size, c1),
                              zeroed ? z[g] : 0, s[g], out + k - c0);
    for (; k < c1; g++) {
        const int64_t end = MIN((g + 1) * size, c1);
        const int zg = zeroed ? z[g] : 0;
        if (has_units(kind, g * size))
            k = dequant_units(kind, zeroed, row, k, end, zg, s[g], out + k - c0);
        for (; k < end; k++) out[k - c0] = weight_at(kind, row, k, zg, s[g]);
    }
}

/* dequant_chunk, a loop for each kind, with zero points and without */
static void dequant_tile(const struct problem *p, int64_t o, int64_t c0, int64_t c1, float *out) {
#define CASE(K, Z) case K * 2 + Z: dequant_chunk(p, K, Z, o, c0, c1, out); break;
    switch (p->kind * 2 + (p->zeros != NULL)) {
        CASE(INT4, 0) CASE(INT4, 1) CASE(INT8, 0) CASE(INT8, 1) CASE(FP8, 0) CASE(FP8, 1)
    }
#undef CASE
}

/* a[t][r] += xv[t] * w[r, k : k + LANES] for t < nt, r < ROWS (w's rows CHUNK floats apart) */
INLINE void micro_step(int nt, const vec *xv, const float *w, int64_t k, vec a[][ROWS]) {
    for (int r = 0; r < ROWS; r++) {
        vec wv = vload(w + r * CHUNK + k);
        REGISTER(wv);
        for (int t = 0; t < nt; t++) a[t][r] = vfma(wv, xv[t], a[t][r]);
    }
}

/* acc[t * BLOCK_ROWS + r] += x[t, :width] * w[r, :width] lane by lane, t < nt, r < ROWS; w 0
 * past width (where x's masked lanes read 0) */
INLINE void micro(int nt, const float *x, int64_t x_row, const float *w, int64_t width, vec *acc) {
    vec a[TOKENS][ROWS], xv[TOKENS];
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < ROWS; r++) a[t][r] = acc[t * BLOCK_ROWS + r];
    int64_t k = 0;
    for (; k + LANES <= width; k += LANES) {
        for (int t = 0; t < nt; t++) xv[t] = vload(x + t * x_row + k);
        micro_step(nt, xv, w, k, a);
    }
    if (k < width) {
        for (int t = 0; t < nt; t++) xv[t] = vload_n(x + t * x_row + k, (int)(width - k));
        micro_step(nt, xv, w, k, a);
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < ROWS; r++) acc[t * BLOCK_ROWS + r] = a[t][r];
}

/* y[:, o0 : o0 + BLOCK_ROWS]; buf: [BLOCK_ROWS, CHUNK], acc: [TOKEN_BLOCK, BLOCK_ROWS] */
static void tiled_block(const struct problem *p, int64_t o0, float *buf, vec *acc) {
    const int64_t rows = MIN(p->O - o0, BLOCK_ROWS);
    const int64_t micro_rows = (rows + ROWS - 1) / ROWS * ROWS;
    memset(buf + rows * CHUNK, 0, sizeof(float) * (micro_rows - rows) * CHUNK);  /* past O */
    for (int64_t t0 = 0; t0 < p->T; t0 += TOKEN_BLOCK) {
        const int64_t nt = MIN(p->T - t0, TOKEN_BLOCK);
        for (int64_t i = 0; i < nt * BLOCK_ROWS; i++) acc[i] = vzero();
        for (int64_t c0 = 0, c1; c0 < p->I; c0 = c1) {
            c1 = chunk_end(p, c0);
            const int64_t width = c1 - c0, padded = (width + LANES - 1) / LANES * LANES;
            for (int64_t r = 0; r < rows; r++) {
                dequant_tile(p, o0 + r, c0, c1, buf + r * CHUNK);
                for (int64_t k = width; k < padded; k++) buf[r * CHUNK + k] = 0.0f;
            }
            for (int64_t t = 0; t < nt; t += TOKENS) {
                const float *x = p->x + (t0 + t) * p->x_row + c0;
                const int m = (int)MIN(nt - t, TOKENS);
                for (int64_t r = 0; r < micro_rows; r += ROWS) {
                    vec *a = acc + t * BLOCK_ROWS + r;
                    const float *w = buf + r * CHUNK;
                    switch (m) {  /* each token count its own loop */
                        case 1: micro(1, x, p->x_row, w, width, a); break;
#if TOKENS > 2
                        case 2: micro(2, x, p->x_row, w, width, a); break;
#endif
                        default: micro(TOKENS, x, p->x_row, w, width, a);
                    }
                }
            }
        }
        for (int64_t t = 0; t < nt; t++)
            for (int64_t r = 0; r < rows; r++)
                p->y[(t0 + t) * p->y_row + o0 + r] = vsum(acc[t * BLOCK_ROWS + r])
                                                     + (p->bias ? p->bias[o0 + r] : 0.0f);
    }
}

/* y = x @ W.T (+ bias), W as the comment at the top says; kind 0 int4, 1 int8, 2 fp8; zeros,
 * bias, g_idx and row_slice may be NULL. Returns 0, 1 for an unknown kind or group size, 2
 * when out of memory. */
int quant_gemm_f32(const float *x, int64_t x_row, float *y, int64_t y_row, const float *bias,
                   int T, int O, int I, int kind, const uint8_t *q, int64_t q_row,
                   const float *scales, const int8_t *zeros, int G, int group_size,
                   const int32_t *g_idx, const int32_t *row_slice, int direct) {
    if (kind < INT4 || kind > FP8 || group_size < 1) return 1;
    struct problem p = {x, x_row, y, y_row, bias, T, O, I, kind, q, q_row,
                        scales, zeros, G, group_size, g_idx, row_slice};
    float *reordered_x = NULL;
    if (reordered(&p)) {
        if (!(reordered_x = malloc(sizeof(float) * ((size_t)T * I + 1)))) return 2;
        reorder_x(&p, reordered_x);
        p.x = reordered_x, p.x_row = I;
    }
    int failed = 0;  /* rows handed out as threads come free: one the OS delays holds no one */
    if (direct && !g_idx) {
#pragma omp parallel for schedule(dynamic, 16)
        for (int64_t o = 0; o < O; o++) direct_rows(&p, o);
    } else {
#pragma omp parallel
        {
            float *buf = aligned_alloc(64, sizeof(float) * BLOCK_ROWS * CHUNK);
            vec *acc = aligned_alloc(64, sizeof(vec) * TOKEN_BLOCK * BLOCK_ROWS);
            if (!buf || !acc) failed = 2;
#pragma omp for schedule(dynamic, 1)
            for (int64_t o0 = 0; o0 < O; o0 += BLOCK_ROWS)
                if (buf && acc) tiled_block(&p, o0, buf, acc);
            free(buf);
            free(acc);
        }
    }
    free(reordered_x);
    return failed;
}

/* floats per vector of the build: 16 (AVX-512), 8 (AVX2) or 1 (scalar) */
int quant_gemm_lanes(void) { return LANES; }
