/* y = x W^T (+ b) for a few rows of x, with W in 4 bits: AVX-512 VNNI, OpenMP over the weight's rows.
 *
 * A draft model's forward over 1-3 tokens is bound by reading its weights. In 4 bits the 0.5B Qwen
 * draft's linear layers are 180 MB against int8's 360 MB, and this kernel reads them in 10-13 ms
 * where fbgemm's int8 product takes 17 (docs/benchmarks.md, section 4.7). From 4 rows on, fbgemm's
 * int8 is as fast, so `loading.Int4Linear` hands larger forwards to it.
 *
 * W: groups of GROUP weights along each row, one fp32 scale per group, values -8..7 stored as 0..15;
 * each 64-weight block takes 32 bytes, byte j holding weight j (low nibble) and weight j + 32 (high).
 * x: each row's groups quantized to int8 with their own scale, so one large activation (the draft
 * model has a few) coarsens only its group. VNNI multiplies the nibbles (unsigned) by those int8
 * values (signed) four at a time into int32; the stored offset of 8 comes off once per group, as
 * 8 x the group's sum of x. Every output is computed alone, so a row's result does not depend on
 * the other rows or on how many there are.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define GROUP 128
#define W_ROWS 2
#define X_ROWS 4

/* Each row of x by groups: int8 values, their scale, and the stored weights' offset of 8 times their sum. */
static void quantize(const float *x, int8_t *q, float *scales, float *offsets, int64_t M, int64_t K) {
    int64_t groups = K / GROUP;
    for (int64_t i = 0; i < M; i++)
        for (int64_t g = 0; g < groups; g++) {
            const float *r = x + i * K + g * GROUP;
            __m512 top = _mm512_setzero_ps();
            for (int k = 0; k < GROUP; k += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(r + k)));
            float largest = _mm512_reduce_max_ps(top), scale = largest > 0.0f ? largest / 127.0f : 1.0f;
            __m512 inverse = _mm512_set1_ps(1.0f / scale);
            __m512i total = _mm512_setzero_si512();
            for (int k = 0; k < GROUP; k += 16) {
                __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(r + k), inverse));
                total = _mm512_add_epi32(total, v);
                _mm_storeu_si128((__m128i *)(q + i * K + g * GROUP + k), _mm512_cvtsepi32_epi8(v));
            }
            scales[i * groups + g] = scale;
            offsets[i * groups + g] = 8.0f * scale * (float)_mm512_reduce_add_epi32(total);
        }
}

/* m rows of quantized x against wr rows of w; m and wr are constants in each instance, so the loops unroll. */
static inline __attribute__((always_inline)) void tile(const int8_t *x, const float *xs, const float *xo, const uint8_t *w,
                                                       const float *ws, float *out, const int m, const int wr, int64_t K,
                                                       int64_t N) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const int64_t groups = K / GROUP, row_bytes = K / 2;
    __m512 acc[W_ROWS][X_ROWS];
    for (int r = 0; r < wr; r++)
        for (int i = 0; i < m; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i dot[W_ROWS][X_ROWS];
        for (int r = 0; r < wr; r++)
            for (int i = 0; i < m; i++) dot[r][i] = _mm512_setzero_si512();
        for (int c = 0; c < GROUP; c += 64) {
            __m512i wv[W_ROWS];
            for (int r = 0; r < wr; r++) {
                __m256i bytes = _mm256_loadu_si256((const __m256i *)(w + r * row_bytes + (g * GROUP + c) / 2));
                __m256i low = _mm256_and_si256(bytes, nibble), high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
                wv[r] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
            }
            for (int i = 0; i < m; i++) {
                __m512i xv = _mm512_loadu_si512(x + i * K + g * GROUP + c);
                for (int r = 0; r < wr; r++) dot[r][i] = _mm512_dpbusd_epi32(dot[r][i], wv[r], xv);
            }
        }
        __m512 sw[W_ROWS];
        for (int r = 0; r < wr; r++) sw[r] = _mm512_set1_ps(ws[r * groups + g]);
        for (int i = 0; i < m; i++) {
            __m512 sx = _mm512_set1_ps(xs[i * groups + g]);
            for (int r = 0; r < wr; r++) acc[r][i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot[r][i]), sx), sw[r], acc[r][i]);
        }
    }
    for (int r = 0; r < wr; r++)
        for (int i = 0; i < m; i++) {
            float offset = 0.0f;
            for (int64_t g = 0; g < groups; g++) offset += ws[r * groups + g] * xo[i * groups + g];
            out[i * N + r] = _mm512_reduce_add_ps(acc[r][i]) - offset;
        }
}

#define TILE(m)                                                                                                        \
    static void tile##m(const int8_t *x, const float *xs, const float *xo, const uint8_t *w, const float *ws, float *out, \
                        int64_t K, int64_t N) {                                                                        \
        tile(x, xs, xo, w, ws, out, m, W_ROWS, K, N);                                                                  \
    }
typedef void (*tile_fn)(const int8_t *, const float *, const float *, const uint8_t *, const float *, float *, int64_t,
                        int64_t);
TILE(1) TILE(2) TILE(3) TILE(4)
static const tile_fn TILES[X_ROWS + 1] = {0, tile1, tile2, tile3, tile4};

/* x: M x K fp32; w: N x K/2 bytes; scales: N x K/GROUP; bias: N or NULL; out: M x N; all contiguous,
 * K a multiple of GROUP. */
void int4_linear(const float *x, const uint8_t *w, const float *scales, const float *bias, float *out, int64_t M,
                 int64_t N, int64_t K, int threads) {
    int64_t tiles = N / W_ROWS, groups = K / GROUP;
    int8_t *q = malloc(M * K);
    float *xs = malloc(M * groups * sizeof(float)), *xo = malloc(M * groups * sizeof(float));
    quantize(x, q, xs, xo, M, K);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n = t * W_ROWS;
        for (int64_t m0 = 0; m0 < M; m0 += X_ROWS) {
            int64_t m = M - m0 < X_ROWS ? M - m0 : X_ROWS;
            TILES[m](q + m0 * K, xs + m0 * groups, xo + m0 * groups, w + n * (K / 2), scales + n * groups,
                     out + m0 * N + n, K, N);
        }
    }
    for (int64_t n = tiles * W_ROWS; n < N; n++)
        for (int64_t i = 0; i < M; i++)
            tile(q + i * K, xs + i * groups, xo + i * groups, w + n * (K / 2), scales + n * groups, out + i * N + n, 1, 1,
                 K, N);
    if (bias)
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < N; n++) out[i * N + n] += bias[n];
    free(q), free(xs), free(xo);
}
