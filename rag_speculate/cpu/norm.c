/* The RMS norm of fp32 rows as the Llama-family norm modules compute it in torch, bit for bit:
 *     out = w * (x * (1 / sqrt(sum(x * x) / n + eps)))
 * in one call where torch runs seven operators. Built with -DVALUES_BF16, for bf16 rows and weights:
 * the modules widen x to fp32 for the same steps, round x * scale to bf16, and multiply by w in bf16
 * (in fp32, rounded once: `bf16.h`).
 *
 * Every step but the sum rounds one IEEE operation, so it is the same in C. The sum is torch's
 * `cascade_sum` for a contiguous row (aten/src/ATen/native/cpu/SumKernel.cpp): vectors of LANES
 * floats (its Vectorized<float>) added lane by lane into four streams,
 * vector i into stream i % 4; each stream a cascade of LEVELS partial sums, the lowest folded into
 * the next every 2^power vectors and so on up; then the vectors left past the streams into stream 0,
 * streams 1-3 into stream 0, the floats past the last vector one by one, and the lanes in order.
 * The same additions in the same order give the same bits; `norm.py` checks them against the
 * module's own forward before anything uses this.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

/* 8 on AVX-512 CPUs too: SumKernel.cpp registers its kernel with REGISTER_DISPATCH, which leaves the
 * AVX-512 slot empty (DispatchStub.h), so torch runs the AVX2 build, whose vectors hold 8 floats. */
#define LANES 8
#define STREAMS 4 /* row_sum's ilp_factor */
#define LEVELS 4  /* multi_row_sum's num_levels */

/* utils::CeilLog2: 1 up to 2, else the bits of x - 1. */
static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t bits = 0;
    for (uint64_t v = (uint64_t)x - 1; v; v >>= 1) bits++;
    return bits;
}

/* Vector v of x's squares added lane by lane into `acc`. */
static inline void add_squares(float *acc, const float *x, int64_t v) {
    const float *p = x + v * LANES;
    for (int l = 0; l < LANES; l++) acc[l] += p[l] * p[l];
}

static float sum_of_squares(const float *x, int64_t n) {
    const int64_t vectors = n / LANES, size = vectors / STREAMS;
    const int64_t power = ceil_log2(size) / LEVELS > 4 ? ceil_log2(size) / LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    float acc[LEVELS][STREAMS][LANES] = {{{0.0f}}};
    int64_t i = 0;
    while (i + step <= size) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < STREAMS; k++) add_squares(acc[0][k], x, i * STREAMS + k);
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < STREAMS; k++)
                for (int l = 0; l < LANES; l++) acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0.0f;
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < STREAMS; k++) add_squares(acc[0][k], x, i * STREAMS + k);
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < STREAMS; k++)
            for (int l = 0; l < LANES; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = size * STREAMS; v < vectors; v++) add_squares(acc[0][0], x, v);
    for (int k = 1; k < STREAMS; k++)
        for (int l = 0; l < LANES; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = vectors * LANES; e < n; e++) total += x[e] * x[e];
    for (int l = 0; l < LANES; l++) total += acc[0][0][l];
    return total;
}

/* x, out: rows x n; w: n; n at least LANES. */
void rms_norm(const value *x, const value *w, value *out, int64_t rows, int64_t n, float eps) {
    float *row = malloc(sizeof(float) * n);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t e = 0; e < n; e++) row[e] = WIDEN(x[r * n + e]);
        const float scale = 1.0f / sqrtf(sum_of_squares(row, n) / (float)n + eps);
        for (int64_t e = 0; e < n; e++) out[r * n + e] = ROUND(WIDEN(w[e]) * WIDEN(ROUND(row[e] * scale)));
    }
    free(row);
}
