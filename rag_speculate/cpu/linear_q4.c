/* y = x W^T (+ b) with 4-bit weights and int8 activations, fp32 in and out, for any number of rows of
 * x, each row summed the same way whatever the others: integer products, as llama.cpp's Q4_K x Q8_K.
 *
 * The weights: GGUF's Q4_K, as llama.cpp reads it. A row is cut into super-blocks of S values (256,
 * as Q4_K; 128 or 64 where the inputs are not a multiple of 256), each into sub-blocks of 32 with a
 * 6-bit scale sc and a 6-bit minimum m, and the super-block has an fp32 d and offset o (Q4_K's
 * -dmin): w = d sc q + o m, q in [0, 15]. Each 64 values are 32 bytes, the first 32 values in the low
 * nibbles and the next 32 in the high ones (Q4_K's own `qs`). Each row of x is quantized on its own,
 * per super-block (`quantize.h`: a scale dx and int8 values qx), with the sums of qx per sub-block.
 * So per super-block
 *     y += dx d (sum over sub-blocks of sc * (q . qx))  +  dx o (sum over sub-blocks of m * sum(qx)),
 * both sums exact integers (q is unsigned, so `maddubs` multiplies it with qx directly; the scales
 * then multiply the pair sums as 16-bit integers, as llama.cpp's kernels do).
 *
 * The invariant: y[m][n] is the same sequence of operations on the same inputs, whatever M and
 * whatever rows sit beside m. Its two vector accumulators take super-blocks s = 0, 1, 2, ... in order,
 * each an fma of the super-block's integer lanes (as fp32) by the product of its two scales; then
 * the lanes are summed in a fixed pattern, then the bias, rounded once. Tiling, blocking and
 * threading only choose which outputs are computed together, never how one is summed. A prefill's
 * many rows run the same tiles as a decoding step's one; only the cache blocking changes.
 *
 * AVX2: 8 lanes, two `maddubs` and two `madd` per 64 values; AVX-512: 16 lanes, one `maddubs` per 64
 * values and, with VNNI, one `vpdpwssd` that scales and adds the pair sums.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quantize.h"

#define SUB 32       /* values per sub-block: its own scale and minimum */
#define CHUNK 64     /* values per 32 bytes of packed weights */
#define MAX_SUBS 8   /* sub-blocks per super-block, at most (256 values) */
#define BLOCK_M 192  /* rows of x per cache block */
#define FEW_ROWS 64  /* rows of x up to which a tile runs over the whole of k */
#define CHUNK_K 2048 /* values of k per pass for more rows: a block of weight rows stays in L2 */

#ifdef __AVX512F__
#define W_ROWS 4
#define X_ROWS 4
#define BLOCK_N 64
typedef __m512i ivec;
typedef __m512 fvec;
#define fzero() _mm512_setzero_ps()
#define izero() _mm512_setzero_si512()
#define fsum(v) _mm512_reduce_add_ps(v)
/* The sub-blocks' scales (8 int16 in a 128-bit lane) in every 128-bit lane. */
#define spread(s128) _mm512_broadcast_i32x4(s128)
#else
#define W_ROWS 2
#define X_ROWS 3
#define BLOCK_N 64
typedef __m256i ivec;
typedef __m256 fvec;
#define fzero() _mm256_setzero_ps()
#define izero() _mm256_setzero_si256()
static inline float fsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
#define spread(s128) _mm256_broadcastsi128_si256(s128)
#endif

static inline float fsum4(__m128 v) {
    v = _mm_hadd_ps(v, v);
    v = _mm_hadd_ps(v, v);
    return _mm_cvtss_f32(v);
}

typedef struct {
    const uint8_t *qs;  /* N x K/2 */
    const uint8_t *sub; /* N x supers x 2 subs: the scales, then the minimums */
    const float *d, *o; /* N x supers */
    int64_t K, size, supers, subs;
    const uint8_t *sub_end; /* past the last byte of `sub` */
    __m128i mins;           /* a byte shuffle taking the minimums from a super-block's 16 bytes, zero past them */
} weights;

/* Rows of x quantized: int8 values, per super-block the scale, and per sub-block the values' sum
 * (8 int16 per super-block, zero past its sub-blocks). */
typedef struct {
    int8_t *q;
    float *d;
    int16_t *sums;
} acts;

/* A byte-shuffle control that puts 16-bit element e of each 128-bit lane in all its 8 places. */
static inline __m128i pick(int e) {
    return _mm_set1_epi16((short)((2 * e) | ((2 * e + 1) << 8)));
}

/* The 16 bytes from super-block b's scales on (its scales and minimums, and whatever follows): read in
 * place, or, for the last few of the whole tensor, copied, not to read past its end. */
static inline __m128i sub_bytes(const weights *W, int64_t b) {
    const uint8_t *p = W->sub + b * 2 * W->subs;
    if (p + 16 <= W->sub_end) return _mm_loadu_si128((const __m128i *)p);
    uint8_t tail[16] = {0};
    memcpy(tail, p, W->sub_end - p);
    return _mm_loadu_si128((const __m128i *)tail);
}

/* m rows of x (from i0) against r weight rows (from n) over super-blocks [s0, s1), adding to the
 * accumulators `acc` and `accm` (r x X_ROWS of each, kept between calls, in memory: the registers go to
 * the integer lanes); m and r are constants in each instance, so the loops unroll. */
static inline __attribute__((always_inline)) void tile(const acts *A, int64_t i0, const weights *W, int64_t n, fvec *acc,
                                                       __m128 *accm, const int m, const int r, int64_t s0, int64_t s1) {
    const int64_t K = W->K, S = W->size, supers = W->supers, chunks = S / CHUNK;
    const __m256i nibble = _mm256_set1_epi8(15);
    for (int64_t s = s0; s < s1; s++) {
        __m128i sub[W_ROWS];
        ivec scales[W_ROWS];
        for (int j = 0; j < r; j++) {
            sub[j] = sub_bytes(W, (n + j) * supers + s);
            scales[j] = spread(_mm_cvtepu8_epi16(sub[j]));
        }
        ivec lanes[W_ROWS][X_ROWS];
        for (int j = 0; j < r; j++)
            for (int i = 0; i < m; i++) lanes[j][i] = izero();
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t at = s * S + c * CHUNK;
            /* The next tile's r rows, 32 bytes of each a step, fetched ahead: the hardware's prefetcher
             * misses rows read side by side. */
            for (int j = 0; j < r; j++) _mm_prefetch((const char *)(W->qs + (n + r + j) * (K / 2) + at / 2), _MM_HINT_T1);
#ifdef __AVX512F__
            /* The 32 bytes twice: the low half keeps the low nibbles (values 0-31), the high half the high ones (32-63). */
            const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
            const __m512i ctrl = _mm512_inserti64x4(_mm512_broadcast_i32x4(pick(2 * c)), _mm256_broadcastsi128_si256(pick(2 * c + 1)), 1);
            __m512i w[W_ROWS], sc[W_ROWS];
            for (int j = 0; j < r; j++) {
                const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(W->qs + (n + j) * (K / 2) + at / 2)));
                w[j] = _mm512_and_si512(_mm512_srlv_epi16(raw, shifts), _mm512_broadcast_i64x4(nibble));
                sc[j] = _mm512_shuffle_epi8(scales[j], ctrl);
            }
            for (int i = 0; i < m; i++) {
                const __m512i x = _mm512_loadu_si512(A->q + (i0 + i) * K + at);
                for (int j = 0; j < r; j++) {
                    const __m512i p = _mm512_maddubs_epi16(w[j], x);
#ifdef __AVX512VNNI__
                    lanes[j][i] = _mm512_dpwssd_epi32(lanes[j][i], p, sc[j]);
#else
                    lanes[j][i] = _mm512_add_epi32(lanes[j][i], _mm512_madd_epi16(p, sc[j]));
#endif
                }
            }
#else
            const __m256i ctrl_lo = _mm256_broadcastsi128_si256(pick(2 * c)), ctrl_hi = _mm256_broadcastsi128_si256(pick(2 * c + 1));
            __m256i lo[W_ROWS], hi[W_ROWS], sc_lo[W_ROWS], sc_hi[W_ROWS];
            for (int j = 0; j < r; j++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(W->qs + (n + j) * (K / 2) + at / 2));
                lo[j] = _mm256_and_si256(raw, nibble);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
                sc_lo[j] = _mm256_shuffle_epi8(scales[j], ctrl_lo);
                sc_hi[j] = _mm256_shuffle_epi8(scales[j], ctrl_hi);
            }
            for (int i = 0; i < m; i++) {
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(A->q + (i0 + i) * K + at));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(A->q + (i0 + i) * K + at + 32));
                for (int j = 0; j < r; j++) {
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo[j], x0), sc_lo[j]),
                                                       _mm256_madd_epi16(_mm256_maddubs_epi16(hi[j], x1), sc_hi[j]));
                    lanes[j][i] = _mm256_add_epi32(lanes[j][i], p);
                }
            }
#endif
        }
        /* The super-block's scales, once: the lanes by d dx, the minimums' sum by o dx (each product
         * one fp32 rounding, whether of broadcasts or of scalars). */
        __m128 dx[X_ROWS];
        __m128i sums[X_ROWS];
        for (int i = 0; i < m; i++) {
            dx[i] = _mm_set1_ps(A->d[(i0 + i) * supers + s]);
            sums[i] = _mm_loadu_si128((const __m128i *)(A->sums + ((i0 + i) * supers + s) * MAX_SUBS));
        }
        for (int j = 0; j < r; j++) {
            const __m128 d = _mm_set1_ps(W->d[(n + j) * supers + s]), o = _mm_set1_ps(W->o[(n + j) * supers + s]);
            const __m128i mins = _mm_cvtepu8_epi16(_mm_shuffle_epi8(sub[j], W->mins));
            for (int i = 0; i < m; i++) {
                fvec *a = acc + j * X_ROWS + i;
                __m128 *am = accm + j * X_ROWS + i;
#ifdef __AVX512F__
                *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes[j][i]), _mm512_broadcastss_ps(_mm_mul_ps(d, dx[i])), *a);
#else
                *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes[j][i]), _mm256_broadcastss_ps(_mm_mul_ps(d, dx[i])), *a);
#endif
                *am = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, sums[i])), _mm_mul_ps(o, dx[i]), *am);
            }
        }
    }
}

#define TILES(m)                                                                                                          \
    static void full_##m(const acts *A, int64_t i0, const weights *W, int64_t n, fvec *acc, __m128 *accm, int64_t s0,     \
                         int64_t s1) {                                                                                    \
        tile(A, i0, W, n, acc, accm, m, W_ROWS, s0, s1);                                                                  \
    }                                                                                                                     \
    static void single_##m(const acts *A, int64_t i0, const weights *W, int64_t n, fvec *acc, __m128 *accm, int64_t s0,   \
                           int64_t s1) {                                                                                  \
        tile(A, i0, W, n, acc, accm, m, 1, s0, s1);                                                                       \
    }
typedef void (*tile_fn)(const acts *, int64_t, const weights *, int64_t, fvec *, __m128 *, int64_t, int64_t);
TILES(1) TILES(2) TILES(3)
#if X_ROWS == 4
TILES(4)
static const tile_fn FULL[] = {0, full_1, full_2, full_3, full_4};
static const tile_fn SINGLE[] = {0, single_1, single_2, single_3, single_4};
#else
static const tile_fn FULL[] = {0, full_1, full_2, full_3};
static const tile_fn SINGLE[] = {0, single_1, single_2, single_3};
#endif

/* One call's work, shared with the pool's parts (`pool.c`). */
typedef struct {
    const float *x, *bias;
    float *out;
    weights W;
    acts A;
    int64_t M, N;
} job;

void pool_run(void (*task)(void *, int64_t, int64_t), void *ctx, int64_t parts);

/* Rows of x into their int8 values, per super-block scales and per sub-block sums. */
static void quantize_part(void *ctx, int64_t part, int64_t parts) {
    const job *J = ctx;
    const int64_t K = J->W.K, S = J->W.size, supers = J->W.supers;
    for (int64_t i = J->M * part / parts; i < J->M * (part + 1) / parts; i++)
        for (int64_t s = 0; s < supers; s++) {
            const float *x = J->x + i * K + s * S;
            int8_t *q = J->A.q + i * K + s * S;
            int16_t *sums = J->A.sums + (i * supers + s) * MAX_SUBS;
            __m256 inv;
            J->A.d[i * supers + s] = block_scale(block_amax(x, S), &inv);
            memset(sums, 0, sizeof(int16_t) * MAX_SUBS);
            for (int64_t b = 0; b < S / SUB; b++) {
                const __m256i v = quantize_step(x + b * SUB, inv);
                _mm256_storeu_si256((__m256i *)(q + b * SUB), v);
                /* 32 values of at most 127 sum within int16. */
                const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
                sums[b] = (int16_t)_mm_cvtsi128_si32(t);
            }
        }
}

/* Part `part` of `parts`: its share of the blocks of BLOCK_N weight rows, for every row of x. */
static void multiply_part(void *ctx, int64_t part, int64_t parts) {
    const job *J = ctx;
    const int64_t M = J->M, N = J->N, supers = J->W.supers;
    /* Up to FEW_ROWS rows (decoding, a draft tree) are bound by reading the weights: each tile runs
     * over the whole of k, so a block of weight rows is read from memory once while every tile of
     * rows passes it in the caches. More rows (a prefill) take k a chunk at a time. */
    const int64_t chunk = M <= FEW_ROWS ? supers : (CHUNK_K / J->W.size > 0 ? CHUNK_K / J->W.size : 1);
    const int64_t blocks = (N + BLOCK_N - 1) / BLOCK_N;
    const int64_t tiles_m = ((M < BLOCK_M ? M : BLOCK_M) + X_ROWS - 1) / X_ROWS;
    fvec *accs = aligned_alloc(64, sizeof(fvec) * tiles_m * BLOCK_N * X_ROWS);
    __m128 *accms = aligned_alloc(64, sizeof(__m128) * tiles_m * BLOCK_N * X_ROWS);
    for (int64_t m_block = 0; m_block < M; m_block += BLOCK_M) {
        const int64_t m_end = m_block + BLOCK_M < M ? m_block + BLOCK_M : M;
        for (int64_t nb = blocks * part / parts; nb < blocks * (part + 1) / parts; nb++) {
            const int64_t n_start = nb * BLOCK_N, n_end = n_start + BLOCK_N < N ? n_start + BLOCK_N : N;
            for (int64_t t = 0; t < (m_end - m_block + X_ROWS - 1) / X_ROWS * BLOCK_N * X_ROWS; t++)
                accs[t] = fzero(), accms[t] = _mm_setzero_ps();
            for (int64_t s0 = 0; s0 < supers; s0 += chunk) {
                const int64_t s1 = s0 + chunk < supers ? s0 + chunk : supers;
                for (int64_t m0 = m_block; m0 < m_end; m0 += X_ROWS) {
                    const int m = m_end - m0 < X_ROWS ? (int)(m_end - m0) : X_ROWS;
                    const int64_t base = (m0 - m_block) / X_ROWS * BLOCK_N * X_ROWS;
                    for (int64_t n = n_start; n < n_end;) {
                        const int full = n + W_ROWS <= n_end;
                        const int64_t at = base + (n - n_start) * X_ROWS;
                        (full ? FULL : SINGLE)[m](&J->A, m0, &J->W, n, accs + at, accms + at, s0, s1);
                        n += full ? W_ROWS : 1;
                    }
                }
            }
            for (int64_t m0 = m_block; m0 < m_end; m0 += X_ROWS) {
                const int m = m_end - m0 < X_ROWS ? (int)(m_end - m0) : X_ROWS;
                const int64_t base = (m0 - m_block) / X_ROWS * BLOCK_N * X_ROWS;
                for (int64_t n = n_start; n < n_end; n++)
                    for (int i = 0; i < m; i++) {
                        const int64_t at = base + (n - n_start) * X_ROWS + i;
                        J->out[(m0 + i) * N + n] = fsum(accs[at]) + fsum4(accms[at]) + (J->bias ? J->bias[n] : 0.0f);
                    }
            }
        }
    }
    free(accms);
    free(accs);
}

/* x: M x K fp32, qs: N x K/2, sub: N x supers x 2 (K / 32 per row) bytes, d and o: N x supers, bias:
 * N or NULL, out: M x N; super-blocks of `size` values (64, 128 or 256), K a multiple of it. */
void linear_q4(const float *x, const uint8_t *qs, const uint8_t *sub, const float *d, const float *o, int64_t size, const float *bias,
               float *out, int64_t M, int64_t N, int64_t K, int threads) {
    job J = {.x = x, .bias = bias, .out = out, .M = M, .N = N,
             .W = {.qs = qs, .sub = sub, .d = d, .o = o, .K = K, .size = size, .supers = K / size, .subs = size / SUB,
                   .sub_end = sub + N * (K / 16)}};
    uint8_t take[16];
    for (int i = 0; i < 16; i++) take[i] = i < J.W.subs ? (uint8_t)(J.W.subs + i) : 0x80;
    J.W.mins = _mm_loadu_si128((const __m128i *)take);
    J.A.q = malloc(M * K);
    J.A.d = malloc(sizeof(float) * M * J.W.supers);
    J.A.sums = malloc(sizeof(int16_t) * M * J.W.supers * MAX_SUBS);
    pool_run(quantize_part, &J, M < threads ? M : threads);
    pool_run(multiply_part, &J, threads);
    free(J.A.q);
    free(J.A.d);
    free(J.A.sums);
}
