/* Vectors of int32 lanes reduced to their sums, for the integer kernels (linear_q8.c, linear_q4.c),
 * and a tile's per-weight-row scales gathered into lanes. A decoding tile ends each block with one
 * integer per output; taken one vector at a time (a horizontal sum each), those sums cost as many
 * instructions as the block's products, so a tile's vectors are summed together, one output a lane.
 * Integer sums: any order gives the same exact value. */
#include <immintrin.h>
#include <stdint.h>

static inline int32_t hsum4_epi32(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* Two vectors' sums in lanes 0 and 1 (2 and 3 zero): lanes interleaved and added, then the halves. */
static inline __m128i sums_of2(__m256i a, __m256i b) {
    const __m256i t = _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    const __m256i h = _mm256_add_epi32(_mm256_unpacklo_epi64(t, _mm256_setzero_si256()), _mm256_unpackhi_epi64(t, _mm256_setzero_si256()));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

#ifdef __AVX512F__
/* Four vectors' sums, one a lane. */
static inline __m128i sums_of4(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}
#endif

/* The values at p, p + stride, ... of r weight rows, a lane each, zero past r. */
static inline __m128 per_row(const float *p, int64_t stride, const int r) {
    float v[4] = {0};
    for (int j = 0; j < r; j++) v[j] = p[j * stride];
    return _mm_loadu_ps(v);
}
