/* float32 products for decode-sized inputs (a few rows) against an [N, K] weight, for AVX-512 CPUs.
 *
 *   y[m, n] = sum_k x[m, k] * w[n, k]      x: float32 [M, K], w: float32 [N, K] (a linear layer's weight)
 *
 * A decode step reads every weight once, so at a few rows the product is bound by memory, and past about
 * eight rows also by arithmetic. torch's kernels reach neither bound at 4-16 rows (at one row, where the
 * product only streams the weights, they are about as fast as this one); benchmarks/decode_products.py
 * times this kernel against F.linear and oneDNN's prepacked weights at 1-16 rows (figures in
 * docs/performance.md).
 *
 * Here the weight keeps its layout (prompts still use torch's GEMM on the same tensor). Each thread takes
 * tiles of TILE_ROWS weight rows; for each tile, passes of up to four activation rows compute the
 * 4 x TILE_ROWS dot products in 24 vector accumulators (ten loads per 24 FMAs), so the tile is read from
 * memory once and from the L1/L2 cache by the later passes. While a tile is being multiplied, the tile
 * PREFETCH_TILES ahead is prefetched into L2, a share of its rows per pass, which keeps the memory busy
 * while the later passes compute. The products are summed in a different order than torch's, so results
 * differ by float32 rounding only.
 *
 * Built by autodeploy/custom_ops/native; on a CPU without AVX-512, f32_small_gemm_supported() returns 0
 * and the callers keep torch's kernels.
 */
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>

int f32_small_gemm_supported(void) { return 1; }

/* weight rows per tile (6 x 4 accumulators leave registers for the 4 activation and 1 weight vectors) */
#define TILE_ROWS 6
/* how far ahead, in tiles of the same thread, to prefetch: the best of 1 / 2 / 4 / 8 when measured
 * (docs/performance.md) */
#define PREFETCH_TILES 4

/* y[i, j] = x[i, :] . w[j, :] for ROWS rows of x (row stride K) and the tile's rows of w (those past
 * `valid` are computed from row 0 and not stored); prefetches rows [pf_begin, pf_end) of `ahead`. */
#define DEFINE_PASS(ROWS)                                                                                   \
    static inline void pass_##ROWS(const float* x, const float* w, int64_t K, int valid, float* y,        \
                                   int64_t ldy, const float* ahead, int pf_begin, int pf_end) {            \
        __m512 acc[ROWS][TILE_ROWS];                                                                       \
        for (int i = 0; i < ROWS; ++i)                                                                     \
            for (int j = 0; j < TILE_ROWS; ++j) acc[i][j] = _mm512_setzero_ps();                           \
        for (int64_t k = 0; k < K; k += 16) {                                                              \
            __m512 xv[ROWS];                                                                               \
            for (int i = 0; i < ROWS; ++i) xv[i] = _mm512_loadu_ps(x + i * K + k);                         \
            for (int j = pf_begin; j < pf_end; ++j) _mm_prefetch((const char*)(ahead + j * K + k), _MM_HINT_T1); \
            for (int j = 0; j < TILE_ROWS; ++j) {                                                          \
                const __m512 wv = _mm512_loadu_ps(w + (j < valid ? j : 0) * K + k);                        \
                for (int i = 0; i < ROWS; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], wv, acc[i][j]);          \
            }                                                                                              \
        }                                                                                                  \
        for (int i = 0; i < ROWS; ++i)                                                                     \
            for (int j = 0; j < valid; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);              \
    }
DEFINE_PASS(4)
DEFINE_PASS(3)
DEFINE_PASS(2)
DEFINE_PASS(1)

/* Returns 0 on success, -1 if K is not a multiple of 16. */
int f32_small_gemm(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int num_threads) {
    if (K % 16 != 0 || M < 0 || N < 0) return -1;
    if (M == 0 || N == 0) return 0;
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
    const int64_t passes = (M + 3) / 4;
    /* static schedule: each thread's tiles are consecutive, so the tile ahead is its own */
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * TILE_ROWS;
        const int valid = N - n0 < TILE_ROWS ? (int)(N - n0) : TILE_ROWS;
        const float* tile = w + n0 * K;
        const int64_t ahead_n0 = n0 + PREFETCH_TILES * TILE_ROWS;
        const int ahead_rows = ahead_n0 >= N ? 0 : (N - ahead_n0 < TILE_ROWS ? (int)(N - ahead_n0) : TILE_ROWS);
        const float* ahead = w + (ahead_n0 < N ? ahead_n0 : 0) * K;
        int64_t m = 0;
        for (int64_t pass = 0; pass < passes; ++pass) {
            const int pf_begin = (int)(ahead_rows * pass / passes), pf_end = (int)(ahead_rows * (pass + 1) / passes);
            const float* xm = x + m * K;
            float* ym = y + m * N + n0;
            switch (M - m >= 4 ? 4 : M - m) {
                case 4: pass_4(xm, tile, K, valid, ym, N, ahead, pf_begin, pf_end); m += 4; break;
                case 3: pass_3(xm, tile, K, valid, ym, N, ahead, pf_begin, pf_end); m += 3; break;
                case 2: pass_2(xm, tile, K, valid, ym, N, ahead, pf_begin, pf_end); m += 2; break;
                default: pass_1(xm, tile, K, valid, ym, N, ahead, pf_begin, pf_end); m += 1; break;
            }
        }
    }
    return 0;
}

#else

int f32_small_gemm_supported(void) { return 0; }

int f32_small_gemm(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K, int num_threads) {
    (void)x; (void)w; (void)y; (void)M; (void)N; (void)K; (void)num_threads;
    return -1;
}

#endif
