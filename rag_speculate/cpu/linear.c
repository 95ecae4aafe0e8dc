/* y = x W^T (+ b) for any number of rows of x, each row summed the same way whatever the others:
 * fp32 (AVX-512F or AVX2 + FMA), bf16 with -DLINEAR_BF16 (AVX512-BF16's pair products with
 * -DBF16_DOT, else each bf16 widened to fp32 and multiplied in fp32); the weight's rows shared among
 * the kernels' threads (pool.c).
 * (Quantized weights meet int8 activations in kernels of their own: linear_q8.c, linear_q4.c.)
 *
 * The invariant: an output y[m][n] is the same sequence of operations on the same inputs, whatever
 * M and whatever rows sit beside m. Its vector accumulator adds w[n][k..k+LANES) x[m][k..k+LANES)
 * for k = 0, LANES, 2 LANES, ... in that order, then the lanes are summed in a fixed pattern, then
 * the tail, then the bias, and the result is rounded once. Tiling, blocking and threading only
 * choose which outputs are computed together, never how one is summed.
 *
 * Decoding and verifying a draft (1 to 64 rows) are bound by reading the weights: each weight row
 * is read once and used against up to X_ROWS rows of x while in registers (AVX-512's 32 registers
 * hold a tile of 8 weight rows x 3 rows of x, AVX2's 16 a tile of 3 x 4). A prefill (hundreds of
 * rows) is bound by arithmetic: weights in blocks of BLOCK_N rows and k in chunks of CHUNK_K keep
 * a tile's rows of x in L1 while the block's weights pass them from L2, and every block of BLOCK_M
 * rows of x reads each weight row from memory once.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#ifdef __AVX512F__
#define W_ROWS 8
#define X_ROWS 3
#define LANES 16
typedef __m512 acc_t;
#define zero() _mm512_setzero_ps()
#define sum(v) _mm512_reduce_add_ps(v)
#define load_f32(p) _mm512_loadu_ps(p)
#define fmadd(a, b, acc) _mm512_fmadd_ps(a, b, acc)
#define widen(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define store_f32(p, v) _mm512_storeu_ps(p, v)
#define set1(f) _mm512_set1_ps(f)
#else
#define W_ROWS 3
#define X_ROWS 4
#define LANES 8
typedef __m256 acc_t;
#define zero() _mm256_setzero_ps()
static inline float sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
#define load_f32(p) _mm256_loadu_ps(p)
#define fmadd(a, b, acc) _mm256_fmadd_ps(a, b, acc)
#define widen(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define store_f32(p, v) _mm256_storeu_ps(p, v)
#define set1(f) _mm256_set1_ps(f)
#endif

/* Rows of x in one cache block, and weight rows in one: the block of weights (BLOCK_N x K) stays in
 * L2 while the rows of x pass it. */
#define BLOCK_M 192
#define BLOCK_N 96 /* a multiple of every W_ROWS */
#define CHUNK_K 512 /* a multiple of every STEP */

#ifdef LINEAR_BF16
typedef uint16_t elem; /* bf16's bits */
#define to_float(v) bf16_widen(v)
#define from_float(f) bf16_round(f)
#ifdef BF16_DOT
#ifndef __AVX512BF16__
#error "BF16_DOT needs AVX512-BF16"
#endif
/* Pairs of bf16 products summed into each fp32 lane (vdpbf16ps): 32 elements per step. */
typedef uint16_t xelem;
#define STEP 32
typedef __m512bh vec_w;
typedef __m512bh vec_x;
#define load_w(p) ((__m512bh)_mm512_loadu_si512(p))
#define load_x(p) ((__m512bh)_mm512_loadu_si512(p))
#define madd(acc, w, x) _mm512_dpbf16_ps(acc, w, x)
#define x_to_float(v) to_float(v)
#else
/* Each bf16 widened to fp32 (exact) and multiplied in fp32; x is widened once per call. */
typedef float xelem;
#define STEP LANES
typedef acc_t vec_w;
typedef acc_t vec_x;
#define load_w(p) widen(p)
#define load_x(p) load_f32(p)
#define madd(acc, w, x) fmadd(w, x, acc)
#define x_to_float(v) (v)
#endif
#else
typedef float elem;
typedef float xelem;
#define STEP LANES
typedef acc_t vec_w;
typedef acc_t vec_x;
#define load_w(p) load_f32(p)
#define load_x(p) load_f32(p)
#define madd(acc, w, x) fmadd(w, x, acc)
#define to_float(v) (v)
#define x_to_float(v) (v)
#define from_float(v) (v)
#endif

/* The weights: N rows of K. */
typedef struct {
    const elem *w;
    int64_t K;
} weights;

/* m rows of x against r weight rows over k in [k0, k1) (multiples of STEP), adding to the vector
 * accumulators `acc` (r x m of them, kept between calls); m and r are constants in each instance, so
 * the loops unroll. Storing an accumulator and loading it back changes none of its bits. */
static inline __attribute__((always_inline)) void tile(const xelem *x, const weights *W, int64_t n, acc_t *acc, const int m,
                                                       const int r, int64_t k0, int64_t k1) {
    const int64_t K = W->K;
    acc_t a[W_ROWS][X_ROWS];
    for (int j = 0; j < r; j++)
        for (int i = 0; i < m; i++) a[j][i] = acc[j * X_ROWS + i];
    for (int64_t k = k0; k < k1; k += STEP) {
        vec_w wv[W_ROWS];
        for (int j = 0; j < r; j++) wv[j] = load_w(W->w + (n + j) * K + k);
        for (int i = 0; i < m; i++) {
            const vec_x xv = load_x(x + i * K + k);
            for (int j = 0; j < r; j++) a[j][i] = madd(a[j][i], wv[j], xv);
        }
    }
    for (int j = 0; j < r; j++)
        for (int i = 0; i < m; i++) acc[j * X_ROWS + i] = a[j][i];
}

#define TILES(m)                                                                                                   \
    static void full_##m(const xelem *x, const weights *W, int64_t n, acc_t *acc, int64_t k0, int64_t k1) {         \
        tile(x, W, n, acc, m, W_ROWS, k0, k1);                                                                     \
    }                                                                                                              \
    static void single_##m(const xelem *x, const weights *W, int64_t n, acc_t *acc, int64_t k0, int64_t k1) {       \
        tile(x, W, n, acc, m, 1, k0, k1);                                                                          \
    }
typedef void (*tile_fn)(const xelem *, const weights *, int64_t, acc_t *, int64_t, int64_t);
/* Tiles of W_ROWS weight rows, and of single rows for the last N % W_ROWS, by their rows of x. */
TILES(1) TILES(2) TILES(3)
#if X_ROWS == 4
TILES(4)
static const tile_fn FULL[] = {0, full_1, full_2, full_3, full_4};
static const tile_fn SINGLE[] = {0, single_1, single_2, single_3, single_4};
#else
static const tile_fn FULL[] = {0, full_1, full_2, full_3};
static const tile_fn SINGLE[] = {0, single_1, single_2, single_3};
#endif

/* The outputs of one tile from its accumulators: the lanes summed, then the tail, then the bias,
 * rounded once. */
static void finish(const xelem *x, const weights *W, int64_t n, const elem *bias, elem *out, const acc_t *acc, int m, int r,
                   int64_t N) {
    const int64_t K = W->K, kv = K - K % STEP;
    for (int j = 0; j < r; j++)
        for (int i = 0; i < m; i++) {
            float tail = 0.0f;
            for (int64_t k = kv; k < K; k++) tail += to_float(W->w[(n + j) * K + k]) * x_to_float(x[i * K + k]);
            out[i * N + j] = from_float(sum(acc[j * X_ROWS + i]) + tail + (bias ? to_float(bias[j]) : 0.0f));
        }
}

/* x: M x K, the weights: N x K, bias: N or NULL, out: M x N; all contiguous.
 *
 * Weights in blocks of BLOCK_N rows, x in blocks of BLOCK_M rows, and k in chunks of CHUNK_K: a
 * chunk of a tile's x rows stays in L1 while the block's weight rows pass it, the block's chunk of
 * weights stays in L2. Each tile's accumulators wait in `accs` between chunks. */
/* One call's work, shared with the pool's parts (`pool.c`). */
typedef struct {
    const xelem *x;
    const weights *W;
    const elem *bias;
    elem *out;
    int64_t M, N, K;
} job;

void pool_run(void (*task)(void *, int64_t, int64_t), void *ctx, int64_t parts);

/* Part `part` of `parts`: its share of the blocks of BLOCK_N weight rows, for every row of x. */
static void run_part(void *ctx, int64_t part, int64_t parts) {
    const job *J = ctx;
    const xelem *x = J->x;
    const elem *bias = J->bias;
    elem *out = J->out;
    const int64_t M = J->M, N = J->N, K = J->K;
    const int64_t kv = K - K % STEP, blocks = (N + BLOCK_N - 1) / BLOCK_N;
    /* A few rows are bound by reading the weights: one chunk, the whole of k, reads each weight row once. */
    const int64_t chunk = M <= X_ROWS ? (kv > 0 ? kv : STEP) : CHUNK_K;
    /* Accumulators for the rows of x there are, up to a block: a decoding step's one row needs one
     * tile's worth, and a small allocation stays off mmap (whose unmapping stalls every thread). */
    const int64_t tiles_m = ((M < BLOCK_M ? M : BLOCK_M) + X_ROWS - 1) / X_ROWS, tiles_n = BLOCK_N;
    acc_t *accs = aligned_alloc(64, sizeof(acc_t) * tiles_m * tiles_n * X_ROWS);
    const weights *W = J->W;
    for (int64_t b = blocks * part / parts; b < blocks * (part + 1) / parts; b++) {
        const int64_t n_start = b * BLOCK_N, n_end = n_start + BLOCK_N < N ? n_start + BLOCK_N : N;
        for (int64_t m_block = 0; m_block < M; m_block += BLOCK_M) {
            const int64_t m_end = m_block + BLOCK_M < M ? m_block + BLOCK_M : M;
            /* Only the tiles this block of rows uses: a decoding step's one row clears one. */
            for (int64_t t = 0; t < (m_end - m_block + X_ROWS - 1) / X_ROWS * tiles_n * X_ROWS; t++) accs[t] = zero();
            for (int64_t k0 = 0; k0 < kv; k0 += chunk) {
                const int64_t k1 = k0 + chunk < kv ? k0 + chunk : kv;
                for (int64_t m0 = m_block; m0 < m_end; m0 += X_ROWS) {
                    const int64_t m = m_end - m0 < X_ROWS ? m_end - m0 : X_ROWS;
                    acc_t *row_accs = accs + (m0 - m_block) / X_ROWS * tiles_n * X_ROWS;
                    for (int64_t n = n_start; n < n_end;) {
                        const int full = n + W_ROWS <= n_end;
                        (full ? FULL : SINGLE)[m](x + m0 * K, W, n, row_accs + (n - n_start) * X_ROWS, k0, k1);
                        n += full ? W_ROWS : 1;
                    }
                }
            }
            for (int64_t m0 = m_block; m0 < m_end; m0 += X_ROWS) {
                const int m = m_end - m0 < X_ROWS ? (int)(m_end - m0) : X_ROWS;
                const acc_t *row_accs = accs + (m0 - m_block) / X_ROWS * tiles_n * X_ROWS;
                for (int64_t n = n_start; n < n_end;) {
                    const int r = n + W_ROWS <= n_end ? W_ROWS : 1;
                    finish(x + m0 * K, W, n, bias ? bias + n : 0, out + m0 * N + n, row_accs + (n - n_start) * X_ROWS, m, r, N);
                    n += r;
                }
            }
        }
    }
    free(accs);
}

static void run(const elem *x_in, const weights *W, const elem *bias, elem *out, int64_t M, int64_t N, int64_t K, int threads) {
    const xelem *x = (const xelem *)x_in;
    float *widened = NULL;
#if defined(LINEAR_BF16) && !defined(BF16_DOT)
    /* x widened to fp32 once here, not once per weight row; exact, so no output changes. */
    widened = malloc(sizeof(float) * M * K);
    for (int64_t i = 0; i < M * K; i++) widened[i] = to_float(x_in[i]);
    x = widened;
#endif
    job J = {.x = x, .W = W, .bias = bias, .out = out, .M = M, .N = N, .K = K};
    pool_run(run_part, &J, threads);
    free(widened);
}

void linear(const elem *x, const elem *w, const elem *bias, elem *out, int64_t M, int64_t N, int64_t K, int threads) {
    const weights W = {.w = w, .K = K};
    run(x, &W, bias, out, M, N, K, threads);
}
