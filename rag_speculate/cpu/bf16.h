/* bf16 values as torch holds them (the top 16 bits of an fp32), widened exactly and rounded as torch
 * rounds fp32 to bf16 (c10::BFloat16: to nearest, ties to even; NaN to 0x7FC0). A bf16 operator in
 * torch on the CPU computes in fp32 and rounds its result once: these two give a kernel its bits. */
#include <stdint.h>
#include <string.h>

static inline float bf16_widen(uint16_t v) {
    const uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_round(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return f != f ? 0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

/* A kernel built for fp32 or, with -DVALUES_BF16, for bf16 (norm.c, rotary.c) reads and writes
 * `value`s: WIDEN gives one's fp32, ROUND an fp32 result as a value (exact, or rounded as torch rounds). */
#ifdef VALUES_BF16
typedef uint16_t value;
#define WIDEN(v) bf16_widen(v)
#define ROUND(f) bf16_round(f)
#else
typedef float value;
#define WIDEN(v) (v)
#define ROUND(f) (f)
#endif

/* Row i of x, K values in fp32 or bf16 (bf16 1), as fp32: in place, or widened into `buf`. */
static inline const float *row_fp32(const void *x, int64_t i, int64_t K, int bf16, float *buf) {
    if (!bf16) return (const float *)x + i * K;
    const uint16_t *src = (const uint16_t *)x + i * K;
    for (int64_t k = 0; k < K; k++) buf[k] = bf16_widen(src[k]);
    return buf;
}

/* out[at] = v, out fp32 or bf16 (rounded). */
static inline void put(void *out, int64_t at, float v, int bf16) {
    if (bf16)
        ((uint16_t *)out)[at] = bf16_round(v);
    else
        ((float *)out)[at] = v;
}
