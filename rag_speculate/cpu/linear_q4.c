/* y = x W^T (+ b) with 4-bit (or 6-bit) weights and int8 activations, fp32 in and out, for any number
 * of rows of x, each row summed the same way whatever the others: integer products, as llama.cpp's
 * Q4_K x Q8_K (and Q6_K x Q8_K).
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
 * GGUF's Q6_K takes the same path (`q6`): values q in [0, 63], sub-blocks of 16 with a signed 8-bit
 * scale sc, w = d sc (q - 32); so m = sc and o = -32 d in the sum above. Each 64 values are 48 bytes:
 * their low 4 bits as Q4_K's nibbles, then 16 bytes of their high 2 bits (`values64`), 6.6 bits a
 * weight with the scales, as in the file. Held this way rather than as int8 in groups of 16, a
 * super-block ends in one fma per output, not one per 16 values.
 *
 * The invariant: y[m][n] is the same sequence of operations on the same inputs, whatever M and
 * whatever rows sit beside m. Per super-block, s = 0, 1, 2, ... in order, its two integer sums (exact,
 * however they were summed) each meet their scales' product (d dx, o dx) in one fma on an accumulator
 * of their own; then the two accumulators are added, then the bias. Tiling, blocking, threading
 * and the path taken only choose which outputs are computed together, never how one is summed.
 *
 * Two paths. Few rows (decoding, a draft tree) are bound by reading the weights: a tile holds 2 to 4
 * weight rows against up to 4 rows of x, its integer lanes summed to one integer per output and
 * super-block (AVX2: two `maddubs` and two `madd` per 64 values; AVX-512: one `maddubs` and, with VNNI,
 * one `vpdpwssd` that scales and adds the pair sums). Many rows (a prefill) are bound by the
 * arithmetic: there a vector's lanes are rows of x (16 on AVX-512, where one `vpdpbusd` makes 64
 * products; 8 on AVX2), so the per-super-block scaling serves that many outputs an instruction
 * (`gemm_tile`).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "quantize.h"
#include "sums.h"

#define CHUNK 64     /* values a step: 32 bytes of Q4_K, 48 of Q6_K */
#define MAX_SUBS 16  /* sub-blocks per super-block, at most (Q6_K's 16 of 16) */
#define BLOCK_N 64   /* weight rows per cache block */

/* Vectors of 32-bit lanes: the tiles' integer lanes, and the rows-as-lanes product's rows (GROUP of
 * them). Integer products summed into 32-bit lanes: 4 unsigned by signed bytes (`dot4`: the unsigned
 * values at most 15, so no 16-bit pair saturates), or 2 16-bit pairs (`dot2`). */
#ifdef __AVX512F__
#define W_ROWS 4
#define X_ROWS 4 /* rows of x a tile holds, and up to which the tiles run: more take the rows-as-lanes product */
#define GROUP 16
typedef __m512i ivec;
typedef __m512 fvec;
#define izero() _mm512_setzero_si512()
#define iset1(v) _mm512_set1_epi32(v)
#define iadd(a, b) _mm512_add_epi32(a, b)
#define imul(a, b) _mm512_mullo_epi32(a, b)
#define iload(p) _mm512_load_si512(p)
#define fzero() _mm512_setzero_ps()
#define fset1(v) _mm512_set1_ps(v)
#define fload(p) _mm512_load_ps(p)
#define fstore(p, v) _mm512_storeu_ps(p, v)
#define fadd(a, b) _mm512_add_ps(a, b)
#define fmul(a, b) _mm512_mul_ps(a, b)
#define ffma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define itof(v) _mm512_cvtepi32_ps(v)
/* The sub-blocks' scales (8 int16 in a 128-bit lane) in every 128-bit lane. */
#define spread(s128) _mm512_broadcast_i32x4(s128)
#ifdef __AVX512VNNI__
#define dot4(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define dot2(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
#else
#define dot4(acc, w, x) _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)))
#define dot2(acc, a, b) _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
#endif
#else
#define W_ROWS 2
#define X_ROWS 3
#define GROUP 8
typedef __m256i ivec;
typedef __m256 fvec;
#define izero() _mm256_setzero_si256()
#define iset1(v) _mm256_set1_epi32(v)
#define iadd(a, b) _mm256_add_epi32(a, b)
#define imul(a, b) _mm256_mullo_epi32(a, b)
#define iload(p) _mm256_load_si256(p)
#define fzero() _mm256_setzero_ps()
#define fset1(v) _mm256_set1_ps(v)
#define fload(p) _mm256_load_ps(p)
#define fstore(p, v) _mm256_storeu_ps(p, v)
#define fadd(a, b) _mm256_add_ps(a, b)
#define fmul(a, b) _mm256_mul_ps(a, b)
#define ffma(a, b, c) _mm256_fmadd_ps(a, b, c)
#define itof(v) _mm256_cvtepi32_ps(v)
#define spread(s128) _mm256_broadcastsi128_si256(s128)
#define dot4(acc, w, x) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#define dot2(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif

typedef struct {
    const uint8_t *qs;  /* N x row_bytes, packed: Q4_K's K / 2 a row, Q6_K's 3 K / 4 */
    const uint8_t *sub; /* N x supers x `sub_stride`: Q4_K's subs scales, then subs minimums; Q6_K's 16 signed scales */
    const float *d, *o; /* N x supers */
    int64_t K, size, supers, subs, sub_stride, row_bytes;
    int q6;
    const uint8_t *sub_end; /* past the last byte of `sub` */
    __m128i mins;           /* Q4_K: a byte shuffle taking the minimums from a super-block's 16 bytes, zero past them */
} weights;

/* Rows of x quantized: int8 values, per super-block the scale, and per sub-block the values' sum
 * (MAX_SUBS int16 per super-block, zero past its sub-blocks). */
typedef struct {
    int8_t *q;
    float *d;
    int16_t *sums;
} acts;

/* A byte-shuffle control that puts 16-bit element e of each 128-bit lane in all its 8 places. */
static inline __m128i pick(int e) {
    return _mm_set1_epi16((short)((2 * e) | ((2 * e + 1) << 8)));
}

/* The 16 bytes from super-block b's scales on (Q4_K: its scales and minimums, and whatever follows;
 * Q6_K: its 16 scales): read in place, or, for the last few of the whole tensor, copied, not to read
 * past its end. */
static inline __m128i sub_bytes(const weights *W, int64_t b) {
    const uint8_t *p = W->sub + b * W->sub_stride;
    if (p + 16 <= W->sub_end) return _mm_loadu_si128((const __m128i *)p);
    uint8_t tail[16] = {0};
    memcpy(tail, p, W->sub_end - p);
    return _mm_loadu_si128((const __m128i *)tail);
}

/* A super-block's minimums (Q4_K's m, Q6_K's scales) times x's sums per sub-block, as 4 int32 to be summed. */
static inline __m128i mins_dot(const weights *W, __m128i sub, const int16_t *sums, const int q6) {
    if (q6) {
        const __m256i p = _mm256_madd_epi16(_mm256_cvtepi8_epi16(sub), _mm256_loadu_si256((const __m256i *)sums));
        return _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    }
    return _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_shuffle_epi8(sub, W->mins)), _mm_loadu_si128((const __m128i *)sums));
}

/* A control that puts 16-bit element e of the first 128-bit lane, e + 1 of the second, ... in all 8
 * places of its lane (Q6_K: a 128-bit lane's 16 values are one sub-block). */
static inline __m256i pick2(int e) {
    return _mm256_inserti128_si256(_mm256_castsi128_si256(pick(e)), pick(e + 1), 1);
}

/* 64 values a byte each from their packed bytes at `p`, values 0-31 in `lo` and 32-63 in `hi`: Q4_K's
 * 32 bytes of nibbles, the first 32 values in the low ones; for Q6_K also 16 bytes of high 2 bits,
 * byte b holding those of values b, 16 + b, 32 + b and 48 + b from its low bits up, each moved to bits
 * 4-5 of its own byte by one shift of a 128-bit lane (what crosses from a neighbouring byte is masked). */
static inline void values64(const uint8_t *p, const int q6, __m256i *lo, __m256i *hi) {
    const __m256i nibble = _mm256_set1_epi8(15), raw = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_and_si256(raw, nibble);
    *hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
    if (q6) {
        const __m256i bits = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(p + 32))), high = _mm256_set1_epi8(0x30);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_sllv_epi32(bits, _mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2)), high));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2)), high));
    }
}

/* The integer sums of a tile's W_ROWS lane vectors, one a lane (AVX2: lanes 2 and 3 zero). */
static inline __m128i row_sums(const ivec *v) {
#ifdef __AVX512F__
    return sums_of4(v[0], v[1], v[2], v[3]);
#else
    return sums_of2(v[0], v[1]);
#endif
}

/* Few rows (decoding, a draft tree): the m rows of x against r weight rows (from n) over all of k,
 * into `acc` and `accm` (r x X_ROWS of each); m and r are constants in each instance, so the loops
 * unroll. A super-block's products sum in integer lanes, then to one integer per output, for its
 * minimums another; each meets its scales in one fma, the tile's r outputs of a row of x side by
 * side in one vector's lanes (the lanes of `gemm_tile` do the same operations). */
static inline __attribute__((always_inline)) void tile(const acts *A, const weights *W, int64_t n, float *acc, float *accm,
                                                       const int m, const int r, const int q6) {
    const int64_t K = W->K, S = W->size, supers = W->supers, chunks = S / CHUNK, row_bytes = W->row_bytes;
    __m128 out[X_ROWS], out_mins[X_ROWS];
    for (int i = 0; i < m; i++) out[i] = out_mins[i] = _mm_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        __m128i sub[W_ROWS];
        ivec scales[W_ROWS], scales_hi[W_ROWS]; /* the sub-blocks' scales as int16, 8 (Q6_K: the first 8, then the last) in each 128-bit lane */
        for (int j = 0; j < r; j++) {
            sub[j] = sub_bytes(W, (n + j) * supers + s);
            scales[j] = spread(q6 ? _mm_cvtepi8_epi16(sub[j]) : _mm_cvtepu8_epi16(sub[j]));
            if (q6) scales_hi[j] = spread(_mm_cvtepi8_epi16(_mm_srli_si128(sub[j], 8)));
        }
        ivec lanes[W_ROWS][X_ROWS];
        for (int j = 0; j < r; j++)
            for (int i = 0; i < m; i++) lanes[j][i] = izero();
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t at = s * S + c * CHUNK;
            /* The next tile's r rows, a chunk of each a step, fetched ahead: the hardware's prefetcher
             * misses rows read side by side. */
            const int64_t byte = q6 ? at / CHUNK * 48 : at / 2;
            for (int j = 0; j < r; j++) _mm_prefetch((const char *)(W->qs + (n + r + j) * row_bytes + byte), _MM_HINT_T1);
#ifdef __AVX512F__
            /* The 32 bytes of nibbles twice, the low half keeping the low nibbles (values 0-31; Q4_K's
             * sub-block 2c), the high half the high ones (32-63, 2c + 1); Q6_K's high 2 bits (as
             * `values64`: rotated to bits 4-5, a 128-bit lane a sub-block, 4c to 4c + 3) joined in. */
            const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
            const __m512i turns = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_setr_epi32(4, 4, 4, 4, 2, 2, 2, 2)),
                                                     _mm256_setr_epi32(0, 0, 0, 0, 30, 30, 30, 30), 1);
            const __m512i ctrl = q6 ? _mm512_inserti64x4(_mm512_castsi256_si512(pick2(4 * (c % 2))), pick2(4 * (c % 2) + 2), 1)
                                    : _mm512_inserti64x4(_mm512_broadcast_i32x4(pick(2 * c)), _mm256_broadcastsi128_si256(pick(2 * c + 1)), 1);
            __m512i w[W_ROWS], sc[W_ROWS];
            for (int j = 0; j < r; j++) {
                const uint8_t *row = W->qs + (n + j) * row_bytes + byte;
                const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)row));
                w[j] = _mm512_and_si512(_mm512_srlv_epi16(raw, shifts), _mm512_set1_epi8(15));
                if (q6) {
                    const __m512i bits = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(row + 32)));
                    /* w | (bits & 0x30), the high bits rotated into place */
                    w[j] = _mm512_ternarylogic_epi32(w[j], _mm512_rolv_epi32(bits, turns), _mm512_set1_epi8(0x30), 0xF8);
                }
                sc[j] = _mm512_shuffle_epi8(q6 && c >= 2 ? scales_hi[j] : scales[j], ctrl);
            }
            for (int i = 0; i < m; i++) {
                const __m512i x = _mm512_loadu_si512(A->q + i * K + at);
                for (int j = 0; j < r; j++) lanes[j][i] = dot2(lanes[j][i], _mm512_maddubs_epi16(w[j], x), sc[j]);
            }
#else
            /* Values 0-31 and 32-63 (`values64`): Q4_K's sub-blocks 2c and 2c + 1; Q6_K's 4c and 4c + 1,
             * then 4c + 2 and 4c + 3, a 128-bit lane each. */
            const __m256i ctrl_lo = q6 ? pick2(4 * (c % 2)) : _mm256_broadcastsi128_si256(pick(2 * c));
            const __m256i ctrl_hi = q6 ? pick2(4 * (c % 2) + 2) : _mm256_broadcastsi128_si256(pick(2 * c + 1));
            __m256i lo[W_ROWS], hi[W_ROWS], sc_lo[W_ROWS], sc_hi[W_ROWS];
            for (int j = 0; j < r; j++) {
                values64(W->qs + (n + j) * row_bytes + byte, q6, &lo[j], &hi[j]);
                const __m256i half = q6 && c >= 2 ? scales_hi[j] : scales[j];
                sc_lo[j] = _mm256_shuffle_epi8(half, ctrl_lo);
                sc_hi[j] = _mm256_shuffle_epi8(half, ctrl_hi);
            }
            for (int i = 0; i < m; i++) {
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(A->q + i * K + at));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(A->q + i * K + at + 32));
                for (int j = 0; j < r; j++) {
                    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo[j], x0), sc_lo[j]),
                                                       _mm256_madd_epi16(_mm256_maddubs_epi16(hi[j], x1), sc_hi[j]));
                    lanes[j][i] = _mm256_add_epi32(lanes[j][i], p);
                }
            }
#endif
        }
        const __m128 d = per_row(W->d + n * supers + s, supers, r), o = per_row(W->o + n * supers + s, supers, r);
        for (int i = 0; i < m; i++) {
            const int16_t *sums = A->sums + (i * supers + s) * MAX_SUBS;
            ivec v[W_ROWS];
            __m128i vm[4];
            for (int j = 0; j < W_ROWS; j++) v[j] = j < r ? lanes[j][i] : izero();
            for (int j = 0; j < 4; j++) vm[j] = j < r ? mins_dot(W, sub[j], sums, q6) : _mm_setzero_si128();
            const __m128 dx = _mm_set1_ps(A->d[i * supers + s]);
            out[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(row_sums(v)), _mm_mul_ps(d, dx), out[i]);
            out_mins[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_hadd_epi32(_mm_hadd_epi32(vm[0], vm[1]), _mm_hadd_epi32(vm[2], vm[3]))),
                                       _mm_mul_ps(o, dx), out_mins[i]);
        }
    }
    for (int i = 0; i < m; i++) {
        float a[4], b[4];
        _mm_storeu_ps(a, out[i]);
        _mm_storeu_ps(b, out_mins[i]);
        for (int j = 0; j < r; j++) acc[j * X_ROWS + i] = a[j], accm[j * X_ROWS + i] = b[j];
    }
}

#define TILES(m, f, q6)                                                                                                  \
    static void full_##f##_##m(const acts *A, const weights *W, int64_t n, float *acc, float *accm) {                      \
        tile(A, W, n, acc, accm, m, W_ROWS, q6);                                                                           \
    }                                                                                                                      \
    static void single_##f##_##m(const acts *A, const weights *W, int64_t n, float *acc, float *accm) {                    \
        tile(A, W, n, acc, accm, m, 1, q6);                                                                                \
    }
typedef void (*tile_fn)(const acts *, const weights *, int64_t, float *, float *);
TILES(1, q4, 0) TILES(2, q4, 0) TILES(3, q4, 0) TILES(1, q6, 1) TILES(2, q6, 1) TILES(3, q6, 1)
#if X_ROWS == 4
TILES(4, q4, 0) TILES(4, q6, 1)
static const tile_fn FULL[][X_ROWS + 1] = {{0, full_q4_1, full_q4_2, full_q4_3, full_q4_4}, {0, full_q6_1, full_q6_2, full_q6_3, full_q6_4}};
static const tile_fn SINGLE[][X_ROWS + 1] = {{0, single_q4_1, single_q4_2, single_q4_3, single_q4_4},
                                             {0, single_q6_1, single_q6_2, single_q6_3, single_q6_4}};
#else
static const tile_fn FULL[][X_ROWS + 1] = {{0, full_q4_1, full_q4_2, full_q4_3}, {0, full_q6_1, full_q6_2, full_q6_3}};
static const tile_fn SINGLE[][X_ROWS + 1] = {{0, single_q4_1, single_q4_2, single_q4_3}, {0, single_q6_1, single_q6_2, single_q6_3}};
#endif

/* One call's work, shared with the pool's parts (`pool.c`). */
typedef struct {
    const void *x; /* fp32, or bf16 (`bf16`: widened as each part quantizes its rows) */
    const float *bias;
    void *out; /* fp32, or bf16 (rounded as each part writes its outputs) */
    weights W;
    acts A;
    int64_t M, N;
    int bf16;
} job;

void pool_run(void (*task)(void *, int64_t, int64_t), void *ctx, int64_t parts);

/* Memory for vectors: 64-byte aligned, its size rounded up to a whole number of 64 bytes as aligned_alloc asks. */
static void *vec_alloc(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* Rows of x into their int8 values, per super-block scales and per sub-block sums. */
static void quantize_part(void *ctx, int64_t part, int64_t parts) {
    const job *J = ctx;
    const int64_t K = J->W.K, S = J->W.size, supers = J->W.supers;
    float *buf = J->bf16 ? malloc(sizeof(float) * K) : NULL;
    for (int64_t i = J->M * part / parts; i < J->M * (part + 1) / parts; i++) {
        const float *row = row_fp32(J->x, i, K, J->bf16, buf);
        for (int64_t s = 0; s < supers; s++) {
            const float *x = row + s * S;
            int8_t *q = J->A.q + i * K + s * S;
            int16_t *sums = J->A.sums + (i * supers + s) * MAX_SUBS;
            __m256 inv;
            J->A.d[i * supers + s] = block_scale(block_amax(x, S), &inv);
            memset(sums, 0, sizeof(int16_t) * MAX_SUBS);
            for (int64_t b = 0; b < S / 32; b++) {
                const __m256i v = quantize_step(x + b * 32, inv);
                _mm256_storeu_si256((__m256i *)(q + b * 32), v);
                /* 32 values of at most 127 sum within int16: per sub-block of 32 (Q4_K), or of 16 (Q6_K: a 128-bit lane each). */
                const __m256i pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
                const __m128i lo = _mm256_castsi256_si128(pairs), hi = _mm256_extracti128_si256(pairs, 1);
                if (J->W.q6)
                    sums[2 * b] = (int16_t)hsum4_epi32(lo), sums[2 * b + 1] = (int16_t)hsum4_epi32(hi);
                else
                    sums[b] = (int16_t)hsum4_epi32(_mm_add_epi32(lo, hi));
            }
        }
    }
    free(buf);
}

/* Part `part` of `parts`: its share of the blocks of BLOCK_N weight rows, for the few rows of x. Bound
 * by reading the weights: each tile runs over the whole of k, so a block of weight rows is read from
 * memory once while every tile of rows passes it in the caches. */
static void multiply_part(void *ctx, int64_t part, int64_t parts) {
    const job *J = ctx;
    const int64_t M = J->M, N = J->N, blocks = (N + BLOCK_N - 1) / BLOCK_N;
    float acc[2 * BLOCK_N * X_ROWS], *accm = acc + BLOCK_N * X_ROWS;
    for (int64_t nb = blocks * part / parts; nb < blocks * (part + 1) / parts; nb++) {
        const int64_t n_start = nb * BLOCK_N, n_end = n_start + BLOCK_N < N ? n_start + BLOCK_N : N;
        memset(acc, 0, sizeof acc);
        for (int64_t n = n_start; n < n_end;) {
            const int full = n + W_ROWS <= n_end;
            const int64_t at = (n - n_start) * X_ROWS;
            (full ? FULL : SINGLE)[J->W.q6][M](&J->A, &J->W, n, acc + at, accm + at);
            n += full ? W_ROWS : 1;
        }
        for (int64_t n = n_start; n < n_end; n++)
            for (int i = 0; i < M; i++) {
                const int64_t at = (n - n_start) * X_ROWS + i;
                put(J->out, i * N + n, acc[at] + accm[at] + (J->bias ? J->bias[n] : 0.0f), J->bf16);
            }
    }
}

/* Many rows (a prefill): each vector's lanes are GROUP rows of x, so a super-block's scaling serves
 * GROUP outputs an instruction. x is interleaved by groups of rows, 4 values of each row in turn
 * (`xi`), and a weight row's 4 values, broadcast, meet them in one `dot4` (AVX-512 VNNI: one
 * `vpdpbusd`, 64 products); each lane ends a super-block as `tile`'s lanes do, on its own row. */
#define G_ROWS 4     /* weight rows per tile */
#define BLOCK_NG 32  /* weight rows unpacked to a byte a value at a time */

/* Rows of x in groups of GROUP: values interleaved (group, k / 4, row, 4 bytes), and per super-block the
 * rows' scales and, per pair of sub-blocks, their sums as 16-bit halves of one lane. */
typedef struct {
    int8_t *xi;
    float *d;
    int32_t *sums;
    int64_t groups;
} lanes_x;

typedef struct {
    const job *J;
    lanes_x L;
} gemm_job;

static void interleave_part(void *ctx, int64_t part, int64_t parts) {
    const gemm_job *G = ctx;
    const job *J = G->J;
    const int64_t K = J->W.K, supers = J->W.supers, pairs = J->W.subs / 2;
    for (int64_t g = G->L.groups * part / parts; g < G->L.groups * (part + 1) / parts; g++)
        for (int l = 0; l < GROUP; l++) {
            const int64_t row = g * GROUP + l;
            int32_t *xi = (int32_t *)(G->L.xi + g * K * GROUP) + l;
            if (row >= J->M) { /* padding: rows of zeros, whose lanes nothing reads */
                for (int64_t t = 0; t < K / 4; t++) xi[t * GROUP] = 0;
                for (int64_t s = 0; s < supers; s++) {
                    G->L.d[(g * supers + s) * GROUP + l] = 0.0f;
                    for (int64_t p = 0; p < pairs; p++) G->L.sums[((g * supers + s) * pairs + p) * GROUP + l] = 0;
                }
                continue;
            }
            const int32_t *q = (const int32_t *)(J->A.q + row * K);
            for (int64_t t = 0; t < K / 4; t++) xi[t * GROUP] = q[t];
            for (int64_t s = 0; s < supers; s++) {
                G->L.d[(g * supers + s) * GROUP + l] = J->A.d[row * supers + s];
                const int16_t *b = J->A.sums + (row * supers + s) * MAX_SUBS;
                for (int64_t p = 0; p < pairs; p++)
                    G->L.sums[((g * supers + s) * pairs + p) * GROUP + l] = (int32_t)((uint32_t)(uint16_t)b[2 * p] | ((uint32_t)(uint16_t)b[2 * p + 1] << 16));
            }
        }
}

/* Sub-block b's scale (`mins` 0) or minimum (1) from a super-block's bytes: Q4_K's unsigned scales, then
 * minimums; Q6_K's signed scales, which serve as both. */
static inline int32_t scale_of(const uint8_t *sub, int64_t b, int64_t subs, const int mins, const int q6) {
    return q6 ? (int8_t)sub[b] : sub[b + (mins ? subs : 0)];
}

/* Group g of x against r weight rows from n (their values a byte each in `wu`, K apart) over all of k. */
static inline __attribute__((always_inline)) void gemm_tile(const gemm_job *G, int64_t g, int64_t n, const uint8_t *wu, const int r,
                                                            const int q6) {
    const job *J = G->J;
    const weights *W = &J->W;
    const int64_t K = W->K, S = W->size, supers = W->supers, subs = W->subs, pairs = subs / 2;
    const int size = q6 ? 16 : 32; /* values per sub-block */
    const ivec *xg = (const ivec *)(G->L.xi + g * K * GROUP);
    fvec acc[G_ROWS], accm[G_ROWS];
    for (int j = 0; j < r; j++) acc[j] = fzero(), accm[j] = fzero();
    for (int64_t s = 0; s < supers; s++) {
        ivec total[G_ROWS], mins[G_ROWS];
        const uint8_t *sub[G_ROWS];
        for (int j = 0; j < r; j++) total[j] = mins[j] = izero(), sub[j] = W->sub + ((n + j) * supers + s) * W->sub_stride;
        for (int64_t b = 0; b < subs; b++) {
            ivec part[G_ROWS];
            for (int j = 0; j < r; j++) part[j] = izero();
            const int64_t k0 = s * S + b * size;
            for (int t = 0; t < size / 4; t++) {
                const ivec x = iload(xg + k0 / 4 + t);
                for (int j = 0; j < r; j++) {
                    int32_t w;
                    memcpy(&w, wu + j * K + k0 + 4 * t, sizeof w);
                    part[j] = dot4(part[j], iset1(w), x);
                }
            }
            for (int j = 0; j < r; j++) total[j] = iadd(total[j], imul(part[j], iset1(scale_of(sub[j], b, subs, 0, q6))));
        }
        for (int64_t p = 0; p < pairs; p++) {
            const ivec sums = iload((const ivec *)(G->L.sums + ((g * supers + s) * pairs + p) * GROUP));
            for (int j = 0; j < r; j++) {
                const uint32_t lo = (uint16_t)scale_of(sub[j], 2 * p, subs, 1, q6), hi = (uint16_t)scale_of(sub[j], 2 * p + 1, subs, 1, q6);
                mins[j] = dot2(mins[j], sums, iset1((int32_t)(lo | hi << 16)));
            }
        }
        const fvec dx = fload(G->L.d + (g * supers + s) * GROUP);
        for (int j = 0; j < r; j++) {
            acc[j] = ffma(itof(total[j]), fmul(fset1(W->d[(n + j) * supers + s]), dx), acc[j]);
            accm[j] = ffma(itof(mins[j]), fmul(fset1(W->o[(n + j) * supers + s]), dx), accm[j]);
        }
    }
    for (int j = 0; j < r; j++) {
        float y[GROUP];
        fstore(y, fadd(fadd(acc[j], accm[j]), fset1(J->bias ? J->bias[n + j] : 0.0f)));
        for (int l = 0; l < GROUP && g * GROUP + l < J->M; l++) put(J->out, (g * GROUP + l) * J->N + n + j, y[l], J->bf16);
    }
}

typedef void (*gemm_fn)(const gemm_job *, int64_t, int64_t, const uint8_t *);
static void gemm_full_q4(const gemm_job *G, int64_t g, int64_t n, const uint8_t *wu) { gemm_tile(G, g, n, wu, G_ROWS, 0); }
static void gemm_single_q4(const gemm_job *G, int64_t g, int64_t n, const uint8_t *wu) { gemm_tile(G, g, n, wu, 1, 0); }
static void gemm_full_q6(const gemm_job *G, int64_t g, int64_t n, const uint8_t *wu) { gemm_tile(G, g, n, wu, G_ROWS, 1); }
static void gemm_single_q6(const gemm_job *G, int64_t g, int64_t n, const uint8_t *wu) { gemm_tile(G, g, n, wu, 1, 1); }
static const gemm_fn GEMM_FULL[] = {gemm_full_q4, gemm_full_q6}, GEMM_SINGLE[] = {gemm_single_q4, gemm_single_q6};

/* Part `part` of `parts`: its share of the blocks of BLOCK_NG weight rows, unpacked a byte a value
 * once, against every group of x. */
static void gemm_part(void *ctx, int64_t part, int64_t parts) {
    const gemm_job *G = ctx;
    const job *J = G->J;
    const int64_t K = J->W.K, N = J->N, blocks = (N + BLOCK_NG - 1) / BLOCK_NG, chunk_bytes = J->W.q6 ? 48 : 32;
    const int q6 = J->W.q6;
    uint8_t *wu = vec_alloc(BLOCK_NG * K);
    for (int64_t nb = blocks * part / parts; nb < blocks * (part + 1) / parts; nb++) {
        const int64_t n0 = nb * BLOCK_NG, n1 = n0 + BLOCK_NG < N ? n0 + BLOCK_NG : N;
        for (int64_t n = n0; n < n1; n++)
            for (int64_t at = 0; at < K; at += CHUNK) {
                __m256i lo, hi;
                values64(J->W.qs + n * J->W.row_bytes + at / CHUNK * chunk_bytes, q6, &lo, &hi);
                _mm256_store_si256((__m256i *)(wu + (n - n0) * K + at), lo);
                _mm256_store_si256((__m256i *)(wu + (n - n0) * K + at + 32), hi);
            }
        for (int64_t g = 0; g < G->L.groups; g++)
            for (int64_t n = n0; n < n1;) {
                const int full = n + G_ROWS <= n1;
                (full ? GEMM_FULL : GEMM_SINGLE)[q6](G, g, n, wu + (n - n0) * K);
                n += full ? G_ROWS : 1;
            }
    }
    free(wu);
}

/* x: M x K, fp32 or bf16 (bf16 1), as is out: M x N; Q4_K (q6 0): qs N x K/2, sub N x supers x 2 subs
 * (K / 16 a row) bytes; Q6_K (q6 1): qs N x 3 K / 4, sub N x K / 16 signed bytes; d and o: N x supers,
 * bias: N or NULL; super-blocks of `size` values (Q4_K: 64, 128 or 256; Q6_K: 256), K a multiple of it. */
void linear_q4(const void *x, const uint8_t *qs, const uint8_t *sub, const float *d, const float *o, int64_t size, int q6,
               const float *bias, void *out, int64_t M, int64_t N, int64_t K, int threads, int bf16) {
    job J = {.x = x, .bias = bias, .out = out, .M = M, .N = N, .bf16 = bf16,
             .W = {.qs = qs, .sub = sub, .d = d, .o = o, .K = K, .size = size, .supers = K / size, .subs = size / (q6 ? 16 : 32),
                   .sub_stride = q6 ? size / 16 : 2 * (size / 32), .row_bytes = q6 ? K / 4 * 3 : K / 2, .q6 = q6,
                   .sub_end = sub + N * (K / 16)}};
    uint8_t take[16];
    for (int i = 0; i < 16; i++) take[i] = i < J.W.subs ? (uint8_t)(J.W.subs + i) : 0x80;
    J.W.mins = _mm_loadu_si128((const __m128i *)take);
    J.A.q = malloc(M * K);
    J.A.d = malloc(sizeof(float) * M * J.W.supers);
    J.A.sums = malloc(sizeof(int16_t) * M * J.W.supers * MAX_SUBS);
    pool_run(quantize_part, &J, M < threads ? M : threads);
    if (M > X_ROWS) {
        gemm_job G = {.J = &J, .L = {.groups = (M + GROUP - 1) / GROUP}};
        G.L.xi = vec_alloc(G.L.groups * GROUP * K);
        G.L.d = vec_alloc(sizeof(float) * G.L.groups * J.W.supers * GROUP);
        G.L.sums = vec_alloc(sizeof(int32_t) * G.L.groups * J.W.supers * (J.W.subs / 2) * GROUP);
        pool_run(interleave_part, &G, G.L.groups < threads ? G.L.groups : threads);
        pool_run(gemm_part, &G, threads);
        free(G.L.xi);
        free(G.L.d);
        free(G.L.sums);
    } else
        pool_run(multiply_part, &J, threads);
    free(J.A.q);
    free(J.A.d);
    free(J.A.sums);
}
