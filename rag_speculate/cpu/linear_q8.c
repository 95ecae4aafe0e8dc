/* y = x W^T (+ b) with int8 weights and int8 activations, in fp32 in and out, for any number of rows
 * of x, each row summed the same way whatever the others (AVX2: integer pair products).
 *
 * The weights: int8 values q[n][k] with an fp32 scale per group of 2^group_shift >= 16 values along
 * k (ours: 128; GGUF's Q8_0 and Q4_0 have groups of 32; 16 also taken). Each row of x is quantized
 * on its own, per block of `act` values (the weights' group, at least 32 and at most 128: 32 is how
 * llama.cpp quantizes activations for its Q8_0 dot products), a scale d = max|x| / 127 and values
 * round(x / d) in [-127, 127]. So a row's quantized values depend on that row alone, and
 *     y[m][n] = sum over blocks b of  d_x[m][b] * (d_w[n][b] * (integer dot product of the block)),
 * the integer products exact (32 products of at most 127 x 128 fit int16 pairs; a block of 128 sums
 * four such in int32 lanes). The scales are applied once a block: on AVX2 that fp32 work costs as
 * much as the integer products, so blocks of 128 (ours) compute faster than Q8_0's of 32.
 *
 * The invariant: y[m][n] is the same sequence of operations on the same inputs, whatever M and
 * whatever rows sit beside m. Its accumulator takes blocks b = 0, 1, 2, ... in order, each an fma of
 * the block's 8 int32 lane sums (as fp32) by the block's scale vector; then the 8 lanes are summed in
 * a fixed pattern, then the bias, rounded once. Tiling, blocking and threading only choose which
 * outputs are computed together, never how one is summed.
 *
 * Few rows (decoding, a draft tree) are bound by reading the weights, a byte each, read once for all
 * rows of a tile. Many rows (a prefill) are bound by the integer products: there x and a block of
 * weights at a time are widened to int16 (`tile16`), whose pair products need neither the sign trick
 * nor a second multiply (two multiplies per 32 values against three, on the ports AVX2's integer
 * multiplies share); each lane sums the same integers as the int8 path, so every output is the same.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "quantize.h"
#include "sums.h"

#define BLOCK 32     /* values per integer product step (one register of int8) */
#define MAX_UNITS 4  /* steps per activation block (1, 2 or 4): blocks of at most 128 */
#define W_ROWS 2     /* weight rows per tile: 2 x 3 accumulators, the weights' magnitudes and scales, */
#define X_ROWS 3     /* and x's values and scale fill AVX2's 16 registers */
#define BLOCK_M 192  /* rows of x per cache block */
#define BLOCK_N 64   /* weight rows per cache block, a multiple of W_ROWS */
#define FEW_ROWS 64  /* rows of x up to which the int8 tiles run, over the whole of k */
#define X16_ROWS 4   /* rows of x per int16 tile: 2 x 4 sums, x's two registers and the products' */
#define BLOCK_N16 8  /* weight rows widened at a time, a multiple of W_ROWS */
#define CHUNK16 2048 /* values of k widened at a time, a multiple of every activation block */

/* With AVX-512 VNNI a layer in groups of 32 or more takes `vpdpbusd` products: few rows through
 * tiles of 512-bit lanes (`vnni_tile`), many through a product whose 16 lanes are 16 rows of x
 * (`gemm_tile`). Every output of such a layer ends each block in one fma of the block's exact integer
 * sum by its two scales, on either path. Elsewhere (the AVX2 build, groups of 16) a block's 8 lanes
 * stay apart until the end (`block_done`; with VNNI, groups of 16 decode through `vnni_tile` too, lane
 * by lane): an fma per 16 values made their decoding 1.5 times as slow. */
#ifdef __AVX512VNNI__
#define LANES_AS_ROWS 1
#define FEW_ROWS_LANES 4 /* rows of x up to which `vnni_tile` runs */
#endif

/* Rows of x quantized: their int8 values (few rows) or the same values widened to int16 (`widen`,
 * many rows), and per block of `units` steps of each row the scale. */
typedef struct {
    int8_t *q;
    int16_t *q16;
    float *d;
    int64_t units;
} acts;

typedef struct {
    const int8_t *q;
    const float *scale;
    int64_t K, groups, group_shift;
} weights;

/* Steps of BLOCK values per activation block: the weights' group, at least one step and at most
 * MAX_UNITS, so each block sits within one weight scale (or, for groups of 16, two per step). */
static int64_t units_for(int64_t group_shift) {
    const int64_t units = group_shift <= 5 ? 1 : (int64_t)1 << (group_shift - 5);
    return units < MAX_UNITS ? units : MAX_UNITS;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* A step's 32 int8 values as two int16 vectors whose pair products (madd) land where maddubs-then-
 * madd puts them: the first holds values 4l, 4l+1 at pair l, the second 4l+2, 4l+3, so lane l of
 * their two products' sum is values 4l..4l+3, the same integer as lane l of the int8 path. */
static inline void widen(__m256i v, __m256i *a, __m256i *b) {
    const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7,
                                           10, 11, 14, 15);
    const __m256i split = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, pairs), _MM_SHUFFLE(3, 1, 2, 0));
    *a = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(split));
    *b = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(split, 1));
}

/* A step's 32 values stored as int8 into `q`, or widened into `q16` where that is given. */
static inline void store_step(__m256i v, int8_t *q, int16_t *q16) {
    if (!q16) {
        _mm256_storeu_si256((__m256i *)q, v);
        return;
    }
    __m256i a, b;
    widen(v, &a, &b);
    _mm256_storeu_si256((__m256i *)q16, a);
    _mm256_storeu_si256((__m256i *)(q16 + 16), b);
}

/* Row `x` (K values) into `q` (or `q16`) and `d`, per block of `units` steps (`quantize.h`). */
static void quantize_row(const float *x, int8_t *q, int16_t *q16, float *d, int64_t K, int64_t units) {
    const int64_t size = units * BLOCK;
    for (int64_t b = 0; b < K / size; b++) {
        const float *xb = x + b * size;
        __m256 inv;
        d[b] = block_scale(block_amax(xb, size), &inv);
        for (int64_t u = 0; u < units; u++) {
            const int64_t at = b * size + u * BLOCK;
            store_step(quantize_step(xb + u * BLOCK, inv), q ? q + at : NULL, q16 ? q16 + at : NULL);
        }
    }
}

/* Weight row n's scales for step b as 8 lanes: lanes 0-3 sum values 0-15 of the step, lanes 4-7
 * values 16-31, so groups of 16 take a scale per half. */
static inline __m256 weight_scale(const weights *W, int64_t n, int64_t b) {
    const float *s = W->scale + n * W->groups;
    if (W->group_shift == 4) return _mm256_setr_m128(_mm_set1_ps(s[2 * b]), _mm_set1_ps(s[2 * b + 1]));
    return _mm256_set1_ps(s[(b * BLOCK) >> W->group_shift]);
}

/* Whether a layer takes the `vpdpbusd` paths, its outputs ending each block in one fma (see LANES_AS_ROWS). */
static inline int scalar_blocks(const weights *W) {
#ifdef LANES_AS_ROWS
    return W->group_shift > 4;
#else
    (void)W;
    return 0;
#endif
}

/* An output's accumulator after a block whose last step is b: its 8 lanes of integer sums `total`
 * meet x's scale `xd` and the weights', lane by lane; the lanes are summed at the end (`hsum`). */
static inline __m256 block_done(__m256 a, __m256i total, const float *xd, const weights *W, int64_t n, int64_t b) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(_mm256_broadcast_ss(xd), weight_scale(W, n, b)), a);
}

/* m rows of x against r weight rows over steps [b0, b1) (whole activation blocks), adding to the
 * accumulators `acc` (r x m, kept between calls). The weight's magnitude meets x's value with the
 * weight's sign (maddubs multiplies unsigned by signed bytes): |w| <= 128 and |q| <= 127, so no pair
 * sum saturates. A block's steps sum in int32 lanes; then its scales, once. */
static inline __attribute__((always_inline)) void tile(const acts *A, int64_t i0, const weights *W, int64_t n, __m256 *acc,
                                                       const int m, const int r, const int units, int64_t b0, int64_t b1) {
    const int64_t K = W->K, KB = K / BLOCK, KA = KB / units;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 a[W_ROWS][X_ROWS];
    for (int j = 0; j < r; j++)
        for (int i = 0; i < m; i++) a[j][i] = acc[j * X_ROWS + i];
    /* A tile reads whole rows (few rows of x: one chunk, all of k), so the next tile's r rows are the
     * next r K bytes: fetched r x 32 bytes a step, as the hardware's prefetcher misses rows read side by side. */
    const int8_t *next = W->q + (n + r) * K;
    __m256i sums[W_ROWS][X_ROWS];
    for (int64_t g = b0; g < b1; g += units) {
        for (int u = 0; u < units; u++) { /* unrolled: `units` is a constant */
            /* A block's last step meets its scales; the steps before it only add up integers. */
            const int64_t b = g + u;
            const int last = u == units - 1;
            _mm_prefetch((const char *)(next + b * r * BLOCK), _MM_HINT_T1);
            const int8_t *w = W->q + n * K + b * BLOCK;
            __m256i wm[W_ROWS];
            for (int j = 0; j < r; j++) wm[j] = _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(w + j * K)));
            for (int i = 0; i < m; i++) {
                const __m256i xq = _mm256_loadu_si256((const __m256i *)(A->q + (i0 + i) * K + b * BLOCK));
                for (int j = 0; j < r; j++) {
                    /* The weight's bytes read again here rather than held: registers go to accumulators. */
                    const __m256i signed_x = _mm256_sign_epi8(xq, _mm256_loadu_si256((const __m256i *)(w + j * K)));
                    const __m256i step = _mm256_madd_epi16(_mm256_maddubs_epi16(wm[j], signed_x), ones);
                    const __m256i total = u == 0 ? step : _mm256_add_epi32(sums[j][i], step);
                    if (!last) {
                        sums[j][i] = total;
                        continue;
                    }
                    a[j][i] = block_done(a[j][i], total, A->d + (i0 + i) * KA + g / units, W, n + j, b);
                }
            }
        }
    }
    for (int j = 0; j < r; j++)
        for (int i = 0; i < m; i++) acc[j * X_ROWS + i] = a[j][i];
}

/* The tile for many rows: as `tile`, with x and the weights widened to int16 (`widen`; the weights
 * a block at a time, `w16`, `stride` values a row, from step b0). x's two registers are held while
 * the weights are read from L1 as operands, so 2 x 4 sums fit the 16 registers. */
static inline __attribute__((always_inline)) void tile16(const acts *A, int64_t i0, const int16_t *w16, int64_t stride,
                                                         const weights *W, int64_t n, __m256 *acc, const int m, const int r,
                                                         const int units, int64_t b0, int64_t b1) {
    /* Every field read once into a local: stores through `acc` may alias anything. */
    const int64_t K = W->K, KA = K / BLOCK / units;
    const int16_t *x16[X16_ROWS], *w[W_ROWS];
    const float *xd[X16_ROWS];
    for (int i = 0; i < m; i++) x16[i] = A->q16 + (i0 + i) * K, xd[i] = A->d + (i0 + i) * KA;
    for (int j = 0; j < r; j++) w[j] = w16 + j * stride - b0 * BLOCK;
    const weights scales = *W;
    __m256 a[W_ROWS][X16_ROWS];
    for (int j = 0; j < r; j++)
        for (int i = 0; i < m; i++) a[j][i] = acc[j * X16_ROWS + i];
    for (int64_t g = b0; g < b1; g += units) {
        __m256i sums[W_ROWS][X16_ROWS];
#pragma GCC unroll 4
        for (int u = 0; u < units; u++) {
            const int64_t off = (g + u) * BLOCK;
            for (int i = 0; i < m; i++) {
                const __m256i xa = _mm256_loadu_si256((const __m256i *)(x16[i] + off));
                const __m256i xb = _mm256_loadu_si256((const __m256i *)(x16[i] + off + 16));
                for (int j = 0; j < r; j++) {
                    const __m256i step = _mm256_add_epi32(_mm256_madd_epi16(xa, _mm256_loadu_si256((const __m256i *)(w[j] + off))),
                                                          _mm256_madd_epi16(xb, _mm256_loadu_si256((const __m256i *)(w[j] + off + 16))));
                    sums[j][i] = u == 0 ? step : _mm256_add_epi32(sums[j][i], step);
                }
            }
            /* Each step's sums pinned in registers: otherwise GCC regroups the unrolled steps' adds into
             * a tree, holds every product at once and spills them. */
            for (int j = 0; j < r; j++)
                for (int i = 0; i < m; i++) __asm__("" : "+x"(sums[j][i]));
        }
        for (int j = 0; j < r; j++) {
            const __m256 ws = weight_scale(&scales, n + j, g);
            for (int i = 0; i < m; i++)
                a[j][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j][i]), _mm256_mul_ps(_mm256_broadcast_ss(xd[i] + g / units), ws), a[j][i]);
        }
    }
    for (int j = 0; j < r; j++)
        for (int i = 0; i < m; i++) acc[j * X16_ROWS + i] = a[j][i];
}

/* Weight rows [n0, n1), steps [b0, b1), widened into `w16`, (b1 - b0) * BLOCK values a row. */
static void widen_weights(const weights *W, int64_t n0, int64_t n1, int64_t b0, int64_t b1, int16_t *w16) {
    const int64_t stride = (b1 - b0) * BLOCK;
    for (int64_t n = n0; n < n1; n++)
        for (int64_t b = b0; b < b1; b++)
            store_step(_mm256_loadu_si256((const __m256i *)(W->q + n * W->K + b * BLOCK)), NULL,
                       w16 + (n - n0) * stride + (b - b0) * BLOCK);
}

/* Each tile shape compiled for each number of steps a block (constants let the compiler keep the
 * sums in registers). */
#define TILES(m, u)                                                                                                          \
    static void full_##m##_##u(const acts *A, int64_t i0, const weights *W, int64_t n, __m256 *acc, int64_t b0, int64_t b1) {   \
        tile(A, i0, W, n, acc, m, W_ROWS, u, b0, b1);                                                                        \
    }                                                                                                                        \
    static void single_##m##_##u(const acts *A, int64_t i0, const weights *W, int64_t n, __m256 *acc, int64_t b0, int64_t b1) { \
        tile(A, i0, W, n, acc, m, 1, u, b0, b1);                                                                             \
    }
typedef void (*tile_fn)(const acts *, int64_t, const weights *, int64_t, __m256 *, int64_t, int64_t);
TILES(1, 1) TILES(2, 1) TILES(3, 1) /* up to X_ROWS rows, by 1, 2 or MAX_UNITS steps */
TILES(1, 2) TILES(2, 2) TILES(3, 2)
TILES(1, 4) TILES(2, 4) TILES(3, 4)
static const tile_fn FULL[][X_ROWS + 1] = {{0, full_1_1, full_2_1, full_3_1}, {0, full_1_2, full_2_2, full_3_2}, {0, full_1_4, full_2_4, full_3_4}};
static const tile_fn SINGLE[][X_ROWS + 1] = {{0, single_1_1, single_2_1, single_3_1}, {0, single_1_2, single_2_2, single_3_2},
                                             {0, single_1_4, single_2_4, single_3_4}};
#define TILES16(m, u)                                                                                                      \
    static void wide_full_##m##_##u(const acts *A, int64_t i0, const int16_t *w16, int64_t stride, const weights *W, int64_t n,  \
                                    __m256 *acc, int64_t b0, int64_t b1) {                                                  \
        tile16(A, i0, w16, stride, W, n, acc, m, W_ROWS, u, b0, b1);                                                        \
    }                                                                                                                        \
    static void wide_single_##m##_##u(const acts *A, int64_t i0, const int16_t *w16, int64_t stride, const weights *W,         \
                                      int64_t n, __m256 *acc, int64_t b0, int64_t b1) {                                     \
        tile16(A, i0, w16, stride, W, n, acc, m, 1, u, b0, b1);                                                             \
    }
typedef void (*tile16_fn)(const acts *, int64_t, const int16_t *, int64_t, const weights *, int64_t, __m256 *, int64_t, int64_t);
TILES16(1, 1) TILES16(2, 1) TILES16(3, 1) TILES16(4, 1) /* up to X16_ROWS rows */
TILES16(1, 2) TILES16(2, 2) TILES16(3, 2) TILES16(4, 2)
TILES16(1, 4) TILES16(2, 4) TILES16(3, 4) TILES16(4, 4)
static const tile16_fn WIDE_FULL[][X16_ROWS + 1] = {{0, wide_full_1_1, wide_full_2_1, wide_full_3_1, wide_full_4_1},
                                                    {0, wide_full_1_2, wide_full_2_2, wide_full_3_2, wide_full_4_2},
                                                    {0, wide_full_1_4, wide_full_2_4, wide_full_3_4, wide_full_4_4}};
static const tile16_fn WIDE_SINGLE[][X16_ROWS + 1] = {{0, wide_single_1_1, wide_single_2_1, wide_single_3_1, wide_single_4_1},
                                                      {0, wide_single_1_2, wide_single_2_2, wide_single_3_2, wide_single_4_2},
                                                      {0, wide_single_1_4, wide_single_2_4, wide_single_3_4, wide_single_4_4}};

/* One call's work, shared with the pool's parts (`pool.c`). */
typedef struct {
    const void *x; /* fp32, or bf16 (`bf16`: widened as each part quantizes its rows) */
    const float *bias;
    void *out; /* fp32, or bf16 (rounded as each part writes its outputs) */
    weights W;
    acts A;
    int64_t M, N, K;
    int bf16;
} job;

void pool_run(void (*task)(void *, int64_t, int64_t), void *ctx, int64_t parts);

static void quantize_part(void *ctx, int64_t part, int64_t parts) {
    job *J = ctx;
    const int64_t KA = J->K / (BLOCK * J->A.units);
    float *buf = J->bf16 ? malloc(sizeof(float) * J->K) : NULL;
    for (int64_t i = J->M * part / parts; i < J->M * (part + 1) / parts; i++)
        quantize_row(row_fp32(J->x, i, J->K, J->bf16, buf), J->A.q ? J->A.q + i * J->K : NULL, J->A.q16 ? J->A.q16 + i * J->K : NULL,
                     J->A.d + i * KA, J->K, J->A.units);
    free(buf);
}

/* Part `part` of `parts`: its share of the blocks of weight rows, for every row of x. */
static void multiply_part(void *ctx, int64_t part, int64_t parts) {
    job *J = ctx;
    const int64_t M = J->M, N = J->N, KB = J->K / BLOCK;
    /* Decoding and verifying (up to FEW_ROWS rows, int8) are bound by reading the weights: one chunk,
     * the whole of k, streams each weight row from memory once, prefetched, while every tile of rows
     * passes it in L1. A prefill (int16) widens a block of weights a chunk of k at a time, and every
     * tile of a block of rows passes it. */
    const int wide = J->A.q16 != NULL;
    const int64_t rows = wide ? X16_ROWS : X_ROWS, block_n = wide ? BLOCK_N16 : BLOCK_N;
    const int64_t chunk = wide ? CHUNK16 / BLOCK : KB, blocks = (N + block_n - 1) / block_n;
    const int shape = J->A.units == 1 ? 0 : J->A.units == 2 ? 1 : 2;
    /* Accumulators for the rows of x there are, up to a block: a decoding step's one row needs one
     * tile's worth, and a small allocation stays off mmap (whose unmapping stalls every thread). */
    const int64_t tiles_m = ((M < BLOCK_M ? M : BLOCK_M) + rows - 1) / rows;
    __m256 *accs = aligned_alloc(32, sizeof(__m256) * tiles_m * block_n * rows);
    int16_t *w16 = wide ? aligned_alloc(32, sizeof(int16_t) * BLOCK_N16 * CHUNK16) : NULL;
    /* A block of rows of x stays in the caches while every weight block passes it: streaming all of
     * x past each weight block instead re-reads x from memory for a long k (docs/design.md). */
    for (int64_t m_block = 0; m_block < M; m_block += BLOCK_M) {
        const int64_t m_end = m_block + BLOCK_M < M ? m_block + BLOCK_M : M;
        for (int64_t nb = blocks * part / parts; nb < blocks * (part + 1) / parts; nb++) {
            const int64_t n_start = nb * block_n, n_end = n_start + block_n < N ? n_start + block_n : N;
            for (int64_t t = 0; t < (m_end - m_block + rows - 1) / rows * block_n * rows; t++) accs[t] = _mm256_setzero_ps();
            for (int64_t b0 = 0; b0 < KB; b0 += chunk) {
                const int64_t b1 = b0 + chunk < KB ? b0 + chunk : KB, stride = (b1 - b0) * BLOCK;
                if (wide) widen_weights(&J->W, n_start, n_end, b0, b1, w16);
                for (int64_t m0 = m_block; m0 < m_end; m0 += rows) {
                    const int m = m_end - m0 < rows ? (int)(m_end - m0) : (int)rows;
                    __m256 *row_accs = accs + (m0 - m_block) / rows * block_n * rows;
                    for (int64_t n = n_start; n < n_end;) {
                        const int full = n + W_ROWS <= n_end;
                        __m256 *tile_accs = row_accs + (n - n_start) * rows;
                        if (wide)
                            (full ? WIDE_FULL : WIDE_SINGLE)[shape][m](&J->A, m0, w16 + (n - n_start) * stride, stride, &J->W, n,
                                                                       tile_accs, b0, b1);
                        else
                            (full ? FULL : SINGLE)[shape][m](&J->A, m0, &J->W, n, tile_accs, b0, b1);
                        n += full ? W_ROWS : 1;
                    }
                }
            }
            for (int64_t m0 = m_block; m0 < m_end; m0 += rows) {
                const int m = m_end - m0 < rows ? (int)(m_end - m0) : (int)rows;
                const __m256 *row_accs = accs + (m0 - m_block) / rows * block_n * rows;
                for (int64_t n = n_start; n < n_end; n++)
                    for (int i = 0; i < m; i++)
                        put(J->out, (m0 + i) * N + n, hsum(row_accs[(n - n_start) * rows + i]) + (J->bias ? J->bias[n] : 0.0f), J->bf16);
            }
        }
    }
    free(w16);
    free(accs);
}

#ifdef LANES_AS_ROWS
/* Many rows (groups of 32 or more): each vector's 16 lanes are 16 rows of x, interleaved 4 values a row
 * (as unsigned bytes, x + 128), and a weight row's 4 values, broadcast, meet them in one `vpdpbusd`
 * (64 products); a block's sum is then less 128 times the weights' own sum over it, and each lane
 * ends the block as `vnni_tile`'s lanes do, on its own row. */
#define GROUP 16    /* rows of x in a vector's lanes */
#define G_ROWS 4    /* weight rows per tile */
#define BLOCK_NG 32 /* weight rows whose sums are taken at a time */

typedef struct {
    const job *J;
    uint8_t *xi;     /* groups x K/4 x GROUP x 4 */
    float *d;        /* groups x blocks x GROUP */
    int64_t groups;
} gemm_job;

static void interleave_part(void *ctx, int64_t part, int64_t parts) {
    const gemm_job *G = ctx;
    const job *J = G->J;
    const int64_t K = J->K, blocks = K / (BLOCK * J->A.units);
    for (int64_t g = G->groups * part / parts; g < G->groups * (part + 1) / parts; g++)
        for (int l = 0; l < GROUP; l++) {
            const int64_t row = g * GROUP + l;
            uint8_t *xi = G->xi + g * K * GROUP + 4 * l;
            for (int64_t t = 0; t < K / 4; t++)
                for (int e = 0; e < 4; e++) xi[t * 4 * GROUP + e] = row < J->M ? (uint8_t)(J->A.q[row * K + 4 * t + e] + 128) : 128;
            for (int64_t b = 0; b < blocks; b++) G->d[(g * blocks + b) * GROUP + l] = row < J->M ? J->A.d[row * blocks + b] : 0.0f;
        }
}

/* Group g of x against r weight rows from n over all of k; `sums`: the weight rows' sum per block. */
static inline __attribute__((always_inline)) void gemm_tile(const gemm_job *G, int64_t g, int64_t n, const int32_t *sums, const int r) {
    const job *J = G->J;
    const weights *W = &J->W;
    const int64_t K = J->K, size = BLOCK * J->A.units, blocks = K / size;
    const __m512i *xg = (const __m512i *)(G->xi + g * K * GROUP);
    __m512 acc[G_ROWS];
    for (int j = 0; j < r; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < blocks; p++) {
        const int64_t k0 = p * size;
        __m512i lanes[G_ROWS];
        for (int j = 0; j < r; j++) lanes[j] = _mm512_set1_epi32(-128 * sums[j * blocks + p]);
        for (int64_t t = 0; t < size / 4; t++) {
            const __m512i x = _mm512_load_si512(xg + k0 / 4 + t);
            for (int j = 0; j < r; j++) {
                int32_t w;
                memcpy(&w, W->q + (n + j) * K + k0 + 4 * t, sizeof w);
                lanes[j] = _mm512_dpbusd_epi32(lanes[j], x, _mm512_set1_epi32(w));
            }
        }
        const __m512 dx = _mm512_load_ps(G->d + (g * blocks + p) * GROUP);
        for (int j = 0; j < r; j++)
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes[j]),
                                     _mm512_mul_ps(_mm512_set1_ps(W->scale[(n + j) * W->groups + (k0 >> W->group_shift)]), dx), acc[j]);
    }
    for (int j = 0; j < r; j++) {
        float y[GROUP];
        _mm512_storeu_ps(y, _mm512_add_ps(acc[j], _mm512_set1_ps(J->bias ? J->bias[n + j] : 0.0f)));
        for (int l = 0; l < GROUP && g * GROUP + l < J->M; l++) put(J->out, (g * GROUP + l) * J->N + n + j, y[l], J->bf16);
    }
}

static void gemm_full(const gemm_job *G, int64_t g, int64_t n, const int32_t *sums) { gemm_tile(G, g, n, sums, G_ROWS); }
static void gemm_single(const gemm_job *G, int64_t g, int64_t n, const int32_t *sums) { gemm_tile(G, g, n, sums, 1); }

/* Part `part` of `parts`: its share of the blocks of BLOCK_NG weight rows against every group of x. */
static void gemm_part(void *ctx, int64_t part, int64_t parts) {
    const gemm_job *G = ctx;
    const job *J = G->J;
    const int64_t K = J->K, N = J->N, blocks = (N + BLOCK_NG - 1) / BLOCK_NG, size = BLOCK * J->A.units, per_row = K / size;
    int32_t *sums = malloc(sizeof(int32_t) * BLOCK_NG * per_row);
    for (int64_t nb = blocks * part / parts; nb < blocks * (part + 1) / parts; nb++) {
        const int64_t n0 = nb * BLOCK_NG, n1 = n0 + BLOCK_NG < N ? n0 + BLOCK_NG : N;
        /* Each block's sum: the bytes' offsets from -128 summed 16 at a time (`psadbw`), less 128 each. */
        for (int64_t n = n0; n < n1; n++)
            for (int64_t p = 0; p < per_row; p++) {
                __m128i total = _mm_setzero_si128();
                for (int64_t k = p * size; k < (p + 1) * size; k += 16) {
                    const __m128i v = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(J->W.q + n * K + k)), _mm_set1_epi8((char)0x80));
                    total = _mm_add_epi64(total, _mm_sad_epu8(v, _mm_setzero_si128()));
                }
                sums[(n - n0) * per_row + p] = (int32_t)(_mm_cvtsi128_si64(total) + _mm_extract_epi64(total, 1) - 128 * size);
            }
        for (int64_t g = 0; g < G->groups; g++)
            for (int64_t n = n0; n < n1;) {
                const int full = n + G_ROWS <= n1;
                (full ? gemm_full : gemm_single)(G, g, n, sums + (n - n0) * per_row);
                n += full ? G_ROWS : 1;
            }
    }
    free(sums);
}

/* Few rows (decoding, a draft tree): V_ROWS weight rows against up to FEW_ROWS_LANES rows of x, 64
 * products a `vpdpbusd` (x + 128 as unsigned bytes against the weights, less 128 times the weights'
 * own sum, taken by one more `vpdpbusd` a weight row), against five instructions a 32 values for the
 * AVX2 tile. Each lane sums the same 4 products as a lane of the AVX2 tile. A layer of `scalar_blocks`
 * reduces a block's lanes to one integer per output, the tile's outputs of a row of x together
 * (`sums.h`), each meeting its scales in one fma, lane by lane; a layer in groups of 16 (`lanewise`)
 * takes a vector's two halves as two steps of `block_done`, 8 lanes an output. */
#define V_ROWS 4

static inline __attribute__((always_inline)) void vnni_tile(const job *J, int64_t n, const int m, const int r, const int lanewise) {
    const weights *W = &J->W;
    const int64_t K = J->K, size = lanewise ? 64 : BLOCK * J->A.units, blocks = K / size, step = size < 64 ? size : 64;
    const int64_t scales_x = K / (BLOCK * J->A.units); /* x's scales a row */
    const __mmask64 take = step == 64 ? ~(__mmask64)0 : ((__mmask64)1 << step) - 1;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const int8_t *next = W->q + (n + r) * K; /* the next tile's rows, fetched ahead as in `tile` */
    __m128 acc[FEW_ROWS_LANES];
    __m256 lane_acc[V_ROWS][FEW_ROWS_LANES];
    for (int i = 0; i < m; i++) {
        acc[i] = _mm_setzero_ps();
        for (int j = 0; j < r; j++) lane_acc[j][i] = _mm256_setzero_ps();
    }
    for (int64_t p = 0; p < blocks; p++) {
        __m512i lanes[V_ROWS][FEW_ROWS_LANES], offsets[V_ROWS];
        for (int j = 0; j < r; j++) {
            offsets[j] = _mm512_setzero_si512();
            for (int i = 0; i < m; i++) lanes[j][i] = _mm512_setzero_si512();
        }
        for (int64_t k = p * size; k < (p + 1) * size; k += step) {
            __m512i w[V_ROWS];
            for (int j = 0; j < r; j++) {
                _mm_prefetch((const char *)(next + j * K + k), _MM_HINT_T1);
                w[j] = _mm512_maskz_loadu_epi8(take, W->q + (n + j) * K + k);
                offsets[j] = _mm512_dpbusd_epi32(offsets[j], flip, w[j]);
            }
            for (int i = 0; i < m; i++) {
                const __m512i x = _mm512_xor_si512(_mm512_maskz_loadu_epi8(take, J->A.q + i * K + k), flip);
                for (int j = 0; j < r; j++) lanes[j][i] = _mm512_dpbusd_epi32(lanes[j][i], x, w[j]);
            }
        }
        if (lanewise) {
            /* Steps 2p and 2p + 1: each half's scales, as `weight_scale` and `block_done` make them. */
            const __m512i quarters = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            __m512 ws[V_ROWS];
            for (int j = 0; j < r; j++)
                ws[j] = _mm512_permutexvar_ps(quarters, _mm512_castps128_ps512(_mm_loadu_ps(W->scale + (n + j) * W->groups + 4 * p)));
            for (int i = 0; i < m; i++) {
                const float *xd = J->A.d + i * scales_x + 2 * p;
                const __m512 xs = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(xd[0])), _mm256_castps_pd(_mm256_set1_ps(xd[1])), 1));
                for (int j = 0; j < r; j++) {
                    const __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(lanes[j][i], offsets[j])), sc = _mm512_mul_ps(xs, ws[j]);
                    const __m256 a = _mm256_fmadd_ps(_mm512_castps512_ps256(t), _mm512_castps512_ps256(sc), lane_acc[j][i]);
                    lane_acc[j][i] = _mm256_fmadd_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)),
                                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sc), 1)), a);
                }
            }
            continue;
        }
        const __m128 scales = per_row(W->scale + n * W->groups + ((p * size) >> W->group_shift), W->groups, r);
        for (int i = 0; i < m; i++) {
            __m512i v[V_ROWS];
            for (int j = 0; j < V_ROWS; j++) v[j] = j < r ? _mm512_sub_epi32(lanes[j][i], offsets[j]) : _mm512_setzero_si512();
            acc[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(sums_of4(v[0], v[1], v[2], v[3])), _mm_mul_ps(scales, _mm_set1_ps(J->A.d[i * blocks + p])),
                                  acc[i]);
        }
    }
    for (int i = 0; i < m; i++) {
        float y[4];
        _mm_storeu_ps(y, acc[i]);
        for (int j = 0; j < r; j++)
            put(J->out, i * J->N + n + j, (lanewise ? hsum(lane_acc[j][i]) : y[j]) + (J->bias ? J->bias[n + j] : 0.0f), J->bf16);
    }
}

#define VNNI_TILES(m)                                                                                            \
    static void vnni_full_##m(const job *J, int64_t n) { vnni_tile(J, n, m, V_ROWS, 0); }                        \
    static void vnni_single_##m(const job *J, int64_t n) { vnni_tile(J, n, m, 1, 0); }                           \
    static void lanewise_full_##m(const job *J, int64_t n) { vnni_tile(J, n, m, V_ROWS, 1); }                    \
    static void lanewise_single_##m(const job *J, int64_t n) { vnni_tile(J, n, m, 1, 1); }
VNNI_TILES(1) VNNI_TILES(2) VNNI_TILES(3) VNNI_TILES(4)
typedef void (*vnni_fn)(const job *, int64_t);
static const vnni_fn VNNI_FULL[][FEW_ROWS_LANES + 1] = {{0, vnni_full_1, vnni_full_2, vnni_full_3, vnni_full_4},
                                                        {0, lanewise_full_1, lanewise_full_2, lanewise_full_3, lanewise_full_4}};
static const vnni_fn VNNI_SINGLE[][FEW_ROWS_LANES + 1] = {{0, vnni_single_1, vnni_single_2, vnni_single_3, vnni_single_4},
                                                          {0, lanewise_single_1, lanewise_single_2, lanewise_single_3, lanewise_single_4}};

/* Whether a layer's few rows take `vnni_tile`: every layer of `scalar_blocks`, and those in groups of
 * 16 whose rows are whole 64-value steps. */
static inline int vnni_tiles(const weights *W) {
    return scalar_blocks(W) || (W->group_shift == 4 && W->K % 64 == 0);
}

/* Part `part` of `parts`: its share of the blocks of BLOCK_N weight rows, for the few rows of x. */
static void vnni_part(void *ctx, int64_t part, int64_t parts) {
    const job *J = ctx;
    const int64_t N = J->N, blocks = (N + BLOCK_N - 1) / BLOCK_N;
    for (int64_t nb = blocks * part / parts; nb < blocks * (part + 1) / parts; nb++) {
        const int64_t n_end = (nb + 1) * BLOCK_N < N ? (nb + 1) * BLOCK_N : N;
        for (int64_t n = nb * BLOCK_N; n < n_end;) {
            const int full = n + V_ROWS <= n_end;
            (full ? VNNI_FULL : VNNI_SINGLE)[!scalar_blocks(&J->W)][J->M](J, n);
            n += full ? V_ROWS : 1;
        }
    }
}
#endif

/* x: M x K, fp32 or bf16 (bf16 1), as out (K a multiple of the activation block), q: N x K int8, scale:
 * N x groups, bias: N or NULL, out: M x N. */
void linear_quantized(const void *x, const int8_t *q, const float *scale, const float *offset, int64_t group_shift,
                      const float *bias, void *out, int64_t M, int64_t N, int64_t K, int threads, int bf16) {
    (void)offset;
    job J = {.x = x, .bias = bias, .out = out, .M = M, .N = N, .K = K, .bf16 = bf16,
             .W = {.q = q, .scale = scale, .K = K, .groups = ((K - 1) >> group_shift) + 1, .group_shift = group_shift},
             .A = {.d = malloc(sizeof(float) * M * (K / BLOCK)), .units = units_for(group_shift)}};
#ifdef LANES_AS_ROWS
    if (M <= FEW_ROWS_LANES && vnni_tiles(&J.W)) {
        J.A.q = malloc(M * K);
        pool_run(quantize_part, &J, M < threads ? M : threads);
        pool_run(vnni_part, &J, threads);
        free(J.A.q);
        free(J.A.d);
        return;
    }
    if (scalar_blocks(&J.W)) {
        J.A.q = malloc(M * K);
        pool_run(quantize_part, &J, M < threads ? M : threads);
        const int64_t size = BLOCK * J.A.units;
        gemm_job G = {.J = &J, .groups = (M + GROUP - 1) / GROUP};
        G.xi = aligned_alloc(64, G.groups * GROUP * K);
        G.d = aligned_alloc(64, sizeof(float) * G.groups * (K / size) * GROUP);
        pool_run(interleave_part, &G, G.groups < threads ? G.groups : threads);
        pool_run(gemm_part, &G, threads);
        free(G.xi);
        free(G.d);
        free(J.A.q);
        free(J.A.d);
        return;
    }
#endif
    if (M <= FEW_ROWS)
        J.A.q = malloc(M * K);
    else
        J.A.q16 = malloc(sizeof(int16_t) * M * K);
    pool_run(quantize_part, &J, M < threads ? M : threads);
    pool_run(multiply_part, &J, threads);
    free(J.A.q);
    free(J.A.q16);
    free(J.A.d);
}
