/* Attention of query rows over a key/value cache, each row computed as if it were alone: fp32, or
 * bf16 (-DATTENTION_BF16: widened to fp32, one rounding at the end); AVX-512F or AVX2 + FMA; query
 * heads x rows shared among the kernels' threads (pool.c).
 *
 * The invariant: a query row's result is the same sequence of operations over the entries it sees,
 * whatever rows are beside it and whatever entries it does not see. Scores are dot products summed
 * chunk after chunk of the head's dims; probabilities are computed entry by entry (an entry's does
 * not depend on where it sits); their sum and the weighted sum of values accumulate entry after
 * entry in order. An entry a row does not see (masked, or after it under a causal mask) gets
 * probability exactly 0, which changes no sum. So a prefill, a draft tree's verification and one
 * decoding step give a token the same bits.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define EXP_FLOOR -87.0f /* below, exp underflows fp32's normal range: the probability is 0 */
#define MASKED -1e30f    /* an additive mask at or below this hides the entry */

#ifdef __AVX512F__
#define LANES 16
typedef __m512 vec;
typedef __mmask16 vmask;
#define vzero() _mm512_setzero_ps()
#define vset1(x) _mm512_set1_ps(x)
#define vload(p) _mm512_loadu_ps(p)
#define vstore(p, v) _mm512_storeu_ps(p, v)
#define vadd(a, b) _mm512_add_ps(a, b)
#define vsub(a, b) _mm512_sub_ps(a, b)
#define vmul(a, b) _mm512_mul_ps(a, b)
#define vmax(a, b) _mm512_max_ps(a, b)
#define vfmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vfnmadd(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define vreduce(v) _mm512_reduce_add_ps(v)
#define vround(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vwiden(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
/* p * 2^n for integral n, and lanes of x below the floor set to 0. */
#define vscale(p, n) _mm512_scalef_ps(p, n)
#define vabove(x, floor) _mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ)
#define vkeep(m, v) _mm512_maskz_mov_ps(m, v)
#else
#define LANES 8
typedef __m256 vec;
typedef __m256 vmask;
#define vzero() _mm256_setzero_ps()
#define vset1(x) _mm256_set1_ps(x)
#define vload(p) _mm256_loadu_ps(p)
#define vstore(p, v) _mm256_storeu_ps(p, v)
#define vadd(a, b) _mm256_add_ps(a, b)
#define vsub(a, b) _mm256_sub_ps(a, b)
#define vmul(a, b) _mm256_mul_ps(a, b)
#define vmax(a, b) _mm256_max_ps(a, b)
#define vfmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vfnmadd(a, b, c) _mm256_fnmadd_ps(a, b, c)
static inline float vreduce(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}
#define vround(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vwiden(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
static inline __m256 vscale(__m256 p, __m256 n) { /* n in [-126, 0]: 2^n built in the exponent bits */
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#define vabove(x, floor) _mm256_cmp_ps(x, floor, _CMP_GE_OQ)
#define vkeep(m, v) _mm256_and_ps(m, v)
#endif

#ifdef ATTENTION_BF16
typedef uint16_t elem;
#define load(p) vwiden(p)
#define store_elem(f) bf16_round(f)
#else
typedef float elem;
#define load(p) vload(p)
#define store_elem(f) (f)
#endif

/* exp(x) for x <= 0, lane by lane (Cephes' expf polynomial); 0 below EXP_FLOOR. */
static inline vec exp_ps(vec x) {
    const vmask live = vabove(x, vset1(EXP_FLOOR));
    x = vmax(x, vset1(EXP_FLOOR));
    const vec n = vround(vmul(x, vset1(1.44269504088896341f)));
    vec r = vfnmadd(n, vset1(0.693359375f), x);
    r = vfnmadd(n, vset1(-2.12194440e-4f), r);
    vec p = vset1(1.9875691500e-4f);
    p = vfmadd(p, r, vset1(1.3981999507e-3f));
    p = vfmadd(p, r, vset1(8.3334519073e-3f));
    p = vfmadd(p, r, vset1(4.1665795894e-2f));
    p = vfmadd(p, r, vset1(1.6666665459e-1f));
    p = vfmadd(p, r, vset1(5.0000001201e-1f));
    p = vfmadd(p, vmul(r, r), vadd(r, vset1(1.0f)));
    return vkeep(live, vscale(p, n));
}

/* Query vectors of one block: (query head, row) pairs of one key/value head. */
#define BLOCK 4
/* Chunks of the value vectors summed per pass over the entries (BLOCK x PASS accumulators). */
#define PASS 4
/* Entries scored side by side, at most. */
#define SIDE 4

/* q: [heads, rows, dims]; k, v: [kv_heads, length, dims] with heads `*_head_stride` elements apart;
 * mask: [rows, length] added to the scaled scores (MASKED or below: not seen), or NULL; causal >= 0:
 * row r sees only entries up to causal + r; out: [heads, rows, dims]. Query head h reads key/value
 * head h / (heads / kv_heads). dims: a multiple of LANES.
 *
 * A block shares each load of a key or value chunk between up to BLOCK query vectors of the same
 * key/value head, and stops at the last entry any of them sees; every vector's own sums run in the
 * same order whatever its block holds. The blocks are shared among the kernels' threads (`pool.c`)
 * as they come: a causal prefill's later rows see more entries. */
typedef struct {
    const elem *q, *k, *v;
    const float *mask;
    elem *out;
    int64_t heads, kv_heads, rows, length, dims, k_head_stride, v_head_stride, causal;
    float scale;
    atomic_llong next;
} job;

void pool_run(void (*task)(void *, int64_t, int64_t), void *ctx, int64_t parts);

/* A score: the dot product's lanes summed, scaled and masked (-inf where the entry is not seen). */
static inline float scored(vec dot, float scale, float bias, int hidden) {
    const float s = vreduce(dot) * scale;
    return hidden || bias <= MASKED ? -INFINITY : s + bias;
}

/* Entries [j, j + count) scored for the block's n query vectors (query: their values, LANES a
 * chunk), into p (`padded` a vector) and the running maxima `top`. */
static inline __attribute__((always_inline)) void score(const elem *keys, const float *query, const float *mask, const int64_t *seen,
                                                        int64_t first, int64_t rows, int64_t length, int64_t dims, float scale,
                                                        int64_t j, const int n, const int count, float *p, int64_t padded, float *top) {
    vec dot[SIDE][BLOCK];
    for (int e = 0; e < count; e++)
        for (int b = 0; b < n; b++) dot[e][b] = vzero();
    for (int64_t c = 0; c < dims / LANES; c++) {
        vec qv[BLOCK];
        for (int b = 0; b < n; b++) qv[b] = vload(query + b * dims + LANES * c);
        for (int e = 0; e < count; e++) {
            const vec key = load(keys + (j + e) * dims + LANES * c);
            for (int b = 0; b < n; b++) dot[e][b] = vfmadd(qv[b], key, dot[e][b]);
        }
    }
    for (int e = 0; e < count; e++)
        for (int b = 0; b < n; b++) {
            const float bias = mask ? mask[(first + b) % rows * length + j + e] : 0.0f;
            const float s = scored(dot[e][b], scale, bias, j + e >= seen[b]);
            p[b * padded + j + e] = s;
            top[b] = s > top[b] ? s : top[b];
        }
}

/* Chunks [c0, c0 + width) of the block's n outputs: the values weighted by p, over entries [0, end). */
static inline __attribute__((always_inline)) void weigh(const elem *values, const float *p, int64_t padded, int64_t end, int64_t dims,
                                                        int64_t c0, const int n, const int width, const float *total, elem *out) {
    vec acc[BLOCK][PASS];
    for (int b = 0; b < n; b++)
        for (int c = 0; c < width; c++) acc[b][c] = vzero();
    for (int64_t j = 0; j < end; j++)
        for (int c = 0; c < width; c++) {
            const vec value = load(values + j * dims + LANES * (c0 + c));
            for (int b = 0; b < n; b++) acc[b][c] = vfmadd(vset1(p[b * padded + j]), value, acc[b][c]);
        }
    for (int b = 0; b < n; b++)
        for (int c = 0; c < width; c++) {
            float lanes[LANES];
            vstore(lanes, vmul(acc[b][c], vset1(1.0f / total[b])));
            for (int l = 0; l < LANES; l++) out[b * dims + LANES * (c0 + c) + l] = store_elem(lanes[l]);
        }
}

/* The block of `n` query vectors starting at vector `first` of key/value head `g`; `p` and `query`
 * are the caller's scratch. Inlined for each n, so every sum stays in a register. */
static inline __attribute__((always_inline)) void attend_block(const job *J, int64_t g, int64_t first, const int n, float *p,
                                                               float *query) {
    const float *mask = J->mask;
    const int64_t rows = J->rows, length = J->length, dims = J->dims, causal = J->causal;
    const int64_t group = J->heads / J->kv_heads, chunks = dims / LANES, padded = (length + LANES - 1) / LANES * LANES;
    const elem *keys = J->k + g * J->k_head_stride, *values = J->v + g * J->v_head_stride;
    /* Vector b is query head g * group + (first + b) / rows, row (first + b) % rows: both index
     * [heads, rows] as one run, starting at head g * group. */
    const int64_t base = g * group * rows + first;
    int64_t seen[BLOCK], end = 0; /* entries [0, seen[b]) may be seen by vector b */
    for (int b = 0; b < n; b++) {
        const int64_t row = (first + b) % rows;
        seen[b] = causal >= 0 && causal + row + 1 < length ? causal + row + 1 : length;
        /* Past the last entry its mask shows, a row sees nothing: neither computed nor summed. */
        if (mask)
            while (seen[b] > 1 && mask[row * length + seen[b] - 1] <= MASKED) seen[b]--;
        end = seen[b] > end ? seen[b] : end;
        for (int64_t c = 0; c < chunks; c++) vstore(query + b * dims + LANES * c, load(J->q + (base + b) * dims + LANES * c));
    }
    float top[BLOCK], total[BLOCK];
    for (int b = 0; b < n; b++) top[b] = -INFINITY, total[b] = 0.0f;
    /* A few entries scored side by side: an entry's dot product is one chain of fused multiply-adds
     * over the chunks, so the others' keep the processor busy while it waits on each (as many as
     * AVX2's 16 registers hold beside the block's query chunks). */
    const int side = n <= 2 ? SIDE : n == 3 ? 3 : 2;
    int64_t j = 0;
    for (; j + side <= end; j += side) score(keys, query, mask, seen, first, rows, length, dims, J->scale, j, n, side, p, padded, top);
    for (; j < end; j++) score(keys, query, mask, seen, first, rows, length, dims, J->scale, j, n, 1, p, padded, top);
    for (int b = 0; b < n; b++) {
        float *row = p + b * padded;
        const int64_t stop = (end + LANES - 1) / LANES * LANES;
        for (int64_t i = end; i < stop; i++) row[i] = -INFINITY;
        const vec shift = vset1(top[b]);
        for (int64_t i = 0; i < stop; i += LANES) vstore(row + i, exp_ps(vsub(vload(row + i), shift)));
        for (int64_t i = 0; i < end; i++) total[b] += row[i];
    }
    /* Entries not seen have probability 0, and adding 0 x value changes no sum. */
    elem *out = J->out + base * dims;
    int64_t c0 = 0;
    for (; c0 + PASS <= chunks; c0 += PASS) weigh(values, p, padded, end, dims, c0, n, PASS, total, out);
    for (; c0 < chunks; c0++) weigh(values, p, padded, end, dims, c0, n, 1, total, out);
}

#define BLOCK_OF(n) \
    static void block_##n(const job *J, int64_t g, int64_t first, float *p, float *query) { attend_block(J, g, first, n, p, query); }
BLOCK_OF(1) BLOCK_OF(2) BLOCK_OF(3) BLOCK_OF(4)
static void (*const BLOCKS[BLOCK + 1])(const job *, int64_t, int64_t, float *, float *) = {0, block_1, block_2, block_3, block_4};

static void attend_part(void *ctx, int64_t part, int64_t parts) {
    (void)part;
    job *J = ctx;
    const int64_t group = J->heads / J->kv_heads, padded = (J->length + LANES - 1) / LANES * LANES;
    /* A key/value head's vectors in blocks of at most BLOCK, as even as they divide. */
    const int64_t vectors = group * J->rows, blocks = (vectors + BLOCK - 1) / BLOCK, size = (vectors + blocks - 1) / blocks;
    const int64_t tasks = J->kv_heads * blocks;
    /* Blocks taken 4 at a time where there are many. Where there are few (a decoding step has one
     * per few query heads), a thread takes all of a key/value head's blocks where the heads share
     * out evenly: it reads that head's keys and values from memory once, then from its caches,
     * rather than two threads each reading them from memory. Else one at a time. */
    const int64_t grab = tasks >= 8 * parts ? 4 : J->kv_heads % parts == 0 ? blocks : 1;
    float *p = malloc(sizeof(float) * BLOCK * padded);
    float *query = malloc(sizeof(float) * BLOCK * J->dims);
    for (int64_t start; (start = atomic_fetch_add(&J->next, grab)) < tasks;)
        for (int64_t task = start; task < start + grab && task < tasks; task++) {
            const int64_t g = task / blocks, first = task % blocks * size;
            const int64_t n = vectors - first < size ? vectors - first : size;
            BLOCKS[n](J, g, first, p, query);
        }
    free(query);
    free(p);
}

void attention(const elem *q, const elem *k, const elem *v, const float *mask, elem *out, int64_t heads, int64_t kv_heads,
               int64_t rows, int64_t length, int64_t dims, int64_t k_head_stride, int64_t v_head_stride, float scale,
               int64_t causal, int threads) {
    job J = {.q = q, .k = k, .v = v, .mask = mask, .out = out, .heads = heads, .kv_heads = kv_heads, .rows = rows,
             .length = length, .dims = dims, .k_head_stride = k_head_stride, .v_head_stride = v_head_stride,
             .causal = causal, .scale = scale};
    atomic_init(&J.next, 0);
    pool_run(attend_part, &J, threads);
}
