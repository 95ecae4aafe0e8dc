/* Activations quantized to int8, one row at a time, for the integer kernels (linear_q8.c, linear_q4.c):
 * per block, d = max|x| / 127 and q = round(x * (127 / max|x|)), ties to even; an all-zero block gets
 * d = 0 and q = 0. Both kernels quantize through these two functions, so a block of x gets the same
 * values whichever kernel reads it. */
#include <immintrin.h>
#include <stdint.h>

/* The largest magnitude among the n values at x (n a multiple of 8). */
static inline float block_amax(const float *x, int64_t n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* The 32 values at x times `inv` (127 / the block's max|x|, or 0), rounded, as int8 in order. */
static inline __m256i quantize_step(const float *x, __m256 inv) {
    __m256i n[4];
    for (int i = 0; i < 4; i++)
        n[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    /* Packing works within 128-bit halves: the permute puts the 32 values back in order. */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* A block's scale d and the factor its values are multiplied by before rounding. */
static inline float block_scale(float amax, __m256 *inv) {
    *inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    return amax / 127.0f;
}
