/* Attention of a few bf16 query rows over a bf16 key/value cache, in fp32 (AVX-512F); OpenMP over
 * query heads x rows.
 *
 * torch's CPU attention kernel is slow in bf16 for the few query rows of decoding. Here
 * each query row is computed on its own, by a fixed sequence of operations over the entries it
 * sees: scores by 16-lane dot products, probabilities lane by lane (an entry's does not depend on
 * where it sits), their sum and the weighted sum of values accumulated entry after entry; masked
 * entries get probability exactly 0, which changes no sum. So a row's result does not depend on the other rows of
 * the forward nor on masked entries between the ones it sees: verifying a draft tree gives each
 * accepted token the bits plain decoding gives it. One rounding to bf16 (nearest even) at the end.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define EXP_FLOOR -87.0f /* below, exp underflows fp32's normal range: the probability is 0 */

static inline __m512 load_bf16(const uint16_t *p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* exp(x) for x <= 0, lane by lane (Cephes' expf polynomial); 0 below EXP_FLOOR. */
static inline __m512 exp_ps(__m512 x) {
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1); /* nearest, ties to even */
    return (uint16_t)(u >> 16);
}

/* Rows of the query vectors of one block: the vectors (query head, row) of one key/value head. */
#define BLOCK 4
/* Chunks of the value vectors summed per pass over the entries (BLOCK x PASS accumulators). */
#define PASS 4

/* q: [heads, rows, dims]; k, v: [kv_heads, length, dims] with heads `*_head_stride` elements apart;
 * mask: [rows, length] added to the scaled scores, or NULL; out: [heads, rows, dims]. Query head h
 * reads key/value head h / (heads / kv_heads). dims: a multiple of 16.
 *
 * A block shares each load of a key or value chunk between up to BLOCK query vectors of the same
 * key/value head; every vector's own sums run in the same order whatever its block holds. */
void small_attention(const uint16_t *q, const uint16_t *k, const uint16_t *v, const float *mask, uint16_t *out,
                     int64_t heads, int64_t kv_heads, int64_t rows, int64_t length, int64_t dims,
                     int64_t k_head_stride, int64_t v_head_stride, float scale, int threads) {
    const int64_t group = heads / kv_heads, chunks = dims / 16, padded = (length + 15) / 16 * 16;
    const int64_t vectors = group * rows, blocks = (vectors + BLOCK - 1) / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        float *p = malloc(sizeof(float) * BLOCK * padded);
        float *query = malloc(sizeof(float) * BLOCK * dims);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < kv_heads * blocks; task++) {
            const int64_t g = task / blocks, first = task % blocks * BLOCK;
            const int64_t n = vectors - first < BLOCK ? vectors - first : BLOCK;
            const uint16_t *keys = k + g * k_head_stride, *values = v + g * v_head_stride;
            /* Vector b is query head g * group + (first + b) / rows, row (first + b) % rows: both
             * index [heads, rows] as one run, starting at head g * group. */
            const int64_t base = g * group * rows + first;
            for (int64_t b = 0; b < n; b++)
                for (int64_t c = 0; c < chunks; c++) _mm512_storeu_ps(query + b * dims + 16 * c, load_bf16(q + (base + b) * dims + 16 * c));
            float top[BLOCK], total[BLOCK];
            for (int64_t b = 0; b < n; b++) top[b] = -INFINITY, total[b] = 0.0f;
            for (int64_t j = 0; j < length; j++) {
                __m512 dot[BLOCK];
                for (int64_t b = 0; b < n; b++) dot[b] = _mm512_setzero_ps();
                for (int64_t c = 0; c < chunks; c++) {
                    const __m512 key = load_bf16(keys + j * dims + 16 * c);
                    for (int64_t b = 0; b < n; b++) dot[b] = _mm512_fmadd_ps(_mm512_loadu_ps(query + b * dims + 16 * c), key, dot[b]);
                }
                for (int64_t b = 0; b < n; b++) {
                    float s = _mm512_reduce_add_ps(dot[b]) * scale;
                    if (mask) s += mask[(first + b) % rows * length + j];
                    p[b * padded + j] = s;
                    top[b] = s > top[b] ? s : top[b];
                }
            }
            for (int64_t b = 0; b < n; b++) {
                float *row = p + b * padded;
                for (int64_t j = length; j < padded; j++) row[j] = -INFINITY;
                const __m512 shift = _mm512_set1_ps(top[b]);
                for (int64_t j = 0; j < padded; j += 16) _mm512_storeu_ps(row + j, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift)));
                for (int64_t j = 0; j < length; j++) total[b] += row[j];
            }
            /* Masked entries have probability 0, and adding 0 x value changes no sum. */
            for (int64_t c0 = 0; c0 < chunks; c0 += PASS) {
                const int64_t width = chunks - c0 < PASS ? chunks - c0 : PASS;
                __m512 acc[BLOCK][PASS];
                for (int64_t b = 0; b < n; b++)
                    for (int64_t c = 0; c < width; c++) acc[b][c] = _mm512_setzero_ps();
                for (int64_t j = 0; j < length; j++)
                    for (int64_t c = 0; c < width; c++) {
                        const __m512 value = load_bf16(values + j * dims + 16 * (c0 + c));
                        for (int64_t b = 0; b < n; b++) acc[b][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[b * padded + j]), value, acc[b][c]);
                    }
                for (int64_t b = 0; b < n; b++)
                    for (int64_t c = 0; c < width; c++) {
                        float lanes[16];
                        _mm512_storeu_ps(lanes, _mm512_mul_ps(acc[b][c], _mm512_set1_ps(1.0f / total[b])));
                        for (int l = 0; l < 16; l++) out[(base + b) * dims + 16 * (c0 + c) + l] = to_bf16(lanes[l]);
                    }
            }
        }
        free(query);
        free(p);
    }
}
