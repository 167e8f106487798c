// Prompt products on CPUs with AMX (Intel Xeon since Sapphire Rapids): oneDNN's micro-kernels, as torch exposes
// them (at::native::cpublas::brgemm, the ones its CPU flash attention runs), over weights packed a block at a
// time. ops.cpp uses them for many rows of bf16 weights (activations split into two bfloat16 halves) and of int8
// weights (activations split into two int8 halves); decode rows keep the native kernels.
//
// Measured on the Intel Xeon (AMX) of docs/performance.md, 2 threads, the 125M Llama's 48 layer products, before
// and after, one process each: bf16 weights 98 -> 48 ms at 128 rows (the native float32 kernel before) and
// 2674 -> 669 ms at 2048; int8 weights 43 -> 34 ms and 563 -> 404 ms (torch's int8 GEMM before, torch._int_mm).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace autodeploy::amx {

// Whether oneDNN runs products of this input type on AMX here (its effective ISA, which ONEDNN_MAX_CPU_ISA can
// lower: an AVX2 emulation never takes this path) and torch lets it (torch.backends.mkldnn.enabled).
inline bool available(at::ScalarType dtype) { return at::native::cpublas::could_pack(dtype); }

// Whether K suits the micro-kernel's layout: whole 32-bit groups of consecutive k (2 bfloat16s, 4 int8s)
template <typename T>
constexpr bool takes_depth(int64_t K) {
  return (K * static_cast<int64_t>(sizeof(T))) % 4 == 0;
}

constexpr int64_t kBlockN = 64;  // weight rows per micro-kernel call
constexpr int64_t kBlockM = 32;  // activation rows per micro-kernel call
constexpr int64_t kChunkM = 256;  // activation rows per task
constexpr int64_t kWideBlocks = 4;  // kBlockN-row blocks a task packs, where that leaves tasks for every thread

// The products of two activation matrices hi and lo [M, K] (T: bfloat16 or int8) with a weight w [N, K] (T), C the
// micro-kernel's accumulator type (float for bfloat16, int32_t for int8). Tasks are pairs of a chunk of kChunkM
// rows and a block of weight rows, each thread's tasks consecutive and block-major, so a thread packs a block once
// for all its chunks: pack(n0, rows, out) writes weight rows [n0, n0 + rows) in the VNNI layout,
// [K / g][rows][g] for g = 4 / sizeof(T) (transpose32 of their 32-bit groups). Each kBlockM x kBlockN result pair
// goes to epilogue(m0, rows, n0, cols, const C* hi_products, const C* lo_products) (row stride cols) while in
// cache. K must satisfy takes_depth<T>.
template <typename T, typename C, typename Pack, typename Epilogue>
void split_products(const T* hi, const T* lo, int64_t M, int64_t N, int64_t K, const Pack& pack,
                    const Epilogue& epilogue) {
  using at::native::cpublas::brgemm;
  if (M <= 0 || N <= 0) return;
  const int64_t chunks = (M + kChunkM - 1) / kChunkM;
  int64_t width = kWideBlocks * kBlockN;  // weight rows per task: fewer where the tasks would not go round
  if (chunks * ((N + width - 1) / width) < 4 * at::get_num_threads()) width = kBlockN;
  const int64_t blocks = (N + width - 1) / width;
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<T> packed(K * width);
    std::vector<C> hi_products(kBlockM * kBlockN), lo_products(kBlockM * kBlockN);
    int64_t packed_block = -1;
    for (int64_t task = first; task < last; ++task) {
      const int64_t block = task / chunks, chunk = task % chunks;
      const int64_t n0 = block * width, rows = std::min(width, N - n0);
      if (block != packed_block) {
        for (int64_t s = 0; s < rows; s += kBlockN) pack(n0 + s, std::min(kBlockN, rows - s), packed.data() + s * K);
        packed_block = block;
      }
      const int64_t m_end = std::min(M, (chunk + 1) * kChunkM);
      for (int64_t m0 = chunk * kChunkM; m0 < m_end; m0 += kBlockM) {
        const int64_t count = std::min(kBlockM, m_end - m0);
        for (int64_t s = 0; s < rows; s += kBlockN) {
          const int64_t cols = std::min(kBlockN, rows - s);
          const T* b = packed.data() + s * K;
          brgemm(count, cols, K, K, cols, cols, /*add_C=*/false, hi + m0 * K, b, hi_products.data(), true);
          brgemm(count, cols, K, K, cols, cols, /*add_C=*/false, lo + m0 * K, b, lo_products.data(), true);
          epilogue(m0, count, n0 + s, cols, hi_products.data(), lo_products.data());
        }
      }
    }
    at::native::cpublas::brgemm_release(true);  // the thread's AMX tile state
  });
}

}  // namespace autodeploy::amx
