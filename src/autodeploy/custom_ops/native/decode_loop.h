// The served decode step (an AOTInductor package, runtime/package.py) run from C++: one step at a time (run), or
// several greedy decode steps in one call (greedy_steps), each fed the tokens the one before picked.
//
// Why: between two steps of a batch-1 decode the engine's Python took 180-200 us of a 3.5-4 ms int8 step on the
// Intel Xeon of docs/performance.md, most of it the first calls into torch and numpy after the step's weights had
// pushed their code out of the caches. Here the steps of a burst follow each other with nothing but a few integer
// writes and an argmax between them.
//
// Python: torch.classes.auto_deploy.DecodeLoop(package_path), registered by autodeploy_register_decode_loop().
#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/argmax.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/custom_class.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <unordered_map>
#include <vector>

namespace autodeploy {

// The index of the first of the n values' largest, a NaN counting as larger than any number (the first NaN
// wins): what at::argmax and numpy's argmax pick (n > 0). The largest of each block of kBlock first, without a
// branch inside the block, the values prefetched 2 KB ahead (right after a decode step its logits have left the
// caches); from a block holding a NaN on, one value at a time. Timed inside greedy_steps on the 125M Llama's
// 32000 logits (int8, AVX2, the Intel Xeon of docs/performance.md): at::argmax 74 us a step, a plain loop 39 us,
// this 27 us (34 us without the prefetch).
inline int64_t first_largest(const float* values, int64_t n) {
  constexpr int64_t kBlock = 16;
  int64_t block = -1;
  float largest = 0.f;
  int64_t b = 0;
  for (; b + kBlock <= n; b += kBlock) {
    __builtin_prefetch(values + b + 512);
    float most = values[b];
    bool nan = false;
    for (int64_t j = 0; j < kBlock; ++j) {
      const float value = values[b + j];
      most = value > most ? value : most;
      nan |= value != value;
    }
    if (nan) break;
    if (block < 0 || most > largest) {
      largest = most;
      block = b;
    }
  }
  int64_t best = block;
  if (block >= 0)
    while (values[best] != largest) ++best;  // the block's first value equal to its largest
  for (int64_t i = b; i < n; ++i) {  // the values after the whole blocks, or from the block holding a NaN
    const float value = values[i];
    if (value != value) return i;
    if (best < 0 || value > largest) {
      largest = value;
      best = i;
    }
  }
  return best;
}

class DecodeLoop : public torch::CustomClassHolder {
 public:
  explicit DecodeLoop(const std::string& package_path)
      : loader_(package_path, "model", /*run_single_threaded=*/false, /*num_runners=*/1, /*device_index=*/-1) {}

  std::vector<std::string> get_constant_fqns() { return loader_.get_constant_fqns(); }

  // The package's constants by name (user_managed: the package reads and writes these very tensors).
  void load_constants(c10::Dict<std::string, at::Tensor> constants, bool use_inactive, bool check_full_update,
                      bool user_managed) {
    std::unordered_map<std::string, at::Tensor> map;
    for (const auto& item : constants) map.emplace(item.key(), item.value());
    loader_.load_constants(map, use_inactive, check_full_update, user_managed);
  }

  std::vector<at::Tensor> run(std::vector<at::Tensor> args) { return loader_.run(args); }

  // Up to `steps` greedy decode steps of the batch `args` holds (the graph's inputs in GRAPH_INPUTS order,
  // runtime/sequence_info.py: input_ids [1, n] and position_ids [1, n] int64 first, input_pos [n] int32 fourth;
  // one token per sequence). Before each step every sequence's token becomes the one picked for it last (`tokens`
  // [n] int64 before the first) and its position moves one on, in place in those tensors. After each step sequence
  // i picks the first of its logits' largest values (a NaN before any number, as numpy's argmax). The loop ends
  // after `steps` steps, after a step where a sequence picked one of its `stop_tokens` (row i of [n, s] int64,
  // padded with -1), after the step that passes `max_seconds` since the call, before a step whose positions would
  // reach `capacity` (what the page table covers), or before a step once another thread has set `interrupt[0]`
  // (int32; a server with requests to admit). Returns the picked tokens, [steps run, n] int64. Python's GIL is
  // released meanwhile (torch's call of a class method), so that thread runs.
  at::Tensor greedy_steps(std::vector<at::Tensor> args, at::Tensor tokens, at::Tensor stop_tokens, int64_t steps,
                          int64_t capacity, double max_seconds, at::Tensor interrupt) {
    const auto start = std::chrono::steady_clock::now();
    TORCH_CHECK(interrupt.scalar_type() == at::kInt && interrupt.numel() == 1,
                "greedy_steps: interrupt must be one int32 flag");
    const int32_t* interrupted = interrupt.data_ptr<int32_t>();
    TORCH_CHECK(args.size() >= 5, "greedy_steps: expected the graph's inputs, got ", args.size(), " tensors");
    const at::Tensor &ids = args[0], &positions = args[1], &input_pos = args[3];
    const int64_t n = ids.numel();
    TORCH_CHECK(ids.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                    input_pos.scalar_type() == at::kInt && tokens.scalar_type() == at::kLong &&
                    stop_tokens.scalar_type() == at::kLong,
                "greedy_steps: input_ids, position_ids, tokens and stop_tokens must be int64, input_pos int32");
    TORCH_CHECK(ids.is_contiguous() && positions.is_contiguous() && input_pos.is_contiguous() &&
                    tokens.is_contiguous() && stop_tokens.is_contiguous(),
                "greedy_steps: the batch's tensors must be contiguous");
    TORCH_CHECK(positions.numel() == n && input_pos.numel() == n && tokens.numel() == n &&
                    stop_tokens.dim() == 2 && stop_tokens.size(0) == n,
                "greedy_steps: a decode batch has one token per sequence: input_ids ", ids.sizes(), ", position_ids ",
                positions.sizes(), ", input_pos ", input_pos.sizes(), ", tokens ", tokens.sizes(), ", stop_tokens ",
                stop_tokens.sizes());
    int64_t* id = ids.data_ptr<int64_t>();
    int64_t* pos = positions.data_ptr<int64_t>();
    int32_t* cached = input_pos.data_ptr<int32_t>();
    const int64_t* stops = stop_tokens.data_ptr<int64_t>();
    const int64_t num_stops = stop_tokens.size(1);
    std::vector<int64_t> next(tokens.data_ptr<int64_t>(), tokens.data_ptr<int64_t>() + n);
    at::Tensor picked_all = at::empty({std::max<int64_t>(steps, 0), n}, ids.options());
    int64_t* picked_rows = picked_all.data_ptr<int64_t>();
    int64_t done = 0;
    while (done < steps) {
      if (*std::max_element(pos, pos + n) + 1 >= capacity) break;
      if (__atomic_load_n(interrupted, __ATOMIC_RELAXED) != 0) break;  // written by another thread
      for (int64_t i = 0; i < n; ++i) {
        id[i] = next[i];
        pos[i] += 1;
        cached[i] += 1;
      }
      std::vector<at::Tensor> out = loader_.run(args);
      TORCH_CHECK(!out.empty() && out[0].dim() == 3 && out[0].size(1) == n && out[0].size(2) > 0,
                  "greedy_steps: expected logits [1, ", n, ", vocab] from the decode step");
      const at::Tensor logits = out[0][0];
      int64_t* token = picked_rows + done * n;
      if (logits.scalar_type() == at::kFloat && logits.stride(1) == 1) {
        const float* rows = logits.data_ptr<float>();
        for (int64_t i = 0; i < n; ++i) token[i] = first_largest(rows + i * logits.stride(0), logits.size(1));
      } else {
        std::copy_n(at::argmax(logits, -1).data_ptr<int64_t>(), n, token);
      }
      bool stopped = false;
      for (int64_t i = 0; i < n; ++i) {
        next[i] = token[i];
        const int64_t* row = stops + i * num_stops;
        stopped = stopped || std::find(row, row + num_stops, token[i]) != row + num_stops;
      }
      ++done;
      if (stopped || std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() >= max_seconds) {
        break;
      }
    }
    return picked_all.narrow(0, 0, done);
  }

 private:
  torch::inductor::AOTIModelPackageLoader loader_;
};

}  // namespace autodeploy
