// The native kernels as the CPU implementations of auto_deploy ops whose schemas, plain-torch implementations
// and fake implementations are defined in Python (custom_ops/linear.py, quant_linear.py, cached_attention.py):
//   auto_deploy::int8_gemv(Tensor x, Tensor weight, Tensor scale) -> Tensor              (int8_gemv.c)
//   auto_deploy::decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor input_pos,
//                                 Tensor page_table, float scale, int sliding_window) -> Tensor
//                                                                                     (decode_attention.c)
//   auto_deploy::f32_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor        (f32_small_gemm.c)
// Python calls autodeploy_register_cpu_kernels() once the library is loaded, naming the kernels this CPU runs;
// only those replace the plain-torch implementation on CPU. The int8_gemv and f32_linear operators take any
// input their plain-torch implementations take (the kernel where it can, the same arithmetic in ATen
// otherwise); decode_attention takes what its callers check with native.decode_attention_takes. Registered from C++ rather than wrapped in
// Python because compiled decode graphs call them many times per step, and a C++ registration keeps the
// per-call dispatch cost low.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <cstdio>
#include <memory>

extern "C" int int8_gemv(const float* x, const int8_t* w, const uint16_t* scale, float* y, int64_t M, int64_t N,
                         int64_t K, int num_threads);
extern "C" int int8_gemv_supported(void);
extern "C" int decode_attention_supported(void);
extern "C" int decode_attention_f32(const float* q, const float* k_cache, const float* v_cache,
                                    const int64_t* input_pos, const int64_t* page_table, float* out,
                                    int64_t num_seqs, int64_t n_heads, int64_t n_kv, int64_t head_dim, int64_t v_dim,
                                    int64_t num_pages, int64_t page_size, int64_t table_width, float scale,
                                    int64_t window, int num_threads);
extern "C" int f32_small_gemm_supported(void);
extern "C" int f32_small_gemm(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K,
                              int num_threads);

namespace {

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
  const bool takes = int8_gemv_supported() && x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar &&
                     scale.scalar_type() == at::kBFloat16 && weight.is_contiguous() && scale.is_contiguous() &&
                     K % 64 == 0;
  if (!takes) return int8_gemv_aten(x, weight, scale);  // the op runs everywhere; the kernel where it can
  const at::Tensor rows = x.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options());
  const int status = int8_gemv(rows.data_ptr<float>(), weight.data_ptr<int8_t>(),
                               reinterpret_cast<const uint16_t*>(scale.data_ptr()), out.data_ptr<float>(),
                               rows.numel() / K, N, K, at::get_num_threads());
  TORCH_CHECK(status == 0, "auto_deploy::int8_gemv: out of memory for the activation scratch");
  return out;
}

// q [num_seqs, n_heads, head_dim] (or [..., n_heads, head_dim] with the leading dims one token per
// sequence), caches [num_pages, page_size, n_kv, head_dim], input_pos [num_seqs], page_table
// [num_seqs, width]: the conventions of auto_deploy::torch_cached_attention for a decode-only batch,
// after the new tokens' k/v were written to the caches.
at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& input_pos, const at::Tensor& page_table, double scale,
                                int64_t sliding_window) {
  TORCH_CHECK(decode_attention_supported(), "auto_deploy::decode_attention: this CPU has no AVX-512");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "auto_deploy::decode_attention: needs float32 q and caches");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.size(0) == v_cache.size(0) && k_cache.size(1) == v_cache.size(1) &&
                  k_cache.size(2) == v_cache.size(2),
              "auto_deploy::decode_attention: caches must be contiguous [num_pages, page_size, n_kv, head_dim]");
  const int64_t n_kv = k_cache.size(2), head_dim = k_cache.size(3), v_dim = v_cache.size(3);
  TORCH_CHECK(head_dim % 16 == 0 && v_dim % 16 == 0,
              "auto_deploy::decode_attention: head sizes must be multiples of 16");
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
  const int status = decode_attention_f32(
      rows.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), positions.data_ptr<int64_t>(),
      pages.data_ptr<int64_t>(), out.data_ptr<float>(), num_seqs, n_heads, n_kv, head_dim, v_dim, k_cache.size(0),
      k_cache.size(1), pages.size(1), static_cast<float>(scale), sliding_window, at::get_num_threads());
  TORCH_CHECK(status != -1, "auto_deploy::decode_attention: a position is past the page table, or a page index "
              "is outside the cache");
  TORCH_CHECK(status == 0, "auto_deploy::decode_attention: out of memory for the scores scratch");
  return out;
}

// linear(x [..., K], weight [N, K], bias [N]) in float32. Up to kSmallGemmMaxRows rows (decode batches) the
// native kernel, more rows (prompts, large decode batches) torch's linear, bit for bit.
constexpr int64_t kSmallGemmMaxRows = 16;

at::Tensor f32_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const bool takes = f32_small_gemm_supported() && x.scalar_type() == at::kFloat &&
                     weight.scalar_type() == at::kFloat && weight.dim() == 2 && weight.is_contiguous() &&
                     x.dim() >= 1 && x.size(-1) == weight.size(1) && weight.size(1) % 16 == 0 &&
                     (!bias.has_value() || !bias->defined() || bias->scalar_type() == at::kFloat);
  // the op is linear everywhere: the kernel for the inputs it takes, up to kSmallGemmMaxRows rows
  if (!takes || x.numel() / weight.size(1) > kSmallGemmMaxRows) return at::linear(x, weight, bias);
  const int64_t K = weight.size(1), N = weight.size(0), rows = x.numel() / K;
  const at::Tensor input = x.contiguous();
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor out = at::empty(sizes, x.options());
  f32_small_gemm(input.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, N, K,
                 at::get_num_threads());
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out;
}

}  // namespace

// One IMPL library for the process: its registrations last as long as the process (the library file stays
// loaded), and a second call registers nothing twice.
static std::unique_ptr<torch::Library> g_cpu_kernels;

// Returns 0 on success, -1 if the registration failed (the message goes to stderr).
extern "C" int autodeploy_register_cpu_kernels(int int8_gemv_on, int decode_attention_on, int f32_linear_on) {
  try {
    if (g_cpu_kernels) return 0;
    g_cpu_kernels = std::make_unique<torch::Library>(torch::Library::IMPL, "auto_deploy", c10::DispatchKey::CPU,
                                                     __FILE__, __LINE__);
    if (int8_gemv_on) g_cpu_kernels->impl("int8_gemv", TORCH_FN(int8_gemv_cpu));
    if (decode_attention_on) g_cpu_kernels->impl("decode_attention", TORCH_FN(decode_attention_cpu));
    if (f32_linear_on) g_cpu_kernels->impl("f32_linear", TORCH_FN(f32_linear_cpu));
    return 0;
  } catch (const std::exception& error) {
    fprintf(stderr, "autodeploy native kernels: registration failed: %s\n", error.what());
    return -1;
  }
}
