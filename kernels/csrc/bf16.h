/* bfloat16 as the CPU kernels hold it: uint16_t storage, the upper half of a float32.
 *
 * To float32: a 16-bit left shift, exact. To bfloat16: round to nearest, ties to even, as
 * torch rounds (c10::BFloat16), a NaN kept a NaN. Both are integer operations the compiler
 * vectorizes inside `omp simd` loops (with AVX2: vpmovzxwd + vpslld, and vpsrld + vpackusdw
 * back). Stores keep this rounding on AVX-512 BF16 too: vcvtneps2bf16 flushes denormals to
 * zero, which torch's rounding does not.
 */
#ifndef LORAGW_BF16_H
#define LORAGW_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16 f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  /* NaN: torch's quiet NaN */
    return (bf16)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#endif
