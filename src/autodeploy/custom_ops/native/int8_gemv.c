/* int8-weight products for decode-sized inputs (a few rows), for x86 CPUs with AVX-512 VNNI.
 *
 *   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]      x: float32 [M, K], w: int8 [N, K], scale: bfloat16 [N]
 *
 * Decode reads every weight once per step, so the product must stream the int8 weights at memory speed.
 * Converting each weight to float32 costs more instructions than the memory system leaves time for (the
 * converting loop Inductor generates reads the weights well below the machine's read bandwidth; figures
 * in docs/performance.md). So the weights stay int8 and the activations are quantized instead, to 16 bits per row:
 *
 *   x[m, k] ~= sx[m] * (u[m, k] - 32768),   u = 256 * hi + lo,   hi, lo unsigned bytes,
 *
 * and the dot products are VNNI instructions (vpdpbusd: unsigned bytes times signed bytes, summed in
 * int32): two per 64 weights, plus one against a vector of ones for sum_k w[n, k], which removes the
 * 32768 offset (once per weight row, in the first activation row's pass, rather than once per activation
 * row). The activation rounding is at most 2^-16 of the row's largest value, far below the int8 weight
 * rounding (2^-8 of each weight row's largest value).
 *
 * Built on first use by autodeploy/custom_ops/native/__init__.py with the machine's C compiler
 * (-O3 -march=native -fopenmp). On a CPU without AVX-512 VNNI, int8_gemv_supported() returns 0 and the
 * callers keep torch's kernels.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

int int8_gemv_supported(void) { return 1; }

/* bytes ahead of the current weight position to prefetch: the best of 256 / 1024 / 4096 when measured
 * (docs/performance.md) */
#define PREFETCH_AHEAD 4096
/* weight rows per tile for one activation row: four independent accumulator pairs */
#define TILE_ROWS 4

/* Quantize one activation row (K % 16 == 0) to hi/lo bytes; returns the row's scale sx. */
static float quantize_row(const float* x, int64_t K, uint8_t* hi, uint8_t* lo) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
    float m = _mm512_reduce_max_ps(amax);
    float sx = m > 0.f ? m / 32767.f : 1.f;
    __m512 inv = _mm512_set1_ps(1.f / sx);
    __m512i offset = _mm512_set1_epi32(32768), byte = _mm512_set1_epi32(255);
    for (int64_t k = 0; k < K; k += 16) {
        /* round to nearest even; |x / sx| <= 32767 up to rounding of 1/sx, so clamp */
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), inv));
        q = _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-32767)), _mm512_set1_epi32(32767));
        __m512i u = _mm512_add_epi32(q, offset);
        _mm_storeu_si128((__m128i*)(hi + k), _mm512_cvtepi32_epi8(_mm512_srli_epi32(u, 8)));
        _mm_storeu_si128((__m128i*)(lo + k), _mm512_cvtepi32_epi8(_mm512_and_si512(u, byte)));
    }
    return sx;
}

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}

static inline float finish(__m512i acc_hi, __m512i acc_lo, int64_t weight_sum, float sx, float scale) {
    int64_t dot = (int64_t)_mm512_reduce_add_epi32(acc_hi) * 256 + (int64_t)_mm512_reduce_add_epi32(acc_lo)
                  - 32768LL * weight_sum;
    return (float)dot * sx * scale;
}

/* One activation row (hi/lo bytes) against the tile's rows of w: the VNNI sums for hi and lo, and with
 * `with_sums` (a constant where inlined: two specialized loops) also against ones for sum_k w[n, k], while
 * prefetching the weights ahead (the first row's pass streams the tile from memory; later ones find it in
 * L1). */
static inline __attribute__((always_inline)) void tile_dot(const uint8_t* h, const uint8_t* l, const int8_t* w,
                                                            int64_t K, int64_t rows, int with_sums,
                                                            __m512i* acc_hi, __m512i* acc_lo, __m512i* acc_sum) {
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t k = 0; k < K; k += 64) {
        const __m512i vh = _mm512_loadu_si512((const void*)(h + k));
        const __m512i vl = _mm512_loadu_si512((const void*)(l + k));
        for (int r = 0; r < rows; ++r) {
            const int8_t* wk = w + r * K + k;
            if (with_sums) _mm_prefetch((const char*)(wk + PREFETCH_AHEAD), _MM_HINT_T0);
            const __m512i b = _mm512_loadu_si512((const void*)wk);
            acc_hi[r] = _mm512_dpbusd_epi32(acc_hi[r], vh, b);
            acc_lo[r] = _mm512_dpbusd_epi32(acc_lo[r], vl, b);
            if (with_sums) acc_sum[r] = _mm512_dpbusd_epi32(acc_sum[r], ones, b);
        }
    }
}

/* Returns 0 on success, -1 if the shapes are unsupported (K % 64 != 0) or scratch memory is unavailable. */
int int8_gemv(const float* x, const int8_t* w, const uint16_t* scale, float* y,
              int64_t M, int64_t N, int64_t K, int num_threads) {
    if (K % 64 != 0 || M < 0) return -1;
    if (M == 0) return 0;
    uint8_t* bytes = (uint8_t*)aligned_alloc(64, (size_t)(2 * M * K));
    float* sx = (float*)malloc(sizeof(float) * (size_t)M);
    if (!bytes || !sx) { free(bytes); free(sx); return -1; }
    uint8_t *hi = bytes, *lo = bytes + M * K;
    for (int64_t m = 0; m < M; ++m) sx[m] = quantize_row(x + m * K, K, hi + m * K, lo + m * K);

    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
    #pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t t = 0; t < tiles; ++t) {
        const int64_t n0 = t * TILE_ROWS, rows = N - n0 < TILE_ROWS ? N - n0 : TILE_ROWS;
        /* sum_k w[n, k] of the tile's rows: one more VNNI product per 64 weights, in the first row's pass
         * only (later rows reuse it) */
        int64_t weight_sum[TILE_ROWS] = {0};
        for (int64_t m = 0; m < M; ++m) {
            const uint8_t *h = hi + m * K, *l = lo + m * K;
            __m512i acc_hi[TILE_ROWS], acc_lo[TILE_ROWS], acc_sum[TILE_ROWS];
            for (int r = 0; r < TILE_ROWS; ++r) acc_hi[r] = acc_lo[r] = acc_sum[r] = _mm512_setzero_si512();
            if (m == 0) {
                tile_dot(h, l, w + n0 * K, K, rows, 1, acc_hi, acc_lo, acc_sum);
                for (int r = 0; r < rows; ++r) weight_sum[r] = _mm512_reduce_add_epi32(acc_sum[r]);
            } else {
                tile_dot(h, l, w + n0 * K, K, rows, 0, acc_hi, acc_lo, acc_sum);
            }
            for (int r = 0; r < rows; ++r)
                y[m * N + n0 + r] = finish(acc_hi[r], acc_lo[r], weight_sum[r], sx[m], bf16_to_float(scale[n0 + r]));
        }
    }
    free(bytes);
    free(sx);
    return 0;
}

#else

int int8_gemv_supported(void) { return 0; }

int int8_gemv(const float* x, const int8_t* w, const uint16_t* scale, float* y,
              int64_t M, int64_t N, int64_t K, int num_threads) {
    (void)x; (void)w; (void)scale; (void)y; (void)M; (void)N; (void)K; (void)num_threads;
    return -1;
}

#endif
