// The native kernels as the CPU implementations of auto_deploy ops whose schemas, plain-torch implementations
// and fake implementations are defined in Python (custom_ops/linear.py, half_linear.py, int4_linear.py,
// quant_linear.py, cached_attention.py, pointwise.py):
//   auto_deploy::f32_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor
//   auto_deploy::f32_packed_linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None) -> Tensor
//   auto_deploy::half_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor
//   auto_deploy::half_packed_linear(Tensor x, Tensor panels, int out_features, Tensor? bias=None) -> Tensor
//   auto_deploy::int4_linear(Tensor x, Tensor qweight, Tensor scale, int group_size, Tensor? bias=None) -> Tensor
//   auto_deploy::int4_packed_linear(Tensor x, Tensor words, Tensor scale, int group_size, int out_features,
//                                   Tensor? bias=None) -> Tensor
//   auto_deploy::int8_gemv(Tensor x, Tensor weight, Tensor scale) -> Tensor
//   auto_deploy::int8_mm(Tensor x, Tensor weight, Tensor scale) -> Tensor
//   auto_deploy::int8_split_mm(Tensor x, Tensor weight, Tensor scale) -> Tensor
//   auto_deploy::materialize(Tensor x) -> Tensor
//   auto_deploy::prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor
//   auto_deploy::rms_norm(Tensor x, Tensor? weight, float eps) -> Tensor
//   auto_deploy::add_rms_norm(Tensor x, Tensor residual, Tensor? weight, float eps) -> (Tensor, Tensor)
//   auto_deploy::silu_mul(Tensor gate, Tensor up) -> Tensor
//   auto_deploy::rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)
//   auto_deploy::decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos,
//                                 Tensor page_table, float scale, int sliding_window) -> Tensor
//   auto_deploy::decode_attention_rope(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache,
//                                      Tensor(b!) v_cache, Tensor input_pos, Tensor page_table, float scale,
//                                      int sliding_window) -> Tensor
//   auto_deploy::write_kv_cache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor seq_lens,
//                               Tensor input_pos, Tensor page_table) -> ()
// The kernels themselves live in one of the per-capability builds of kernels.cpp; Python loads the build for
// this CPU and hands its table to autodeploy_use_kernels(), then calls autodeploy_register_cpu_kernels().
// The product operators take any input their plain-torch implementations take: the kernel for decode-sized
// inputs it takes, the same product in ATen otherwise (for prompts, 16-bit and 4-bit weights are widened a
// block of rows at a time, never as a whole; on AMX, bf16 and int8 weights are packed a block at a time, amx.h); decode_attention takes what its callers check with
// native.decode_attention_takes. Registered from C++ rather than wrapped in Python because compiled decode
// graphs call them many times per step, and a C++ registration keeps the per-call dispatch cost low; an
// AOTInductor decode package calls them through the C shims at the end of this file, without the dispatcher.
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/TensorOperators.h>
#include <ATen/TensorUtils.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/stack.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "amx.h"
#include "decode_loop.h"
#include "kernels.h"

// The library is built with hidden visibility and loaded globally (for the C shims, below): only the functions
// Python calls and the shims are exported, so none of the torch code compiled into it stands in for a later
// library's own.
#define AUTODEPLOY_API extern "C" __attribute__((visibility("default")))

namespace {

// the kernels of the build chosen for this CPU (autodeploy_use_kernels); the ops are registered only after it
const autodeploy::KernelTable* g_kernels = nullptr;

int64_t rows_of(const at::Tensor& x) { return x.numel() / x.size(-1); }

at::Tensor output_like(const at::Tensor& x, int64_t n, at::ScalarType dtype) {
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = n;
  return at::empty(sizes, x.options().dtype(dtype));
}

bool has(const std::optional<at::Tensor>& bias) { return bias.has_value() && bias->defined(); }

// whether every tensor is a float32 CPU tensor
bool all_float(std::initializer_list<at::Tensor> tensors) {
  for (const at::Tensor& t : tensors)
    if (t.scalar_type() != at::kFloat || t.device().type() != c10::DeviceType::CPU) return false;
  return true;
}

// linear(x [..., K], weight [N, K], bias [N]) in float32 by torch's fastest GEMM for many rows: on x86, oneDNN's
// linear over the plain weight (mkldnn::_linear_pointwise, the op Inductor's CPU backend calls), which ran 1.1-1.6x
// the native kernel and 1.2-2.5x ATen's linear (MKL) at 128-2048 rows of the 125M Llama's products on the AMD EPYC
// of docs/performance.md (AVX-512 and AVX2); at::linear elsewhere, or where torch was built without oneDNN.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
#if defined(__x86_64__)
  static const std::optional<c10::OperatorHandle> onednn_linear =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  if (onednn_linear && x.dim() >= 2 && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
      (!has(bias) || bias->scalar_type() == at::kFloat)) {
    torch::jit::Stack stack{x.contiguous(), weight.contiguous(), bias, std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::optional<std::string>()};
    onednn_linear->callBoxed(stack);
    return stack.back().toTensor();
  }
#endif
  return at::linear(x, weight, bias);
}

// x [..., K] times a weight [N, K] given a block of rows at a time as float32 (widen(n0, n1) -> [n1 - n0, K]),
// so a 16-bit or 4-bit weight is never widened as a whole
template <typename Widen>
at::Tensor blockwise_linear(const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias, Widen widen) {
  constexpr int64_t kBlockRows = 1024;
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).to(at::kFloat);
  at::Tensor out = at::empty({rows.size(0), N}, rows.options());
  for (int64_t n0 = 0; n0 < N; n0 += kBlockRows) {
    const int64_t n1 = std::min(N, n0 + kBlockRows);
    out.narrow(1, n0, n1 - n0).copy_(dense_linear(rows, widen(n0, n1), std::nullopt));
  }
  if (has(bias)) out.add_(bias->to(at::kFloat));
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  return out.reshape(sizes).to(x.scalar_type());
}

// The kernel's arithmetic in ATen (int8_gemv_reference in quant_linear.py), for inputs the kernel does not
// take: 16-bit activations per row, exact integer dot products (float64 holds them), float32 rescaling.
at::Tensor int8_gemv_aten(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  const at::Tensor rows = x.reshape({-1, x.size(-1)}).to(at::kFloat);
  const at::Tensor amax = rows.abs().amax({-1}, /*keepdim=*/true);
  const at::Tensor sx = amax.div(32767).where(amax.gt(0), 1.0);  // an all-zero row keeps scale 1
  const at::Tensor q = rows.mul(sx.reciprocal()).round().clamp_(-32767, 32767);
  const at::Tensor dot = q.to(at::kDouble).matmul(weight.to(at::kDouble).t()).to(at::kFloat);
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  return dot.mul(sx).mul(scale.to(at::kFloat)).reshape(sizes);
}

at::Tensor int8_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1) && scale.numel() == weight.size(0),
              "auto_deploy::int8_gemv: needs x [..., K], weight [N, K] and scale [N]");
  const int64_t K = weight.size(1), N = weight.size(0);
  const bool takes = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar &&
                     scale.scalar_type() == at::kBFloat16 && weight.is_contiguous() && scale.is_contiguous() &&
                     K % 64 == 0;
  if (!takes) return int8_gemv_aten(x, weight, scale);  // the op runs everywhere; the kernel where it can
  const at::Tensor rows = x.contiguous();
  at::Tensor out = output_like(x, N, at::kFloat);
  const int status = g_kernels->int8_gemv(rows.data_ptr<float>(), weight.data_ptr<int8_t>(),
                                          reinterpret_cast<const uint16_t*>(scale.data_ptr()), out.data_ptr<float>(),
                                          rows.numel() / K, N, K);
  TORCH_CHECK(status == 0, "auto_deploy::int8_gemv: out of memory for the activation scratch");
  return out;
}

// x [..., K] @ (weight [N, K] int8 * scale [N] bfloat16).T in float32 over the dequantized weights: the kernel
// up to gemm_max_rows rows, dense_linear over blocks of dequantized rows for more (or inputs it does not take)
at::Tensor int8_mm_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && x.dim() >= 1 && x.size(-1) == weight.size(1) &&
                  scale.numel() == weight.size(0),
              "auto_deploy::int8_mm: needs x [..., K], an int8 weight [N, K] and scale [N]");
  const int64_t K = weight.size(1), N = weight.size(0);
  const bool takes = x.scalar_type() == at::kFloat && scale.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
                     scale.is_contiguous() && K % g_kernels->floats_per_vector == 0;
  if (!takes || rows_of(x) > g_kernels->gemm_max_rows)
    return blockwise_linear(x, N, std::nullopt, [&](int64_t n0, int64_t n1) {
      return weight.slice(0, n0, n1).to(at::kFloat).mul_(scale.slice(0, n0, n1).to(at::kFloat).unsqueeze(-1));
    });
  const at::Tensor input = x.contiguous();
  at::Tensor out = output_like(x, N, at::kFloat);
  const int status = g_kernels->int8_gemm(input.data_ptr<float>(), weight.data_ptr<int8_t>(),
                                          reinterpret_cast<const uint16_t*>(scale.data_ptr()), out.data_ptr<float>(),
                                          rows_of(x), N, K);
  TORCH_CHECK(status == 0, "auto_deploy::int8_mm: out of memory for the widened-tile scratch");
  return out;
}

// amx::split_products' pack for the weight w [N, K]: rows [n0, n0 + rows) in the VNNI layout, their 32-bit groups
// of consecutive k transposed
template <typename T>
auto vnni_packer(const T* w, int64_t K) {
  return [w, K](int64_t n0, int64_t rows, T* out) {
    const int64_t groups = K * static_cast<int64_t>(sizeof(T)) / 4;
    g_kernels->transpose32(reinterpret_cast<const uint32_t*>(w + n0 * K), rows, groups, groups,
                           reinterpret_cast<uint32_t*>(out), rows);
  };
}

// int8_split_mm's products on AMX (amx.h): all rows split at once, the int32 products of each block of weight rows
// rescaled by int8_split_rescale while in cache (bit for bit: the same exact integers, the same float32 steps)
at::Tensor int8_split_mm_amx(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& scale, at::Tensor& out) {
  const int64_t M = rows.size(0), K = rows.size(1), N = weight.size(0);
  at::Tensor halves = at::empty({2 * M, K}, rows.options().dtype(at::kChar));
  at::Tensor row_scale = at::empty({M}, rows.options());
  const at::Tensor widened = scale.reshape({N}).to(at::kFloat).contiguous();
  int8_t* q = halves.data_ptr<int8_t>();
  g_kernels->int8_split_rows(rows.data_ptr<float>(), M, K, q, row_scale.data_ptr<float>());
  const float* rs = row_scale.data_ptr<float>();
  const float* s = widened.data_ptr<float>();
  float* y = out.data_ptr<float>();
  autodeploy::amx::split_products<int8_t, int32_t>(
      q, q + M * K, M, N, K, vnni_packer(weight.data_ptr<int8_t>(), K),
      [&](int64_t m0, int64_t count, int64_t n0, int64_t cols, const int32_t* hi, const int32_t* lo) {
        g_kernels->int8_split_rescale(hi, lo, cols, count, cols, rs + m0, s + n0, y + m0 * N + n0, N);
      });
  return out;
}

// x [..., K] @ (weight [N, K] int8 * scale [N]).T in float32 through int8 GEMMs (torch's: oneDNN's VNNI kernel where
// the CPU has it) over the activations rounded to 15 bits per row and split into two int8 halves: the plain-torch
// _split_activation_mm of quant_linear.py bit for bit, its passes before and after the GEMM two of the kernels'
// (the plain-torch version takes a dozen ATen passes over the rows and products). The rows go in slabs through
// one products buffer, rescaled while it is in cache: for 2048 rows of the 125M Llama's MLP product, the whole
// [4096, 4096] int32 product took 35.5 ms where slabs of 128 rows took 16.1 (docs/performance.md). On CPUs with AMX
// the int8 products run there instead (int8_split_mm_amx), with the same floats out.
at::Tensor int8_split_mm_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && x.dim() >= 1 && x.size(-1) == weight.size(1) &&
                  scale.numel() == weight.size(0),
              "auto_deploy::int8_split_mm: needs x [..., K], an int8 weight [N, K] and scale [N]");
  constexpr int64_t kSlabRows = 128;
  const int64_t K = weight.size(1), N = weight.size(0), M = rows_of(x);
  at::Tensor out = output_like(x, N, at::kFloat);
  if (M == 0) return out;
  const at::Tensor rows = x.reshape({M, K}).to(at::kFloat).contiguous();
  if (weight.is_contiguous() && autodeploy::amx::takes_depth<int8_t>(K) && autodeploy::amx::available(at::kChar))
    return int8_split_mm_amx(rows, weight, scale, out);
  const int64_t slab = std::min(M, kSlabRows);
  at::Tensor halves = at::empty({2 * slab, K}, x.options().dtype(at::kChar));
  at::Tensor products = at::empty({2 * slab, N}, x.options().dtype(at::kInt));
  at::Tensor row_scale = at::empty({M}, x.options().dtype(at::kFloat));
  const at::Tensor widened = scale.reshape({N}).to(at::kFloat).contiguous();
  const at::Tensor weight_t = weight.t();  // [K, N]: the weight read as it is stored
  for (int64_t m0 = 0; m0 < M; m0 += slab) {
    const int64_t m = std::min(slab, M - m0);
    at::Tensor q = halves.narrow(0, 0, 2 * m), p = products.narrow(0, 0, 2 * m);
    g_kernels->int8_split_rows(rows.data_ptr<float>() + m0 * K, m, K, q.data_ptr<int8_t>(),
                               row_scale.data_ptr<float>() + m0);
    at::_int_mm_out(p, q, weight_t);
    const int32_t* products = p.data_ptr<int32_t>();
    const float* rs = row_scale.data_ptr<float>() + m0;
    float* y = out.data_ptr<float>() + m0 * N;
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      g_kernels->int8_split_rescale(products + begin * N, products + (m + begin) * N, N, end - begin, N, rs + begin,
                                    widened.data_ptr<float>(), y + begin * N, N);
    });
  }
  return out;
}

// The decode_attention kernel over q rows [num_seqs, n_heads, head_dim] (contiguous) into out; on an index the
// kernel refuses, names the first offending sequence (the kernel checks the table before reading)
void attend_cached(const char* op, const float* q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                   const int64_t* pos, const int64_t* table, int64_t width, float* out, int64_t num_seqs,
                   int64_t n_heads, double scale, int64_t sliding_window) {
  const int64_t num_pages = k_cache.size(0), page_size = k_cache.size(1);
  const int status = g_kernels->decode_attention(
      q, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), pos, table, out, num_seqs, n_heads, k_cache.size(2),
      k_cache.size(3), v_cache.size(3), num_pages, page_size, width, static_cast<float>(scale), sliding_window);
  if (status == -1) {
    for (int64_t s = 0; s < num_seqs; ++s) {
      TORCH_CHECK(pos[s] >= 0 && pos[s] / page_size < width, "auto_deploy::", op, ": sequence ", s,
                  " is at position ", pos[s], ", past the page table (", width, " pages of ", page_size, ")");
      for (int64_t p = 0; p <= pos[s] / page_size; ++p)
        TORCH_CHECK(table[s * width + p] >= 0 && table[s * width + p] < num_pages, "auto_deploy::", op,
                    ": sequence ", s, " names page ", table[s * width + p], " at column ", p,
                    ", a page index outside the cache (", num_pages, " pages)");
    }
  }
  TORCH_CHECK(status == 0, "auto_deploy::", op, ": out of memory for the scores scratch");
}

// q [num_seqs, n_heads, head_dim] (or [..., n_heads, head_dim] with the leading dims one token per
// sequence), caches [num_pages, page_size, n_kv, head_dim], input_pos [num_seqs], page_table
// [num_seqs, width]: the conventions of auto_deploy::torch_cached_attention for a decode-only batch,
// after the new tokens' k/v were written to the caches.
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& input_pos, const at::Tensor& page_table, double scale,
                                int64_t sliding_window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "auto_deploy::decode_attention: needs float32 q and caches");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(2),
              "auto_deploy::decode_attention: caches must be contiguous [num_pages, page_size, n_kv, head_dim]");
  const int64_t n_kv = k_cache.size(2), head_dim = k_cache.size(3), v_dim = v_cache.size(3);
  TORCH_CHECK(head_dim % g_kernels->floats_per_vector == 0 && v_dim % g_kernels->floats_per_vector == 0,
              "auto_deploy::decode_attention: head sizes must be multiples of ", g_kernels->floats_per_vector);
  TORCH_CHECK(q.dim() >= 2 && q.size(-1) == head_dim && q.size(-2) % n_kv == 0,
              "auto_deploy::decode_attention: q must be [..., n_heads, head_dim] with n_heads a multiple of the "
              "caches' kv heads");
  const int64_t n_heads = q.size(-2), num_seqs = q.numel() / (n_heads * head_dim);
  TORCH_CHECK(input_pos.dim() == 1 && input_pos.size(0) == num_seqs && page_table.dim() == 2 &&
                  page_table.size(0) == num_seqs,
              "auto_deploy::decode_attention: input_pos [num_seqs] and page_table [num_seqs, width] must match q's "
              "one token per sequence");
  const at::Tensor rows = q.contiguous();
  const at::Tensor positions = input_pos.to(at::kLong).contiguous();
  const at::Tensor pages = page_table.to(at::kLong).contiguous();
  std::vector<int64_t> sizes = q.sizes().vec();
  sizes.back() = v_dim;
  at::Tensor out = at::empty(sizes, q.options());
  attend_cached("decode_attention", rows.data_ptr<float>(), k_cache, v_cache, positions.data_ptr<int64_t>(),
                pages.data_ptr<int64_t>(), pages.size(1), out.data_ptr<float>(), num_seqs, n_heads, scale,
                sliding_window);
  return out;
}

// q [T, n_heads, d], k / v [T, n_kv, d]: the causal attention of a fresh sequence (cached_attention.py's
// prefill_attention_reference), for inputs native.prefill_attention_takes accepts
at::Tensor prefill_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(all_float({q, k, v}) && q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.size(0) == k.size(0) &&
                  k.size(0) == v.size(0) && k.size(1) == v.size(1) && q.size(1) % k.size(1) == 0 &&
                  q.size(2) == k.size(2) && q.size(2) % g_kernels->floats_per_vector == 0 &&
                  v.size(2) % g_kernels->floats_per_vector == 0,
              "auto_deploy::prefill_attention: needs float32 q [T, n_heads, d] and k, v [T, n_kv, d] with n_heads a "
              "multiple of n_kv and head sizes multiples of ", g_kernels->floats_per_vector);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor out = at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  const int status = g_kernels->prefill_attention(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(),
                                                  out.data_ptr<float>(), q.size(0), q.size(1), k.size(1), q.size(2),
                                                  v.size(2), static_cast<float>(scale));
  TORCH_CHECK(status == 0, "auto_deploy::prefill_attention: out of memory for the scores scratch");
  return out;
}

// k / v [T, n_kv, d], the new tokens of the sequences one after another, into their slots of the paged caches
// [pages, page_size, n_kv, d] (cached_attention.py's write_kv_cache_reference): token t of sequence s sits at
// position input_pos[s] + t, in page page_table[s, position / page_size], slot position % page_size. One call for
// what takes a dozen torch ops (the slots, then index_copy_) in each prompt's attention
void write_kv_cache_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& seq_lens, const at::Tensor& input_pos, const at::Tensor& page_table) {
  TORCH_CHECK(all_float({k, v, k_cache, v_cache}) && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 &&
                  v_cache.dim() == 4 && k.size(0) == v.size(0) && k_cache.size(0) == v_cache.size(0) &&
                  k_cache.size(1) == v_cache.size(1) && k.sizes().slice(1) == k_cache.sizes().slice(2) &&
                  v.sizes().slice(1) == v_cache.sizes().slice(2) && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && seq_lens.dim() == 1 && input_pos.sizes() == seq_lens.sizes() &&
                  page_table.dim() == 2 && page_table.size(0) == seq_lens.size(0),
              "auto_deploy::write_kv_cache: needs float32 k, v [T, n_kv, d], contiguous float32 caches [pages, "
              "page_size, n_kv, d] and seq_lens, input_pos [S], page_table [S, width]");
  // a token's heads side by side, tokens at any stride (k and v are columns of a fused q/k/v product): no copy
  const auto token_rows = [](const at::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  const at::Tensor kc = token_rows(k), vc = token_rows(v);
  // as decode_attention_cpu reads its indices
  const at::Tensor lens = seq_lens.to(at::kLong).contiguous(), starts = input_pos.to(at::kLong).contiguous();
  const at::Tensor table = page_table.to(at::kLong).contiguous();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t* pos0 = starts.data_ptr<int64_t>();
  const int64_t* rows = table.data_ptr<int64_t>();
  const int64_t num_seqs = lens.size(0), pages = k_cache.size(0), page_size = k_cache.size(1), width = table.size(1);
  const int64_t k_row = k.size(1) * k.size(2), v_row = v.size(1) * v.size(2);
  const int64_t total = std::accumulate(len, len + num_seqs, int64_t{0});
  TORCH_CHECK(total == k.size(0), "auto_deploy::write_kv_cache: seq_lens sum to ", total, " tokens, k holds ",
              k.size(0));
  const float* k_in = kc.data_ptr<float>();
  const float* v_in = vc.data_ptr<float>();
  float* k_out = k_cache.data_ptr<float>();
  float* v_out = v_cache.data_ptr<float>();
  int64_t token = 0;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t t = 0; t < len[s]; ++t, ++token) {
      const int64_t position = pos0[s] + t, column = position / page_size;
      TORCH_CHECK(position >= 0 && column < width, "auto_deploy::write_kv_cache: sequence ", s, " position ",
                  position, " outside its page table of ", width, " pages");
      const int64_t page = rows[s * width + column];
      TORCH_CHECK(page >= 0 && page < pages, "auto_deploy::write_kv_cache: page ", page, " outside the cache's ",
                  pages);
      const int64_t slot = page * page_size + position % page_size;
      std::memcpy(k_out + slot * k_row, k_in + token * kc.stride(0), k_row * sizeof(float));
      std::memcpy(v_out + slot * v_row, v_in + token * vc.stride(0), v_row * sizeof(float));
    }
}

// linear(x [..., K], weight [N, K], bias [N]) in float32: the kernel up to the build's f32_max_rows rows,
// dense_linear for more; torch's linear for inputs the kernel does not take.
at::Tensor f32_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const bool takes = x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                     weight.is_contiguous() && x.dim() >= 1 && x.size(-1) == weight.size(1) &&
                     weight.size(1) % g_kernels->floats_per_vector == 0 &&
                     (!has(bias) || bias->scalar_type() == at::kFloat);
  if (!takes) return at::linear(x, weight, bias);
  if (rows_of(x) > g_kernels->f32_max_rows) return dense_linear(x, weight, bias);
  const int64_t K = weight.size(1), N = weight.size(0);
  const at::Tensor input = x.contiguous();
  at::Tensor out = output_like(x, N, at::kFloat);
  g_kernels->f32_gemm(input.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows_of(x), N, K);
  if (has(bias)) out.add_(*bias);
  return out;
}

// weight rows per panel of f32_packed_linear's layout (PANEL_ROWS in linear.py, kPanel in kernels.cpp)
constexpr int64_t kPanelRows = 16;

// The check of a packed op's x [..., K] and panels [P, K, kPanelRows] holding out_features rows (check_panels in
// linear.py), naming the op
void check_panels(const char* op, const at::Tensor& x, const at::Tensor& panels, int64_t out_features) {
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanelRows && x.dim() >= 1 && x.size(-1) == panels.size(1) &&
                  out_features > (panels.size(0) - 1) * kPanelRows && out_features <= panels.size(0) * kPanelRows,
              "auto_deploy::", op, ": needs x [..., K] and panels [P, K, 16] for out_features in ((P - 1) * 16, P * 16]");
}

// The weight of panels [P, K, kPanelRows] by rows, [P * kPanelRows, K] (a copy; rows past out_features are zero)
at::Tensor unpack_panels(const at::Tensor& panels) {
  return panels.transpose(1, 2).reshape({panels.size(0) * kPanelRows, panels.size(1)});
}

// linear over a float32 weight packed in panels (panels [P, K, kPanelRows], pack_f32_panels in linear.py) for every
// row count: the build's f32_packed_gemm (unpacking the weight for oneDNN's GEMM at 512-2048 rows measured no
// faster: the copy costs what the GEMM gains); torch's linear over the weight unpacked to rows (a copy) for inputs
// it does not take
at::Tensor f32_packed_linear_cpu(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                                 const std::optional<at::Tensor>& bias) {
  check_panels("f32_packed_linear", x, panels, out_features);
  const int64_t K = x.size(-1), N = out_features;
  const bool takes = x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                     (!has(bias) || bias->scalar_type() == at::kFloat);
  if (!takes) return at::linear(x, unpack_panels(panels).slice(0, 0, N), bias);
  const at::Tensor input = x.contiguous();
  at::Tensor out = output_like(x, N, at::kFloat);
  const int status = g_kernels->f32_packed_gemm(input.data_ptr<float>(), panels.data_ptr<float>(),
                                                out.data_ptr<float>(), rows_of(x), N, K);
  TORCH_CHECK(status == 0, "auto_deploy::f32_packed_linear: out of memory for the activations' scratch");
  if (has(bias)) out.add_(*bias);
  return out;
}

// More rows than this take the AMX products of bf16 weights where the CPU has AMX (half_linear_amx); fewer take
// the native kernel, whose sums do not depend on the rows beside a row (as f32_max_rows keeps them for float32)
constexpr int64_t kAmxMinRows = 64;

// Prompts of bf16 weights on AMX (amx.h): each float32 row split into bfloat16 halves (hi + lo is the activation to
// about 16 significant bits, an error of at most 2^-17 of it, against bf16 weights' 2^-9), both multiplied with
// the weight into float32 on AMX and added: float32 accuracy at the speed of 16-bit products.
at::Tensor half_linear_amx(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const int64_t K = weight.size(1), N = weight.size(0), M = rows_of(x);
  const at::Tensor input = x.contiguous();
  at::Tensor halves = at::empty({2, M, K}, x.options().dtype(at::kBFloat16));
  auto* hi = reinterpret_cast<uint16_t*>(halves.data_ptr());
  g_kernels->bf16_split(input.data_ptr<float>(), M * K, hi, hi + M * K);
  at::Tensor out = output_like(x, N, at::kFloat);
  float* y = out.data_ptr<float>();
  const auto* rows = reinterpret_cast<const c10::BFloat16*>(hi);
  autodeploy::amx::split_products<c10::BFloat16, float>(
      rows, rows + M * K, M, N, K, vnni_packer(reinterpret_cast<const c10::BFloat16*>(weight.data_ptr()), K),
      [&](int64_t m0, int64_t count, int64_t n0, int64_t cols, const float* high, const float* low) {
        for (int64_t r = 0; r < count; ++r)
          for (int64_t c = 0; c < cols; ++c) y[(m0 + r) * N + n0 + c] = high[r * cols + c] + low[r * cols + c];
      });
  if (has(bias)) out.add_(bias->to(at::kFloat));
  return out;
}

// linear with a bfloat16 or float16 weight [N, K], in float32, returned in x's dtype
at::Tensor half_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1) &&
                  (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kHalf),
              "auto_deploy::half_linear: needs x [..., K] and a bfloat16 or float16 weight [N, K]");
  const int64_t K = weight.size(1), N = weight.size(0);
  if (x.scalar_type() == at::kFloat && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() &&
      rows_of(x) > kAmxMinRows && autodeploy::amx::takes_depth<c10::BFloat16>(K) &&
      autodeploy::amx::available(at::kBFloat16))
    return half_linear_amx(x, weight, bias);
  const bool takes = x.scalar_type() == at::kFloat && weight.is_contiguous() && K % g_kernels->floats_per_vector == 0;
  if (!takes || rows_of(x) > g_kernels->gemm_max_rows)
    return blockwise_linear(x, N, bias, [&](int64_t n0, int64_t n1) { return weight.slice(0, n0, n1).to(at::kFloat); });
  const at::Tensor input = x.contiguous();
  at::Tensor out = output_like(x, N, at::kFloat);
  const auto* bits = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  const int status = g_kernels->half_gemm(input.data_ptr<float>(), bits, weight.scalar_type() == at::kBFloat16,
                                          out.data_ptr<float>(), rows_of(x), N, K);
  TORCH_CHECK(status == 0, "auto_deploy::half_linear: out of memory for the widened-tile scratch");
  if (has(bias)) out.add_(bias->to(at::kFloat));
  return out;
}

// linear over a bfloat16 or float16 weight packed in panels (panels [P, K, kPanelRows], pack_f32_panels in
// linear.py keeps the dtype) for every row count, in float32, returned in x's dtype: the build's half_packed_gemm;
// for inputs it does not take, half_linear's plain-torch product over the unpacked weight, a block of rows at a time
at::Tensor half_packed_linear_cpu(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                                  const std::optional<at::Tensor>& bias) {
  check_panels("half_packed_linear", x, panels, out_features);
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 || panels.scalar_type() == at::kHalf,
              "auto_deploy::half_packed_linear: needs x [..., K] and bfloat16 or float16 panels [P, K, 16]");
  const int64_t K = x.size(-1), N = out_features;
  if (x.scalar_type() != at::kFloat || !panels.is_contiguous()) {
    const at::Tensor rows = unpack_panels(panels);
    return blockwise_linear(x, N, bias, [&](int64_t n0, int64_t n1) { return rows.slice(0, n0, n1).to(at::kFloat); });
  }
  const at::Tensor input = x.contiguous();
  at::Tensor out = output_like(x, N, at::kFloat);
  const int status = g_kernels->half_packed_gemm(input.data_ptr<float>(),
                                                 reinterpret_cast<const uint16_t*>(panels.data_ptr()),
                                                 panels.scalar_type() == at::kBFloat16, out.data_ptr<float>(),
                                                 rows_of(x), N, K);
  TORCH_CHECK(status == 0,
              "auto_deploy::half_packed_linear: out of memory for its scratch (the activations, the widened panels)");
  if (has(bias)) out.add_(bias->to(at::kFloat));
  return out;
}

// rows [n0, n1) of a 4-bit weight as float32: w[n, k] = scale[n, k / group] * (nibble - 8)
at::Tensor int4_widen(const at::Tensor& qweight, const at::Tensor& scale, int64_t group, int64_t n0, int64_t n1) {
  const at::Tensor bytes = qweight.slice(0, n0, n1).to(at::kInt);
  const at::Tensor q = at::stack({bytes.bitwise_and(15), bytes.bitwise_right_shift(4)}, -1).reshape({n1 - n0, -1});
  const at::Tensor s = scale.slice(0, n0, n1).to(at::kFloat).unsqueeze(-1);
  return q.sub(8).to(at::kFloat).view({n1 - n0, -1, group}).mul(s).view({n1 - n0, -1});
}

// out [..., N] = product(rows, out, M, amx) over x's rows in slabs, plus the bias: the 4-bit kernels reorder their
// activation rows into a scratch of rows x K values, so a long prompt goes in slabs of rows and the scratch stays a
// few MB (each slab reads the 4-bit weights again, a small cost next to the arithmetic of this many rows). amx: the
// prompts' blocks on AMX's int8 tiles.
template <typename Product>
at::Tensor int4_in_slabs(const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& bias, const char* op,
                         const Product& product) {
  constexpr int64_t kSlabRows = 512;
  const at::Tensor input = x.contiguous();
  at::Tensor out = output_like(x, N, at::kFloat);
  const int64_t M = rows_of(x), K = x.size(-1);
  const bool amx = autodeploy::amx::available(at::kChar);
  for (int64_t m0 = 0; m0 < M; m0 += kSlabRows) {
    const int status = product(input.data_ptr<float>() + m0 * K, out.data_ptr<float>() + m0 * N,
                               std::min(kSlabRows, M - m0), amx);
    TORCH_CHECK(status == 0, "auto_deploy::", op, ": out of memory for the kernel's scratch");
  }
  if (has(bias)) out.add_(bias->to(at::kFloat));
  return out;
}

// linear with a 4-bit group-quantized weight (qweight [N, K/2] uint8, scale [N, K/group] bfloat16), float32
at::Tensor int4_linear_cpu(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scale, int64_t group_size,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && x.dim() >= 1 && group_size > 0 &&
                  x.size(-1) == 2 * qweight.size(1) && x.size(-1) % group_size == 0 && scale.dim() == 2 &&
                  scale.size(0) == qweight.size(0) && scale.size(1) == x.size(-1) / group_size,
              "auto_deploy::int4_linear: needs x [..., K], qweight [N, K/2] uint8 and scale [N, K/group_size]");
  const int64_t K = x.size(-1), N = qweight.size(0), lanes2 = 2 * g_kernels->floats_per_vector;
  const bool takes = x.scalar_type() == at::kFloat && scale.scalar_type() == at::kBFloat16 && qweight.is_contiguous() &&
                     scale.is_contiguous() && K % lanes2 == 0 && group_size % lanes2 == 0;
  if (!takes)
    return blockwise_linear(x, N, bias, [&](int64_t n0, int64_t n1) {
      return int4_widen(qweight, scale, group_size, n0, n1);
    });
  if (rows_of(x) > g_kernels->gemm_max_rows)  // blocks of rows widened by the kernels, torch's GEMM on them
    return blockwise_linear(x, N, bias, [&](int64_t n0, int64_t n1) {
      at::Tensor block = at::empty({n1 - n0, K}, x.options().dtype(at::kFloat));
      g_kernels->int4_widen(qweight.data_ptr<uint8_t>() + n0 * (K / 2),
                            reinterpret_cast<const uint16_t*>(scale.data_ptr()) + n0 * (K / group_size), group_size,
                            K, n1 - n0, block.data_ptr<float>());
      return block;
    });
  return int4_in_slabs(x, N, bias, "int4_linear", [&](const float* rows, float* y, int64_t M, bool amx) {
    return g_kernels->int4_gemm(rows, qweight.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scale.data_ptr()),
                                group_size, y, M, N, K, amx);
  });
}

// int4_linear over a weight packed in tiles of R rows (words [tiles, K/8, R] int32, scale [tiles, K/group, R]
// bfloat16; pack_int4_tiles in int4_linear.py): the active build's int4_packed_gemm where it packs R rows, else
// int4_linear on the weight unpacked to rows (a copy: a graph packed for another build)
at::Tensor int4_packed_linear_cpu(const at::Tensor& x, const at::Tensor& words, const at::Tensor& scale,
                                  int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(words.dim() == 3 && words.scalar_type() == at::kInt && scale.dim() == 3 && x.dim() >= 1 &&
                  group_size > 0 && x.size(-1) == 8 * words.size(1) && x.size(-1) % group_size == 0 &&
                  scale.size(0) == words.size(0) && scale.size(1) == x.size(-1) / group_size &&
                  scale.size(2) == words.size(2) && out_features > (words.size(0) - 1) * words.size(2) &&
                  out_features <= words.size(0) * words.size(2),
              "auto_deploy::int4_packed_linear: needs x [..., K], words [tiles, K/8, R] int32 and scale [tiles, "
              "K/group_size, R] for out_features in ((tiles - 1) * R, tiles * R]");
  const int64_t K = x.size(-1), N = out_features, R = words.size(2);
  // every row count: on AVX2 the integer passes beat torch's GEMM over widened blocks (int4_linear's path past
  // gemm_max_rows) at every size, 1.6x at 512 and 1024 rows (the 125M Llama's products, docs/performance.md)
  const bool takes = x.scalar_type() == at::kFloat && scale.scalar_type() == at::kBFloat16 && words.is_contiguous() &&
                     scale.is_contiguous() && R == g_kernels->int4_pack_rows && group_size % 32 == 0;
  if (!takes) {
    const at::Tensor qweight =
        words.transpose(1, 2).contiguous().view(at::kByte).reshape({words.size(0) * R, K / 2}).slice(0, 0, N);
    const at::Tensor row_scale = scale.transpose(1, 2).reshape({scale.size(0) * R, -1}).slice(0, 0, N);
    return int4_linear_cpu(x, qweight.contiguous(), row_scale.contiguous(), group_size, bias);
  }
  return int4_in_slabs(x, N, bias, "int4_packed_linear", [&](const float* rows, float* y, int64_t M, bool amx) {
    return g_kernels->int4_packed_gemm(rows, words.data_ptr<int32_t>(),
                                       reinterpret_cast<const uint16_t*>(scale.data_ptr()), group_size, y, M, N, K, amx);
  });
}

// auto_deploy::materialize (custom_ops/materialize.py): a copy, registered here only because a compiled decode
// graph calls it every step and a C++ kernel costs a few microseconds per call where Python costs tens
at::Tensor materialize_cpu(const at::Tensor& x) { return x.clone(); }

// ---- the pointwise ops of prompts (custom_ops/pointwise.py): float32 on the kernels, the plain-torch arithmetic
// for other dtypes ----

// x [..., n] as rows [numel / n, n] with its last n elements contiguous: a view where x's strides allow one (the
// halves of a fused product's output do), else a contiguous copy
at::Tensor as_rows(const at::Tensor& x, int64_t n) {
  const std::vector<int64_t> shape{n == 0 ? 0 : x.numel() / n, n};
  if (x.numel() > 0 && (n == 1 || x.stride(-1) == 1)) {
    if (auto strides = at::detail::computeStride(x.sizes(), x.strides(), shape); strides && (*strides)[1] == 1)
      return x.as_strided(shape, *strides);
  }
  return x.contiguous().view(shape);
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  const int64_t n = x.dim() > 0 ? x.size(-1) : 1;
  const bool takes = x.dim() > 0 && all_float({x}) &&
                     (!has(weight) || (all_float({*weight}) && weight->dim() == 1 && weight->size(0) == n));
  if (!takes) {  // rmsnorm_reference: in float32, rounded to x's dtype, then times the weight
    const at::Tensor x32 = x.to(at::kFloat);
    const at::Tensor normed = (x32 * (x32.pow(2).mean({-1}, true) + eps).rsqrt()).to(x.scalar_type());
    return has(weight) ? *weight * normed : normed;
  }
  const at::Tensor rows = as_rows(x, n);
  const at::Tensor w = has(weight) ? weight->contiguous() : at::Tensor();
  at::Tensor out = at::empty(x.sizes(), x.options());
  g_kernels->rms_norm(rows.data_ptr<float>(), rows.stride(0), w.defined() ? w.data_ptr<float>() : nullptr,
                      static_cast<float>(eps), out.data_ptr<float>(), rows.size(0), n);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                    const std::optional<at::Tensor>& weight, double eps) {
  const int64_t n = x.dim() > 0 ? x.size(-1) : 1;
  const bool takes = x.dim() > 0 && all_float({x, residual}) && x.sizes() == residual.sizes() &&
                     (!has(weight) || (all_float({*weight}) && weight->dim() == 1 && weight->size(0) == n));
  if (!takes) {
    const at::Tensor sum = x + residual;
    return {sum, rms_norm_cpu(sum, weight, eps)};
  }
  const at::Tensor a = as_rows(x, n), b = as_rows(residual, n);
  const at::Tensor w = has(weight) ? weight->contiguous() : at::Tensor();
  at::Tensor sum = at::empty(x.sizes(), x.options()), out = at::empty(x.sizes(), x.options());
  g_kernels->add_rms_norm(a.data_ptr<float>(), a.stride(0), b.data_ptr<float>(), b.stride(0),
                          w.defined() ? w.data_ptr<float>() : nullptr, static_cast<float>(eps), sum.data_ptr<float>(),
                          out.data_ptr<float>(), a.size(0), n);
  return {sum, out};
}

at::Tensor silu_mul_cpu(const at::Tensor& gate, const at::Tensor& up) {
  if (!all_float({gate, up}) || gate.sizes() != up.sizes() || gate.dim() == 0) return at::silu(gate) * up;
  const int64_t n = gate.size(-1);
  const at::Tensor g = as_rows(gate, n), u = as_rows(up, n);
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  g_kernels->silu_mul(g.data_ptr<float>(), g.stride(0), u.data_ptr<float>(), u.stride(0), out.data_ptr<float>(),
                      g.size(0), n);
  return out;
}

// x [batch, seq, heads, head_dim] by cos / sin [batch or 1, seq, rot_dim] (rope_reference with unsqueeze_dim 2)
at::Tensor rope_one(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rot = cos.size(-1), half = rot / 2;
  const bool takes = all_float({x, cos, sin}) && x.dim() == 4 && cos.dim() == 3 && sin.sizes() == cos.sizes() &&
                     (cos.size(0) == x.size(0) || cos.size(0) == 1) && cos.size(1) == x.size(1) && rot % 2 == 0 &&
                     rot <= x.size(3);
  if (!takes) {
    const at::Tensor c = cos.unsqueeze(2), s = sin.unsqueeze(2), x_rot = x.slice(-1, 0, rot);
    const at::Tensor rotated = at::cat({x_rot.slice(-1, half, rot).neg(), x_rot.slice(-1, 0, half)}, -1);
    const at::Tensor out = x_rot * c + rotated * s;
    return rot == x.size(-1) ? out : at::cat({out, x.slice(-1, rot).to(out.scalar_type())}, -1);
  }
  const int64_t heads = x.size(2), head_dim = x.size(3), tokens = x.size(0) * x.size(1);
  const at::Tensor rows = as_rows(x, heads * head_dim);
  const at::Tensor c = as_rows(cos.expand({x.size(0), x.size(1), rot}), rot);
  const at::Tensor s = as_rows(sin.expand({x.size(0), x.size(1), rot}), rot);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  g_kernels->rope(rows.data_ptr<float>(), rows.stride(0), heads, head_dim, c.data_ptr<float>(), s.data_ptr<float>(),
                  c.stride(0), rot, out.data_ptr<float>(), tokens);
  return out;
}

std::tuple<at::Tensor, at::Tensor> rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                            const at::Tensor& sin) {
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(-1) % 2 == 0 && cos.size(-1) <= q.size(-1) &&
                  cos.size(-1) <= k.size(-1),
              "auto_deploy::rope: cos and sin must have one shape, an even rotary dim of at most the head dim");
  return {rope_one(q, cos, sin), rope_one(k, cos, sin)};
}

// The decode step's attention block in one call: RoPE of the new tokens' q and k (rotate_half pairs; q, k [T,
// heads, d] and v [T, n_kv, dv], each token's heads side by side at any token stride, as columns of a fused q/k/v
// product; cos / sin [T, rot]), k and v into their cache slots, then the decode_attention kernel. The compiled step
// ran RoPE and the cache write as an Inductor kernel of their own between the q/k/v product and the attention
// (cached_attention.py, paged_decode_attention_rope). Nothing here goes through the dispatcher but the output's
// allocation: a step calls it once per layer, when the weights streamed since have pushed ATen's code out of the
// caches.
at::Tensor decode_attention_rope_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& input_pos,
                                     const at::Tensor& page_table, double scale, int64_t sliding_window) {
  // a dim of one element may have any stride (torch calls such tensors contiguous, and Inductor hands them over so)
  const auto token_rows = [](const at::Tensor& t) {
    return t.dim() == 3 && (t.size(2) == 1 || t.stride(2) == 1) && (t.size(1) == 1 || t.stride(1) == t.size(2));
  };
  const auto indices = [](const at::Tensor& t) {
    return (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong) && t.is_contiguous();
  };
  TORCH_CHECK(all_float({q, k, v, cos, sin, k_cache, v_cache}) && token_rows(q) && token_rows(k) && token_rows(v) &&
                  cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.stride(1) == 1 && sin.stride(1) == 1 &&
                  k.size(0) == q.size(0) && v.size(0) == q.size(0) && cos.size(0) == q.size(0) &&
                  k.size(2) == q.size(2) && q.size(1) % k.size(1) == 0 && cos.size(1) % 2 == 0 &&
                  cos.size(1) <= q.size(2) && k_cache.dim() == 4 && v_cache.dim() == 4 &&
                  k.sizes().slice(1) == k_cache.sizes().slice(2) && v.sizes().slice(1) == v_cache.sizes().slice(2) &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && q.size(2) % g_kernels->floats_per_vector == 0 &&
                  v.size(2) % g_kernels->floats_per_vector == 0 && indices(input_pos) && input_pos.dim() == 1 &&
                  input_pos.size(0) == q.size(0) && indices(page_table) && page_table.dim() == 2 &&
                  page_table.size(0) == q.size(0),
              "auto_deploy::decode_attention_rope: needs float32 q [T, n_heads, d], k [T, n_kv, d] and v [T, n_kv, "
              "dv] (each token's heads side by side), cos and sin [T, rot] with rot even and at most d, contiguous "
              "caches [pages, page_size, n_kv, d | dv], d and dv multiples of ", g_kernels->floats_per_vector,
              ", and int32 or int64 input_pos [T] and page_table [T, width]");
  const int64_t tokens = q.size(0), heads = q.size(1), kv_heads = k.size(1), head_dim = q.size(2), rot = cos.size(1);
  const int64_t width = page_table.size(1), page_size = k_cache.size(1), num_pages = k_cache.size(0);
  const int64_t k_row = kv_heads * head_dim, v_row = v.size(1) * v.size(2);
  // the indices as the kernel reads them, and the rotated queries: scratch of this thread, no allocation a step
  thread_local std::vector<int64_t> index_scratch;
  thread_local std::vector<float> query_scratch;
  index_scratch.resize(tokens * (1 + width));
  query_scratch.resize(tokens * heads * head_dim);
  int64_t* pos = index_scratch.data();
  int64_t* table = pos + tokens;
  const auto widen = [](const at::Tensor& t, int64_t* to) {
    if (t.scalar_type() == at::kLong) std::memcpy(to, t.data_ptr<int64_t>(), t.numel() * sizeof(int64_t));
    else std::copy_n(t.data_ptr<int32_t>(), t.numel(), to);
  };
  widen(input_pos, pos);
  widen(page_table, table);
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  g_kernels->rope(q.data_ptr<float>(), q.stride(0), heads, head_dim, c, s, cos.stride(0), rot, query_scratch.data(),
                  tokens);
  float* k_out = k_cache.data_ptr<float>();
  float* v_out = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {  // each token's rotated k straight into its slot
    TORCH_CHECK(pos[t] >= 0 && pos[t] / page_size < width, "auto_deploy::decode_attention_rope: sequence ", t,
                " is at position ", pos[t], ", past the page table (", width, " pages of ", page_size, ")");
    const int64_t page = table[t * width + pos[t] / page_size];
    TORCH_CHECK(page >= 0 && page < num_pages, "auto_deploy::decode_attention_rope: sequence ", t, " names page ",
                page, ", a page index outside the cache (", num_pages, " pages)");
    const int64_t slot = page * page_size + pos[t] % page_size;
    g_kernels->rope(k.data_ptr<float>() + t * k.stride(0), k.stride(0), kv_heads, head_dim, c + t * cos.stride(0),
                    s + t * sin.stride(0), cos.stride(0), rot, k_out + slot * k_row, 1);
    std::memcpy(v_out + slot * v_row, v.data_ptr<float>() + t * v.stride(0), v_row * sizeof(float));
  }
  at::Tensor out = at::empty({tokens, heads, v.size(2)}, q.options());
  attend_cached("decode_attention_rope", query_scratch.data(), k_cache, v_cache, pos, table, width,
                out.data_ptr<float>(), tokens, heads, scale, sliding_window);
  return out;
}

}  // namespace

// The ops as AOTInductor C shims: a compiled decode step calls aoti_torch_cpu_<op> directly where its package
// was built with them (compile/aoti.py, custom_ops_to_c_shims), instead of going through the proxy executor
// and the dispatcher for each of its products (about 3.5 us a call, against well under 1 us this way).
namespace {
using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::resolve_tensor_dispatch_flags;

template <typename F>
AOTITorchError shim_call(AtenTensorHandle* ret, const F& op) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    TORCH_CHECK(g_kernels != nullptr, "autodeploy native kernels: no kernel table loaded");
    *ret = new_tensor_handle(op());
  });
}
}  // namespace

extern "C" {
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_f32_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                           AtenTensorHandle* bias, AtenTensorHandle* ret) {
  return shim_call(ret, [&] {
    return f32_linear_cpu(resolve_tensor_dispatch_flags(x), resolve_tensor_dispatch_flags(weight),
                          resolve_tensor_dispatch_flags(bias));
  });
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_f32_packed_linear(AtenTensorHandle x, AtenTensorHandle panels,
                                                                  int64_t out_features, AtenTensorHandle* bias,
                                                                  AtenTensorHandle* ret) {
  return shim_call(ret, [&] {
    return f32_packed_linear_cpu(resolve_tensor_dispatch_flags(x), resolve_tensor_dispatch_flags(panels), out_features,
                                 resolve_tensor_dispatch_flags(bias));
  });
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_half_packed_linear(AtenTensorHandle x, AtenTensorHandle panels,
                                                                   int64_t out_features, AtenTensorHandle* bias,
                                                                   AtenTensorHandle* ret) {
  return shim_call(ret, [&] {
    return half_packed_linear_cpu(resolve_tensor_dispatch_flags(x), resolve_tensor_dispatch_flags(panels),
                                  out_features, resolve_tensor_dispatch_flags(bias));
  });
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_half_linear(AtenTensorHandle x, AtenTensorHandle weight,
                                                            AtenTensorHandle* bias, AtenTensorHandle* ret) {
  return shim_call(ret, [&] {
    return half_linear_cpu(resolve_tensor_dispatch_flags(x), resolve_tensor_dispatch_flags(weight),
                           resolve_tensor_dispatch_flags(bias));
  });
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_int4_linear(AtenTensorHandle x, AtenTensorHandle qweight,
                                                            AtenTensorHandle scale, int64_t group_size,
                                                            AtenTensorHandle* bias, AtenTensorHandle* ret) {
  return shim_call(ret, [&] {
    return int4_linear_cpu(resolve_tensor_dispatch_flags(x), resolve_tensor_dispatch_flags(qweight),
                           resolve_tensor_dispatch_flags(scale), group_size, resolve_tensor_dispatch_flags(bias));
  });
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_int4_packed_linear(AtenTensorHandle x, AtenTensorHandle words,
                                                                   AtenTensorHandle scale, int64_t group_size,
                                                                   int64_t out_features, AtenTensorHandle* bias,
                                                                   AtenTensorHandle* ret) {
  return shim_call(ret, [&] {
    return int4_packed_linear_cpu(resolve_tensor_dispatch_flags(x), resolve_tensor_dispatch_flags(words),
                                  resolve_tensor_dispatch_flags(scale), group_size, out_features,
                                  resolve_tensor_dispatch_flags(bias));
  });
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_int8_gemv(AtenTensorHandle x, AtenTensorHandle weight,
                                                          AtenTensorHandle scale, AtenTensorHandle* ret) {
  return shim_call(ret, [&] {
    return int8_gemv_cpu(resolve_tensor_dispatch_flags(x), resolve_tensor_dispatch_flags(weight),
                         resolve_tensor_dispatch_flags(scale));
  });
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_materialize(AtenTensorHandle x, AtenTensorHandle* ret) {
  return shim_call(ret, [&] { return materialize_cpu(resolve_tensor_dispatch_flags(x)); });
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_decode_attention_rope(
    AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle cos, AtenTensorHandle sin,
    AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle input_pos, AtenTensorHandle page_table,
    double scale, int64_t sliding_window, AtenTensorHandle* ret) {
  return shim_call(ret, [&] {
    return decode_attention_rope_cpu(
        resolve_tensor_dispatch_flags(q), resolve_tensor_dispatch_flags(k), resolve_tensor_dispatch_flags(v),
        resolve_tensor_dispatch_flags(cos), resolve_tensor_dispatch_flags(sin), resolve_tensor_dispatch_flags(k_cache),
        resolve_tensor_dispatch_flags(v_cache), resolve_tensor_dispatch_flags(input_pos),
        resolve_tensor_dispatch_flags(page_table), scale, sliding_window);
  });
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_decode_attention(AtenTensorHandle q, AtenTensorHandle k_cache,
                                                                 AtenTensorHandle v_cache, AtenTensorHandle input_pos,
                                                                 AtenTensorHandle page_table, double scale,
                                                                 int64_t sliding_window, AtenTensorHandle* ret) {
  return shim_call(ret, [&] {
    return decode_attention_cpu(resolve_tensor_dispatch_flags(q), resolve_tensor_dispatch_flags(k_cache),
                                resolve_tensor_dispatch_flags(v_cache), resolve_tensor_dispatch_flags(input_pos),
                                resolve_tensor_dispatch_flags(page_table), scale, sliding_window);
  });
}
}

// One IMPL library for the process: its registrations last as long as the process (the library file stays
// loaded), and a second call registers nothing twice.
static std::unique_ptr<torch::Library> g_cpu_kernels;
// And one FRAGMENT library for the classes (DecodeLoop, decode_loop.h)
static std::unique_ptr<torch::Library> g_classes;

// The kernels the ops call; a later call switches builds (tests run every build this CPU can run).
AUTODEPLOY_API void autodeploy_use_kernels(const autodeploy::KernelTable* table) { g_kernels = table; }

// The active build's row limits (Python reads them when it switches builds).
AUTODEPLOY_API int64_t autodeploy_gemm_max_rows() { return g_kernels == nullptr ? 0 : g_kernels->gemm_max_rows; }
AUTODEPLOY_API int64_t autodeploy_f32_max_rows() { return g_kernels == nullptr ? 0 : g_kernels->f32_max_rows; }

// The rows per panel of the active build's packed float32 layout (KernelTable::f32_pack_width; 0: none).
AUTODEPLOY_API int autodeploy_f32_pack_width() { return g_kernels == nullptr ? 0 : g_kernels->f32_pack_width; }

// The rows per panel of the active build's packed 16-bit layout (KernelTable::half_pack_width; 0: none).
AUTODEPLOY_API int autodeploy_half_pack_width() { return g_kernels == nullptr ? 0 : g_kernels->half_pack_width; }

// The rows per tile of the active build's packed 4-bit layout (KernelTable::int4_pack_rows; 0: none).
AUTODEPLOY_API int autodeploy_int4_pack_rows() { return g_kernels == nullptr ? 0 : g_kernels->int4_pack_rows; }

// Whether the active build's 4-bit products (decode rows, pair products of prompts) use AVX512-VNNI here (with_vnni).
AUTODEPLOY_API int autodeploy_vnni_products() { return g_kernels != nullptr && g_kernels->integer_vnni ? 1 : 0; }

// The prompt products that run on AMX here (amx.h): bit 0 those of bf16 weights, bit 1 those of int8 weights.
AUTODEPLOY_API int autodeploy_amx_products() {
  return (autodeploy::amx::available(at::kBFloat16) ? 1 : 0) | (autodeploy::amx::available(at::kChar) ? 2 : 0);
}

// The token greedy_steps picks from a row of n logits (decode_loop.h's first_largest), for the tests.
AUTODEPLOY_API int64_t autodeploy_first_largest(const float* values, int64_t n) {
  return autodeploy::first_largest(values, n);
}

// Registers the kernels as the CPU implementations of the ops (those Python has defined: half_linear and
// int4_linear are named by flags). Returns 0 on success, -1 if there is no kernel table or the registration
// failed (the message goes to stderr).
AUTODEPLOY_API int autodeploy_register_cpu_kernels(int half_linear_on, int int4_linear_on) {
  try {
    if (g_kernels == nullptr) return -1;
    if (g_cpu_kernels) return 0;
    g_classes = std::make_unique<torch::Library>(torch::Library::FRAGMENT, "auto_deploy", std::nullopt, __FILE__,
                                                 __LINE__);
    g_classes->class_<autodeploy::DecodeLoop>("DecodeLoop")
        .def(torch::init<std::string>())
        .def("get_constant_fqns", &autodeploy::DecodeLoop::get_constant_fqns)
        .def("load_constants", &autodeploy::DecodeLoop::load_constants)
        .def("run", &autodeploy::DecodeLoop::run)
        .def("greedy_steps", &autodeploy::DecodeLoop::greedy_steps);
    g_cpu_kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "auto_deploy", c10::DispatchKey::CPU,
                                                     __FILE__, __LINE__);
    g_cpu_kernels->impl("int8_gemv", TORCH_FN(int8_gemv_cpu));
    g_cpu_kernels->impl("int8_mm", TORCH_FN(int8_mm_cpu));
    g_cpu_kernels->impl("int8_split_mm", TORCH_FN(int8_split_mm_cpu));
    g_cpu_kernels->impl("materialize", TORCH_FN(materialize_cpu));
    g_cpu_kernels->impl("decode_attention", TORCH_FN(decode_attention_cpu));
    g_cpu_kernels->impl("decode_attention_rope", TORCH_FN(decode_attention_rope_cpu));
    g_cpu_kernels->impl("f32_linear", TORCH_FN(f32_linear_cpu));
    g_cpu_kernels->impl("f32_packed_linear", TORCH_FN(f32_packed_linear_cpu));
    g_cpu_kernels->impl("prefill_attention", TORCH_FN(prefill_attention_cpu));
    g_cpu_kernels->impl("write_kv_cache", TORCH_FN(write_kv_cache_cpu));
    g_cpu_kernels->impl("rms_norm", TORCH_FN(rms_norm_cpu));
    g_cpu_kernels->impl("add_rms_norm", TORCH_FN(add_rms_norm_cpu));
    g_cpu_kernels->impl("silu_mul", TORCH_FN(silu_mul_cpu));
    g_cpu_kernels->impl("rope", TORCH_FN(rope_cpu));
    if (half_linear_on) {
      g_cpu_kernels->impl("half_linear", TORCH_FN(half_linear_cpu));
      g_cpu_kernels->impl("half_packed_linear", TORCH_FN(half_packed_linear_cpu));
    }
    if (int4_linear_on) {
      g_cpu_kernels->impl("int4_linear", TORCH_FN(int4_linear_cpu));
      g_cpu_kernels->impl("int4_packed_linear", TORCH_FN(int4_packed_linear_cpu));
    }
    return 0;
  } catch (const std::exception& error) {
    fprintf(stderr, "autodeploy native kernels: registration failed: %s\n", error.what());
    return -1;
  }
}
