/* y = x W^T (+ b) for a few rows of x, fp32 (AVX-512F or AVX2 + FMA) or, built with
 * -DSMALL_LINEAR_BF16, bf16 (AVX512-BF16); OpenMP over the weight's rows.
 *
 * Decoding and verifying a draft multiply 1 to 24 rows by every weight matrix, so the product is
 * bound by reading the weights once from memory. Each weight row is read once, and used against
 * all rows of x while it is in registers; BLAS GEMMs pack the weights first (a second pass over
 * them), and MKL's GEMV and torch's bf16 product read them more slowly for a single row.
 *
 * A tile of W_ROWS weight rows x up to X_ROWS rows of x keeps its accumulators in registers and
 * shares each load of x between the weight rows. With AVX-512's 32 registers a tile of 8 x 3
 * (24 accumulators) reads 8 weight rows at once, which keeps more of memory's bandwidth busy than
 * AVX2's 2 x 6 on 16 registers.
 * Every output is summed in the same order whatever the number of rows, so a token's logits do
 * not depend on how many others were verified beside it. bf16 sums pairs of products in fp32
 * (vdpbf16ps) and rounds each output once, to the nearest even, as torch's bf16 product does.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX512F__
#define W_ROWS 8
#define X_ROWS 3
typedef __m512 acc_t;
#define zero() _mm512_setzero_ps()
#define sum(v) _mm512_reduce_add_ps(v)
#else
#define W_ROWS 2
#define X_ROWS 6
typedef __m256 acc_t;
#define zero() _mm256_setzero_ps()
static inline float sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
#endif

#ifdef SMALL_LINEAR_BF16
#ifndef __AVX512BF16__
#error "the bf16 kernel needs AVX512-BF16"
#endif
typedef uint16_t elem; /* bf16's bits */
typedef __m512bh vec;
#define LANES 32
#define load(p) ((__m512bh)_mm512_loadu_si512(p))
#define madd(acc, w, x) _mm512_dpbf16_ps(acc, w, x)
static inline float to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t from_float(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#else
typedef float elem;
typedef acc_t vec;
#ifdef __AVX512F__
#define LANES 16
#define load(p) _mm512_loadu_ps(p)
#define madd(acc, w, x) _mm512_fmadd_ps(w, x, acc)
#else
#define LANES 8
#define load(p) _mm256_loadu_ps(p)
#define madd(acc, w, x) _mm256_fmadd_ps(w, x, acc)
#endif
#define to_float(v) (v)
#define from_float(v) (v)
#endif

/* m rows of x against W_ROWS rows of w; m is a constant in each instance, so the loops unroll. */
static inline __attribute__((always_inline)) void tile(const elem *x, const elem *w, const elem *bias, elem *out,
                                                       const int m, int64_t K, int64_t N) {
    acc_t acc[W_ROWS][X_ROWS];
    float tail[W_ROWS][X_ROWS];
    int64_t kv = K - K % LANES;
    for (int r = 0; r < W_ROWS; r++)
        for (int i = 0; i < m; i++) acc[r][i] = zero(), tail[r][i] = 0.0f;
    for (int64_t k = 0; k < kv; k += LANES) {
        vec wv[W_ROWS];
        for (int r = 0; r < W_ROWS; r++) wv[r] = load(w + r * K + k);
        for (int i = 0; i < m; i++) {
            vec xv = load(x + i * K + k);
            for (int r = 0; r < W_ROWS; r++) acc[r][i] = madd(acc[r][i], wv[r], xv);
        }
    }
    for (int64_t k = kv; k < K; k++)
        for (int r = 0; r < W_ROWS; r++)
            for (int i = 0; i < m; i++) tail[r][i] += to_float(w[r * K + k]) * to_float(x[i * K + k]);
    for (int r = 0; r < W_ROWS; r++)
        for (int i = 0; i < m; i++)
            out[i * N + r] = from_float(sum(acc[r][i]) + tail[r][i] + (bias ? to_float(bias[r]) : 0.0f));
}

#define TILE(m)                                                                                                \
    static void tile##m(const elem *x, const elem *w, const elem *bias, elem *out, int64_t K, int64_t N) {     \
        tile(x, w, bias, out, m, K, N);                                                                        \
    }
typedef void (*tile_fn)(const elem *, const elem *, const elem *, elem *, int64_t, int64_t);
TILE(1) TILE(2) TILE(3)
#if X_ROWS == 6
TILE(4) TILE(5) TILE(6)
static const tile_fn TILES[X_ROWS + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6};
#else
static const tile_fn TILES[X_ROWS + 1] = {0, tile1, tile2, tile3};
#endif

/* x: M x K, w: N x K, bias: N or NULL, out: M x N; all contiguous. */
void small_linear(const elem *x, const elem *w, const elem *bias, elem *out, int64_t M, int64_t N, int64_t K,
                  int threads) {
    int64_t tiles = N / W_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++) {
        int64_t n = t * W_ROWS;
        for (int64_t m0 = 0; m0 < M; m0 += X_ROWS) {
            int64_t m = M - m0 < X_ROWS ? M - m0 : X_ROWS;
            TILES[m](x + m0 * K, w + n * K, bias ? bias + n : 0, out + m0 * N + n, K, N);
        }
    }
    /* The last N % W_ROWS weight rows, in the tiles' summing order. */
    for (int64_t n = tiles * W_ROWS; n < N; n++)
        for (int64_t i = 0; i < M; i++) {
            acc_t acc = zero();
            float tail = 0.0f;
            int64_t kv = K - K % LANES, k = 0;
            for (; k < kv; k += LANES) acc = madd(acc, load(w + n * K + k), load(x + i * K + k));
            for (; k < K; k++) tail += to_float(w[n * K + k]) * to_float(x[i * K + k]);
            out[i * N + n] = from_float(sum(acc) + tail + (bias ? to_float(bias[n]) : 0.0f));
        }
}
