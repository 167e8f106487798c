// auto_deploy::int8_gemv(Tensor x, Tensor weight, Tensor scale) -> Tensor: the kernel of int8_gemv.c as a
// torch operator. Registered from C++ because compiled decode graphs call it about 50 times per step
// between Inductor's kernels: a call costs 3.7 us this way, 8.5 us through a Python implementation.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

extern "C" int int8_gemv(const float* x, const int8_t* w, const uint16_t* scale, float* y, int64_t M, int64_t N,
                         int64_t K, int num_threads);
extern "C" int int8_gemv_supported(void);

namespace {

at::Tensor int8_gemv_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(int8_gemv_supported(), "auto_deploy::int8_gemv: this CPU has no AVX-512 VNNI");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kChar &&
                  scale.scalar_type() == at::kBFloat16,
              "auto_deploy::int8_gemv: needs float32 x, int8 weight and bfloat16 scale");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && scale.is_contiguous() && scale.numel() == weight.size(0),
              "auto_deploy::int8_gemv: needs a contiguous [N, K] weight and N contiguous scales");
  const int64_t K = weight.size(1), N = weight.size(0);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && K % 64 == 0,
              "auto_deploy::int8_gemv: x's last dim must equal the weight's K, a multiple of 64");
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(auto_deploy, m) { m.def("int8_gemv(Tensor x, Tensor weight, Tensor scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(auto_deploy, CPU, m) { m.impl("int8_gemv", &int8_gemv_cpu); }
