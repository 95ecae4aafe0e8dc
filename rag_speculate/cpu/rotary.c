/* Rotary position embedding of fp32 query or key heads as transformers' `apply_rotary_pos_emb`
 * computes it in torch, bit for bit, in one call where torch runs five operators a tensor:
 *     out = (x * cos) + (rotate_half(x) * sin),  rotate_half(x) = cat(-x[half:], x[:half])
 * Each output is two products and a sum, each rounded once (the negation is exact), so the same
 * three operations in C give the same bits (built with -ffp-contract=off: no fused multiply-add).
 * Built with -DVALUES_BF16, for bf16 heads, cos and sin: each of the three rounded to bf16 (`bf16.h`).
 */
#include <stdint.h>

#include "bf16.h"

/* A product or sum of two values, rounded as torch rounds it in their dtype. */
#define MUL(a, b) ROUND(WIDEN(a) * WIDEN(b))
#define ADD(a, b) ROUND(WIDEN(a) + WIDEN(b))
#define NEG(a) ROUND(-WIDEN(a))

/* x: [batch, heads, rows, dims] at element strides (sb, sh, sr), each vector contiguous; cos, sin:
 * [batch, rows, dims] contiguous; out: [batch, heads, rows, dims] contiguous. dims: even. */
static void rotate(const value *x, const value *cos, const value *sin, value *out, int64_t batch, int64_t heads, int64_t rows,
                   int64_t dims, int64_t sb, int64_t sh, int64_t sr) {
    const int64_t half = dims / 2;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t r = 0; r < rows; r++) {
                const value *v = x + b * sb + h * sh + r * sr, *c = cos + (b * rows + r) * dims, *s = sin + (b * rows + r) * dims;
                value *o = out + ((b * heads + h) * rows + r) * dims;
                for (int64_t d = 0; d < half; d++) o[d] = ADD(MUL(v[d], c[d]), MUL(NEG(v[d + half]), s[d]));
                for (int64_t d = half; d < dims; d++) o[d] = ADD(MUL(v[d], c[d]), MUL(v[d - half], s[d]));
            }
}

/* A layer's queries (q_heads at strides qb, qh, qr) and keys (k_heads at kb, kh, kr) in one call. */
void rotary(const value *q, const value *k, const value *cos, const value *sin, value *q_out, value *k_out, int64_t batch, int64_t rows,
            int64_t dims, int64_t q_heads, int64_t qb, int64_t qh, int64_t qr, int64_t k_heads, int64_t kb, int64_t kh, int64_t kr) {
    rotate(q, cos, sin, q_out, batch, q_heads, rows, dims, qb, qh, qr);
    rotate(k, cos, sin, k_out, batch, k_heads, rows, dims, kb, kh, kr);
}
