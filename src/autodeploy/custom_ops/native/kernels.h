// The kernels one build of kernels.cpp provides. kernels.cpp is compiled once per CPU capability (the
// names torch uses: DEFAULT, AVX2, AVX512); each build exports its table under
// autodeploy_kernels_<CAPABILITY>(), and ops.cpp calls through the table chosen for this CPU.
#pragma once

#include <cstdint>

namespace autodeploy {

struct KernelTable {
  const char* capability;  // the build's CPU capability, e.g. "AVX2"
  int64_t floats_per_vector;  // float32 lanes of one vector register in this build
  // up to this many rows f32_gemm beats torch's fastest float32 GEMM in this build; more rows go to that GEMM
  int64_t f32_max_rows;
  // up to this many rows the other float32-arithmetic products (half_gemm, int8_gemm, int4_gemm) beat that GEMM
  // over float32 blocks of their 16-bit, int8 and 4-bit weights in this build; more rows go to those blocks
  int64_t gemm_max_rows;
  // whether this build's 4-bit products (decode rows, quad products of prompts) use AVX512-VNNI here (with_vnni)
  bool integer_vnni;

  // y[M, N] = x[M, K] . w[N, K]^T, float32; K a multiple of floats_per_vector.
  void (*f32_gemm)(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K);

  // The same product with 16-bit weights (bfloat16 when bf16, else float16), float32 arithmetic.
  // K a multiple of 2 * floats_per_vector. Returns 0, or -1 without scratch memory.
  int (*half_gemm)(const float* x, const uint16_t* w, bool bf16, float* y, int64_t M, int64_t N, int64_t K);

  // x . (w * scale[:, None])^T for int8 weights w [N, K] with bfloat16 per-row scales, float32 arithmetic over
  // the dequantized weights (prompts where int8 GEMMs have no fast path); K a multiple of floats_per_vector.
  // Returns 0, or -1 without scratch memory.
  int (*int8_gemm)(const float* x, const int8_t* w, const uint16_t* scale, float* y, int64_t M, int64_t N,
                   int64_t K);

  // int8 weights with bfloat16 per-row scales, the activations rounded to 16 bits per row and exact integer
  // dot products (int8_gemv_reference in quant_linear.py); K a multiple of 64. x86 builds compute more than 16
  // rows as pair products (the same sums; prompts without VNNI). Returns 0, or -1 without scratch memory.
  int (*int8_gemv)(const float* x, const int8_t* w, const uint16_t* scale, float* y, int64_t M, int64_t N,
                   int64_t K);

  // The two passes around the int8 GEMM of prompt products with VNNI (int8_split_mm, _split_activation_mm in
  // quant_linear.py; the GEMM between them is torch's int8 GEMM, or on AMX amx.h's, whose epilogue rescales as
  // split_rescale does): split_rows rounds each row of x [M, K] to 15-bit integers x15 = round(x / row_scale[m])
  // (half to even), row_scale = max(max|x|, FLT_MIN) / 16383, and writes them as two int8 halves, q[m, :] = hi
  // and q[M + m, :] = lo with x15 = 256 hi + lo, lo in [-128, 127]; split_rescale turns the int32 products of
  // such rows with int8 weights (per-row scales, widened to float32), hi's P_hi [rows, cols] and lo's P_lo (row
  // stride ld), into y[r * ldy + c] = (256 P_hi[r, c] + P_lo[r, c]) * (row_scale[r] * scale[c]), on one thread.
  // Any K, rows and cols; the plain-torch arithmetic bit for bit.
  void (*int8_split_rows)(const float* x, int64_t M, int64_t K, int8_t* q, float* row_scale);
  void (*int8_split_rescale)(const int32_t* hi, const int32_t* lo, int64_t ld, int64_t rows, int64_t cols,
                             const float* row_scale, const float* scale, float* y, int64_t ldy);

  // bfloat16 halves of x [count]: hi = bf16(x), lo = bf16(x - hi), each rounded to nearest even, so that hi + lo
  // is x to about 16 significant bits (the operands of the AMX products of bf16 weights, amx.h). Any count.
  void (*bf16_split)(const float* x, int64_t count, uint16_t* hi, uint16_t* lo);

  // dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: a transpose of 32-bit words (packing weight
  // blocks into the VNNI layout of the AMX products, amx.h).
  void (*transpose32)(const uint32_t* src, int64_t rows, int64_t cols, int64_t ld_src, uint32_t* dst, int64_t ld_dst);

  // 4-bit weights: qw [N, K/2] (element k in byte k/2, low nibble for even k, stored as q + 8), bfloat16
  // scales [N, K/group]: w[n, k] = scale[n, k/group] * (nibble - 8); float32 arithmetic, except decode rows
  // and, on x86 builds, more than 16 rows: activations rounded to 8 bits per block of 32, exact integer sums per
  // block (int4_decode_reference in int4_linear.py). K and group multiples of 2 * floats_per_vector, K a
  // multiple of group. amx: those blocks may run on AMX's int8 tiles (the AVX-512 build; ops.cpp passes whether
  // oneDNN runs AMX here), the same sums. Returns 0, or -1 without scratch memory.
  int (*int4_gemm)(const float* x, const uint8_t* qw, const uint16_t* scale, int64_t group, float* y, int64_t M,
                   int64_t N, int64_t K, bool amx);

  // rows [0, rows) of a 4-bit weight (qw [rows, K/2], scale [rows, K/group]) widened to float32 out [rows, K]
  // (the prompt path multiplies the widened block with torch's GEMM); the same layout conditions.
  void (*int4_widen)(const uint8_t* qw, const uint16_t* scale, int64_t group, int64_t K, int64_t rows, float* out);

  // One new token per sequence over its paged KV cache, float32 (ops.cpp documents the layout); head sizes
  // multiples of floats_per_vector. Returns 0, -1 for a position or page outside the table or cache, -2
  // without scratch memory.
  int (*decode_attention)(const float* q, const float* k_cache, const float* v_cache, const int64_t* input_pos,
                          const int64_t* page_table, float* out, int64_t num_seqs, int64_t n_heads, int64_t n_kv,
                          int64_t head_dim, int64_t v_dim, int64_t num_pages, int64_t page_size,
                          int64_t table_width, float scale, int64_t window);

  // The pointwise work of prompts between the products, float32 (custom_ops/pointwise.py has the plain-torch
  // forms); rows of the inputs ld_* floats apart, the outputs contiguous; any sizes.
  // y[r, :] = w * (x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps))), without the weight where w is null.
  void (*rms_norm)(const float* x, int64_t ld_x, const float* w, float eps, float* y, int64_t rows, int64_t dim);
  // sum[r, :] = a[r, :] + b[r, :] (a residual add), and y = rms_norm of sum as above
  void (*add_rms_norm)(const float* a, int64_t ld_a, const float* b, int64_t ld_b, const float* w, float eps,
                       float* sum, float* y, int64_t rows, int64_t dim);
  // y[r, :] = silu(gate[r, :]) * up[r, :]
  void (*silu_mul)(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, float* y, int64_t rows,
                   int64_t n);
  // Rotary embedding in rotate_half pairs (feature i with i + rot_dim / 2) of `tokens` tokens of `heads` heads of
  // head_dim features (a token's heads contiguous, tokens ld_x apart) by cos and sin [tokens, rot_dim] (rows ld_cs
  // apart) into y [tokens, heads, head_dim]; the features past rot_dim are copied. rot_dim even.
  void (*rope)(const float* x, int64_t ld_x, int64_t heads, int64_t head_dim, const float* cos, const float* sin,
               int64_t ld_cs, int64_t rot_dim, float* y, int64_t tokens);

  // Causal attention of a fresh sequence over its own keys: q [T, n_heads, head_dim], k [T, n_kv, head_dim], v [T,
  // n_kv, v_dim], out [T, n_heads, v_dim], all contiguous float32; position t attends to keys 0..t; n_heads a
  // multiple of n_kv, head sizes multiples of floats_per_vector. Returns 0, or -2 without scratch memory.
  int (*prefill_attention)(const float* q, const float* k, const float* v, float* out, int64_t T, int64_t n_heads,
                           int64_t n_kv, int64_t head_dim, int64_t v_dim, float scale);

  // float32 weights packed in panels of f32_pack_width rows (0: this build reads none, though f32_packed_gemm runs;
  // pack_f32_panels in linear.py): panels [ceil(N / 16)][K][16], weight k of the panel's rows side by side, rows
  // past N zero. y[M, N] = x[M, K] . w^T, each output summed over k in order (the same for any M); any K.
  // Returns 0, or -1 without scratch memory.
  int f32_pack_width;
  int (*f32_packed_gemm)(const float* x, const float* panels, float* y, int64_t M, int64_t N, int64_t K);
  // the same over bfloat16 (bf16) or float16 weights packed in the same panels (half_pack_width rows, 0: this
  // build reads none, though half_packed_gemm runs), widened to float32 exactly: float32 arithmetic, each output
  // summed over k in order
  int half_pack_width;
  int (*half_packed_gemm)(const float* x, const uint16_t* panels, bool bf16, float* y, int64_t M, int64_t N,
                          int64_t K);
  // 4-bit weights packed in tiles of int4_pack_rows rows (0: this build takes none; pack_int4_tiles in
  // int4_linear.py): words [tiles][K/8][int4_pack_rows] (word j of a row: its bytes 4j..4j+3, weights 8j..8j+7),
  // scale [tiles][K/group][int4_pack_rows] bfloat16, rows past N repeating the last. int4_gemm's integer products
  // (every row count) with one lane per weight row; group a multiple of 32. Returns 0, or -1 without scratch memory.
  int int4_pack_rows;
  int (*int4_packed_gemm)(const float* x, const int32_t* words, const uint16_t* scale, int64_t group, float* y,
                          int64_t M, int64_t N, int64_t K, bool amx);
};

}  // namespace autodeploy
