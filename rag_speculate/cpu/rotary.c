/* Rotary position embedding of fp32 query or key heads as transformers' `apply_rotary_pos_emb`
 * computes it in torch, bit for bit, in one call where torch runs five operators a tensor:
 *     out = (x * cos) + (rotate_half(x) * sin),  rotate_half(x) = cat(-x[half:], x[:half])
 * Each output is two products and a sum, each rounded once (the negation is exact), so the same
 * three operations in C give the same bits (built with -ffp-contract=off: no fused multiply-add).
 */
#include <stdint.h>

/* x: [batch, heads, rows, dims] at element strides (sb, sh, sr), each vector contiguous; cos, sin:
 * [batch, rows, dims] contiguous; out: [batch, heads, rows, dims] contiguous. dims: even. */
static void rotate(const float *x, const float *cos, const float *sin, float *out, int64_t batch, int64_t heads, int64_t rows,
                   int64_t dims, int64_t sb, int64_t sh, int64_t sr) {
    const int64_t half = dims / 2;
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < heads; h++)
            for (int64_t r = 0; r < rows; r++) {
                const float *v = x + b * sb + h * sh + r * sr, *c = cos + (b * rows + r) * dims, *s = sin + (b * rows + r) * dims;
                float *o = out + ((b * heads + h) * rows + r) * dims;
                for (int64_t d = 0; d < half; d++) o[d] = v[d] * c[d] + -v[d + half] * s[d];
                for (int64_t d = half; d < dims; d++) o[d] = v[d] * c[d] + v[d - half] * s[d];
            }
}

/* A layer's queries (q_heads at strides qb, qh, qr) and keys (k_heads at kb, kh, kr) in one call. */
void rotary(const float *q, const float *k, const float *cos, const float *sin, float *q_out, float *k_out, int64_t batch, int64_t rows,
            int64_t dims, int64_t q_heads, int64_t qb, int64_t qh, int64_t qr, int64_t k_heads, int64_t kb, int64_t kh, int64_t kr) {
    rotate(q, cos, sin, q_out, batch, q_heads, rows, dims, qb, qh, qr);
    rotate(k, cos, sin, k_out, batch, k_heads, rows, dims, kb, kh, kr);
}
