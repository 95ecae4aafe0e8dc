/* y = x W^T (+ b) for a few rows of x, fp32, AVX2 + FMA, OpenMP over the weight's rows.
 *
 * Decoding and verifying a draft multiply 1 to 16 rows by every weight matrix, so the product is
 * bound by reading the weights once from memory. Each weight row is read once, and used against
 * all rows of x while it is in registers; BLAS GEMMs pack the weights first (a second pass over
 * them), and on this project's AMD CPU MKL's GEMV takes 1.5x this kernel's time for a single row.
 *
 * Tiles of 2 weight rows x up to 6 rows of x keep 12 accumulators in registers and share each
 * load of x between the two weight rows.
 */
#include <immintrin.h>
#include <stdint.h>

#define W_ROWS 2
#define X_ROWS 6

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* m rows of x against W_ROWS rows of w; m is a constant in each instance, so the loops unroll. */
static inline __attribute__((always_inline)) void tile(const float *x, const float *w, float *out, const int m,
                                                       int64_t K, int64_t N) {
    __m256 acc[W_ROWS][X_ROWS];
    float tail[W_ROWS][X_ROWS];
    int64_t k8 = K & ~(int64_t)7;
    for (int r = 0; r < W_ROWS; r++)
        for (int i = 0; i < m; i++) acc[r][i] = _mm256_setzero_ps(), tail[r][i] = 0.0f;
    for (int64_t k = 0; k < k8; k += 8) {
        __m256 wv[W_ROWS];
        for (int r = 0; r < W_ROWS; r++) wv[r] = _mm256_loadu_ps(w + r * K + k);
        for (int i = 0; i < m; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * K + k);
            for (int r = 0; r < W_ROWS; r++) acc[r][i] = _mm256_fmadd_ps(wv[r], xv, acc[r][i]);
        }
    }
    for (int64_t k = k8; k < K; k++)
        for (int r = 0; r < W_ROWS; r++)
            for (int i = 0; i < m; i++) tail[r][i] += w[r * K + k] * x[i * K + k];
    for (int r = 0; r < W_ROWS; r++)
        for (int i = 0; i < m; i++) out[i * N + r] = sum8(acc[r][i]) + tail[r][i];
}

#define TILE(m) \
    static void tile##m(const float *x, const float *w, float *out, int64_t K, int64_t N) { tile(x, w, out, m, K, N); }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)
typedef void (*tile_fn)(const float *, const float *, float *, int64_t, int64_t);
static const tile_fn TILES[X_ROWS + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6};

/* x: M x K, w: N x K, bias: N or NULL, out: M x N; all contiguous. */
void small_linear(const float *x, const float *w, const float *bias, float *out, int64_t M, int64_t N, int64_t K,
                  int threads) {
    int64_t pairs = N / W_ROWS;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < pairs; p++) {
        int64_t n = p * W_ROWS;
        for (int64_t m0 = 0; m0 < M; m0 += X_ROWS) {
            int64_t m = M - m0 < X_ROWS ? M - m0 : X_ROWS;
            TILES[m](x + m0 * K, w + n * K, out + m0 * N + n, K, N);
        }
    }
    for (int64_t n = pairs * W_ROWS; n < N; n++)
        for (int64_t i = 0; i < M; i++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += w[n * K + k] * x[i * K + k];
            out[i * N + n] = s;
        }
    if (bias)
        for (int64_t i = 0; i < M; i++)
            for (int64_t n = 0; n < N; n++) out[i * N + n] += bias[n];
}
