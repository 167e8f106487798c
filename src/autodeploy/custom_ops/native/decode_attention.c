/* Attention of one new token per sequence over its paged KV cache (decode), float32, for AVX-512 CPUs.
 *
 *   out[s, h, :] = sum_t softmax_t(scale * q[s, h, :] . k[s, t, hk, :]) * v[s, t, hk, :]
 *
 * over the positions t in [start, pos + 1) of sequence s (pos = input_pos[s]; start = pos + 1 - window
 * with a sliding window, else 0), where hk = h / groups is the kv head of query head h, and the key of
 * position t lives in page page_table[s, t / page_size], slot t % page_size of the cache
 * [num_pages, page_size, n_kv, head_dim].
 *
 * The graph form of this (gather the pages, two batched matmuls, a masked softmax) costs five kernel
 * calls and a copy of the used cache per layer, and attends over every slot of the page table; this reads
 * the cache where it lies, only up to each sequence's length. Work items are (sequence, kv head) pairs;
 * exp is Cephes' polynomial (relative error about 2e-7).
 *
 * Head sizes must be multiples of 16 (one 512-bit vector). Built by autodeploy/custom_ops/native; on a
 * CPU without AVX-512, decode_attention_supported() returns 0 and the callers keep the graph form.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>

int decode_attention_supported(void) { return 1; }

/* exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r), r = x - n ln 2 */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 tail_mask(int64_t remaining) {
    return remaining >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << remaining) - 1u);
}

/* row[0:len] = softmax(row[0:len]) */
static void softmax_in_place(float* row, int64_t len) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16)
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(len - t), row + t));
    const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 mask = tail_mask(len - t);
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + t), shift));
        _mm512_mask_storeu_ps(row + t, mask, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    const __m512 norm = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
    for (int64_t t = 0; t < len; t += 16) {
        const __mmask16 mask = tail_mask(len - t);
        _mm512_mask_storeu_ps(row + t, mask, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, row + t), norm));
    }
}

static inline const float* row_at(const float* cache, const int64_t* pages, int64_t t, int64_t page_size,
                                  int64_t slot_stride) {
    return cache + (pages[t / page_size] * page_size + t % page_size) * slot_stride;
}

/* One kv head of one sequence: its query heads qs [groups, head_dim] over positions [start, start + len)
 * into os [groups, v_dim]; k/v_cache point at this head's first row. Inlined with constant head sizes
 * (below), so the loops over a head unroll and the value accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_kv_head(
    const float* qs, const float* k_cache, const float* v_cache, const int64_t* pages, float* os, float* scores,
    int64_t start, int64_t len, int64_t groups, int64_t n_kv, int64_t page_size, float scale,
    const int64_t head_dim, const int64_t v_dim) {
    for (int64_t t = 0; t < len; ++t) {
        const float* key = row_at(k_cache, pages, start + t, page_size, n_kv * head_dim);
        for (int64_t g = 0; g < groups; ++g) {
            const float* qg = qs + g * head_dim;
            __m512 dot = _mm512_mul_ps(_mm512_loadu_ps(qg), _mm512_loadu_ps(key));
            for (int64_t d = 16; d < head_dim; d += 16)
                dot = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(key + d), dot);
            scores[g * len + t] = _mm512_reduce_add_ps(dot) * scale;
        }
    }
    for (int64_t g = 0; g < groups; ++g) softmax_in_place(scores + g * len, len);
    for (int64_t g = 0; g < groups; ++g) {
        const float* weights = scores + g * len;
        __m512 acc[v_dim / 16];
        for (int64_t c = 0; c < v_dim / 16; ++c) acc[c] = _mm512_setzero_ps();
        for (int64_t t = 0; t < len; ++t) {
            const float* value = row_at(v_cache, pages, start + t, page_size, n_kv * v_dim);
            const __m512 w = _mm512_set1_ps(weights[t]);
            for (int64_t c = 0; c < v_dim / 16; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(value + 16 * c), acc[c]);
        }
        for (int64_t c = 0; c < v_dim / 16; ++c) _mm512_storeu_ps(os + g * v_dim + 16 * c, acc[c]);
    }
}

/* Returns 0 on success, -1 when a page index is outside the cache or a position outside the page table,
 * -2 when scratch memory is unavailable, -3 for head sizes that are not multiples of 16. */
int decode_attention_f32(const float* q, const float* k_cache, const float* v_cache, const int64_t* input_pos,
                         const int64_t* page_table, float* out, int64_t num_seqs, int64_t n_heads, int64_t n_kv,
                         int64_t head_dim, int64_t v_dim, int64_t num_pages, int64_t page_size,
                         int64_t table_width, float scale, int64_t window, int num_threads) {
    if (head_dim % 16 || v_dim % 16) return -3;
    const int64_t groups = n_heads / n_kv;
    /* the page table is checked up front: the kernel reads the cache at the pages it names */
    for (int64_t s = 0; s < num_seqs; ++s) {
        const int64_t pos = input_pos[s];
        if (pos < 0 || pos / page_size >= table_width) return -1;
        for (int64_t p = 0; p <= pos / page_size; ++p) {
            const int64_t page = page_table[s * table_width + p];
            if (page < 0 || page >= num_pages) return -1;
        }
    }
    int status = 0;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_seqs * n_kv > 1)
    for (int64_t item = 0; item < num_seqs * n_kv; ++item) {
        const int64_t s = item / n_kv, hk = item % n_kv;
        const int64_t pos = input_pos[s];
        const int64_t start = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
        const int64_t len = pos + 1 - start;
        float* scores = malloc(sizeof(float) * (size_t)(groups * len));
        if (scores == NULL) {
            #pragma omp atomic write
            status = -2;
            continue;
        }
        const float* qs = q + (s * n_heads + hk * groups) * head_dim;
        const float* keys = k_cache + hk * head_dim;
        const float* values = v_cache + hk * v_dim;
        const int64_t* pages = page_table + s * table_width;
        float* os = out + (s * n_heads + hk * groups) * v_dim;
        /* the common head sizes get loops of constant length */
        if (head_dim == 64 && v_dim == 64)
            attend_kv_head(qs, keys, values, pages, os, scores, start, len, groups, n_kv, page_size, scale, 64, 64);
        else if (head_dim == 128 && v_dim == 128)
            attend_kv_head(qs, keys, values, pages, os, scores, start, len, groups, n_kv, page_size, scale, 128, 128);
        else
            attend_kv_head(qs, keys, values, pages, os, scores, start, len, groups, n_kv, page_size, scale, head_dim,
                           v_dim);
        free(scores);
    }
    return status;
}

#else

int decode_attention_supported(void) { return 0; }

int decode_attention_f32(const float* q, const float* k_cache, const float* v_cache, const int64_t* input_pos,
                         const int64_t* page_table, float* out, int64_t num_seqs, int64_t n_heads, int64_t n_kv,
                         int64_t head_dim, int64_t v_dim, int64_t num_pages, int64_t page_size,
                         int64_t table_width, float scale, int64_t window, int num_threads) {
    return -4;
}

#endif
