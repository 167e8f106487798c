// The native CPU kernels, written once over ATen's portable vector layer (at::vec::Vectorized, the layer
// torch's own CPU kernels use) and compiled once per CPU capability: -DCPU_CAPABILITY=AVX2 with
// -march=x86-64-v3, AVX512 with -march=x86-64-v4, DEFAULT on ARM64
// (NEON). Each build is its own shared library with hidden symbols (so no inline function compiled for one
// instruction set can stand in for another build's), exporting only its KernelTable (kernels.h); ops.cpp
// calls through the one chosen for this CPU.
//
// Decode reads every weight once per step, so these products must stream the weights at memory speed
// while doing the arithmetic of a few activation rows:
//   - products (float32, 16-bit, 4-bit weights): each thread takes tiles of kTile weight rows. Up to
//     kMaxPassRows activation rows (decode of a few sequences) it reads them one weight row after the other,
//     one sequential stream, prefetched kStreamAhead bytes ahead of the loads (see prefetch_stream);
//     for more, passes of up to kMaxPassRows activation rows keep kMaxPassRows x kTile vector accumulators
//     (the tile is read from memory once, from L1 by the later passes), and the tile kPrefetchTiles ahead is
//     prefetched meanwhile.
//     16-bit weights are widened to float32 in registers; the arithmetic is float32 throughout. 4-bit weights
//     are widened the same way for prompts of more than kInt4GemvMaxRows rows off x86; up to that many rows
//     (decode batches, short prompts) their products are exact integer sums per block of 32 weights with the
//     activations rounded to 8 bits per block (llama.cpp's Q4_0 x Q8_0), scaled and summed in float32, one
//     weight row after the other for passes of up to kMaxPassRows activation rows.
//   - prompts of int8 weights on x86 (more than kPairMinRows rows): integer products of pairs of 16-bit
//     activations over weights packed pair-major per tile (the pair products, below); of 4-bit weights, the
//     same blocks of 8-bit activations as their decode rows, as quads over weights packed quad-major (from 32
//     rows on AMX's int8 tiles where oneDNN runs AMX);
//   - float32 weights stored in panels of kPanel rows (f32_packed_gemm; packed on x86): one output per vector
//     lane, the activations broadcast, every row count; 16-bit weights in the same panels (half_packed_gemm;
//     packed on AVX2), widened in registers (for prompts of many passes, once per chunk into a float32 copy);
//   - 4-bit weights stored in tiles of kPackRows rows (x86, int4_packed_gemm): the same arithmetic with one weight
//     row per vector lane, every row count on AVX2, up to kInt4GemvMaxRows rows on AVX-512 (then the quads);
//   - int8 weights: the activations are rounded to 16 bits per row and the dot products are exact integer
//     sums (bitwise equal to int8_gemv_reference in quant_linear.py): int16 x int16 pair products into int32
//     lanes (vpmaddwd on x86, vmlal on ARM), widened to int64 before a lane can overflow; up to kIntStreamRows
//     activation rows one weight row after the other (at one row 11-58 % more bandwidth than tiles of
//     kIntTile rows, which more rows need for their arithmetic). (A VNNI variant,
//     the activations split into two unsigned bytes for vpdpbusd, ran 1.3x slower at one row and 1.9x at
//     16 on the AMD EPYC of docs/performance.md, so there is none.)
//   - decode attention: one new token per sequence over its paged KV cache, read in place, only up to each
//     sequence's length, a sequence's kv heads together where there are enough sequences for the threads.
// The products are summed in another order than torch's, so float32 results differ by rounding only.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace autodeploy {
inline namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// weight rows per tile and activation rows per pass: kMaxPassRows x kTile accumulators, kMaxPassRows
// activations and a weight in the vector registers
// (measured at 16 rows, one thread: 8 x 4, 12 x 2 and 16 x 2 on AVX-512, 4 x 3 and 8 x 2 on AVX2 are no faster)
#if defined(CPU_CAPABILITY_AVX2)
constexpr int kTile = 4, kMaxPassRows = 3;  // 16 registers: 12 accumulators
#else
constexpr int kTile = 6, kMaxPassRows = 4;  // 32 (AVX-512, NEON): 24 accumulators
#endif
// Up to this many rows f32_gemm beats the float32 GEMM f32_linear takes for more rows (oneDNN's on x86, see
// ops.cpp), measured on the AMD EPYC of docs/performance.md, 2 threads, the 125M Llama's products, alternating in
// one process: the two are even at 48-64 rows on AVX-512 and AVX2, and oneDNN is 1.1-1.6x faster at 128-2048.
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kF32MaxRows = 64;
#else
constexpr int64_t kF32MaxRows = 16;
#endif
// Up to this many rows the 16-bit, int8 and 4-bit products beat the float32 GEMM over blocks of their weights
// widened (ops.cpp) on the AMD EPYC of docs/performance.md, 2 threads, the 125M Llama's shapes. Against MKL: on
// AVX-512 at every row count measured (bf16 2.1x at 128 rows, 1.4x at 2048), on AVX2 up to about 256 rows for
// bf16. Against oneDNN, which the blocks now take on x86 (bf16, alternating in one process): 1.15x at 128 rows
// on AVX-512 and 0.93x on AVX2, 1.07x / 0.89x at 256, 0.59x / 0.97x at 2048; the 4-bit and int8 prompts run the
// faster pair products. NEON has not been timed on hardware: decode batches only there.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kGemmMaxRows = std::numeric_limits<int64_t>::max();
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kGemmMaxRows = 256;
#else
constexpr int64_t kGemmMaxRows = 16;
#endif
// how far ahead, in tiles of the same thread, to prefetch: the best of 1 / 2 / 4 / 8 when measured
constexpr int64_t kPrefetchTiles = 4;

inline void prefetch(const void* address) { __builtin_prefetch(address, /*rw=*/0, /*locality=*/2); }

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// v, opaque to the optimizer, so that an accumulator's chain of integer adds stays a chain: GCC otherwise
// reassociates the unrolled adds of a block into a tree whose partial sums do not fit the registers, and the
// AVX2 quad products spilled them to the stack (1.15-1.27x faster without, docs/performance.md, twentieth round)
template <typename V>
inline V keep_in_register(V v) {
  asm("" : "+v"(v));
  return v;
}
#endif

// Decode rows read each thread's weights as one sequential stream (row_by_row, int_row, int4_row), and the
// hardware prefetchers alone do not keep it at the memory's speed where the arithmetic is slower than the
// reads: Intel's L2 streamer runs a limited way ahead and stops at each 4 KB page, so every page's first lines
// are waited for while nothing is computed. So the streams also prefetch kStreamAhead bytes ahead, once per
// cache line, and a thread's first tile prefetches its first kStreamAhead bytes (prefetch_stream_start).
// Measured on the Intel Xeon (AMX, AVX-512) of docs/performance.md, the 125M Llama's 49 products at one row,
// 2 threads, alternating in one process, against no software prefetch: AVX-512 build int8 1.7-2.0x, int4 1.4-1.5x,
// bf16 1.25-1.3x, float32 1.15x; AVX2 build int4 2.1-2.4x, int8 1.6-1.8x, bf16 1.3x, float32 1.08x
// (distances of 4, 8, 16 and 32 KB; 32 KB best or even with the best for each).
constexpr int64_t kStreamAhead = 32 * 1024;
constexpr int64_t kLine = 64;

// Called at each step of kStepBytes bytes of a weight stream (`step` counts them, `at` is the step's address):
// prefetches kStreamAhead bytes ahead, once per cache line. Past the stream's end it prefetches what lies
// after it, which no load ever faults on.
template <int64_t kStepBytes>
inline void prefetch_stream(const void* at, int64_t step) {
  if constexpr (kStepBytes < kLine) {
    if (step % (kLine / kStepBytes) != 0) return;
  }
  prefetch(static_cast<const char*>(at) + kStreamAhead);
}

// Called at each step of kStepBytes bytes (whole cache lines) of a weight stream: prefetches its lines
// kStreamAhead bytes ahead, with no test. Where a loop's step covers whole lines, this and not prefetch_stream:
// the one-row panel pass (two steps of 16-bit panels a line) called prefetch_stream for each step, and GCC 12
// merged the two calls into one prefetch taken on odd steps only, which a pass from k = 0 never reaches. Its
// bfloat16 decode products streamed unprefetched: the 125M Llama's 49 at one row ran 1.67x faster with this,
// the AVX2 engine's bf16 decode step 1.72x (10.3 -> 6.0 ms, the Intel Xeon of docs/performance.md).
template <int64_t kStepBytes>
inline void prefetch_lines(const void* at) {
  static_assert(kStepBytes % kLine == 0, "whole cache lines");
  for (int64_t line = 0; line < kStepBytes; line += kLine)
    prefetch(static_cast<const char*>(at) + line + kStreamAhead);
}

// The first kStreamAhead bytes of a stream, which prefetch_stream's steps do not reach
inline void prefetch_stream_start(const void* begin) {
  for (int64_t offset = 0; offset < kStreamAhead; offset += kLine) prefetch(static_cast<const char*>(begin) + offset);
}

inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof value);
  return value;
}

// body(std::integral_constant<int, R>) for R = rows (1 <= rows <= MAX): a pass's row count as a template
// argument, so its accumulators stay in registers
template <int MAX, typename F>
inline void with_rows(int64_t rows, const F& body) {
  if constexpr (MAX > 1) {
    if (rows < MAX) return with_rows<MAX - 1>(rows, body);
  }
  body(std::integral_constant<int, MAX>{});
}

// 8-bit integer products with AVX512-VNNI: vpdpbusd adds the four products of each int32 lane's unsigned and
// signed bytes into the lane in one instruction, where vpmaddubsw and vpmaddwd take two (and the 16-bit sums of
// vpmaddubsw must stay below 2^15: they do for nibbles times 8-bit activations), with the same exact int32 sums.
// The AVX-512 build uses it where the CPU has it (decided once, at load) and AUTODEPLOY_NATIVE_VNNI is not 0,
// for the 4-bit products, which are bound by their arithmetic: the decode rows and the quad products of
// prompts. It is written as inline assembly so that the build's instruction set stays AVX-512 (x86-64-v4) for
// every other line. (With 16-bit activations, vpdpwssd in place of vpmaddwd and vpaddd measured 1.09-1.12x
// at one row and 1.32x at 128 on the Intel Xeon of docs/performance.md; int8's decode rows, bound by the
// memory, gained nothing at one row, 0.97x.)
#if defined(CPU_CAPABILITY_AVX512)
bool vnni_wanted() {
  const char* setting = std::getenv("AUTODEPLOY_NATIVE_VNNI");
  const bool off = setting != nullptr && (std::strcmp(setting, "0") == 0 || std::strcmp(setting, "false") == 0 ||
                                          std::strcmp(setting, "no") == 0 || std::strcmp(setting, "off") == 0);
  return !off && __builtin_cpu_supports("avx512vnni");
}
const bool kVnni = vnni_wanted();

// acc + the lanes' products of unsigned bytes u and signed bytes s, four to a lane, in int32
inline __m512i byte_products_onto(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
#endif

// Whether the VNNI passes run here (KernelTable::integer_vnni)
inline bool integer_vnni() {
#if defined(CPU_CAPABILITY_AVX512)
  return kVnni;
#else
  return false;
#endif
}

// body(std::true_type{}) where the VNNI passes run, else body(std::false_type{})
template <typename F>
inline void with_vnni(const F& body) {
#if defined(CPU_CAPABILITY_AVX512)
  if (kVnni) return body(std::true_type{});
#endif
  body(std::false_type{});
}

// ---- products with float32 arithmetic over weights stored as float32, 16-bit floats or 4-bit integers ----
// A weight source gives kLanes consecutive weights of a row, widened to float32, and an address to prefetch.

struct F32Weights {
  static constexpr int64_t kBytes = sizeof(float);  // per weight, as stored
  static constexpr int64_t kPerLine = kLine / kBytes;
  const float* w;
  int64_t K;
  Vec load(int64_t row, int64_t k) const { return Vec::loadu(w + row * K + k); }
  const void* address(int64_t row, int64_t k) const { return w + row * K + k; }
};

template <typename T>  // c10::BFloat16 or c10::Half
struct HalfWeights {
  static constexpr int64_t kBytes = sizeof(T);
  static constexpr int64_t kPerLine = kLine / kBytes;
  const T* w;
  int64_t K;
  Vec load(int64_t row, int64_t k) const {
    Vec out;
    at::vec::load_to_float<T>(w + row * K + k, out);
    return out;
  }
  const void* address(int64_t row, int64_t k) const { return w + row * K + k; }
};

// kLanes int8 values as floats
inline Vec int8_lanes(const int8_t* w) {
#if defined(CPU_CAPABILITY_AVX512)
  return Vec(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)))));
#elif defined(CPU_CAPABILITY_AVX2)
  return Vec(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)))));
#elif defined(__aarch64__)
  uint32_t four;
  std::memcpy(&four, w, sizeof four);
  return Vec(vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(four)))))));
#else
  float values[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) values[i] = static_cast<float>(w[i]);
  return Vec::loadu(values);
#endif
}

// int8 weights with bfloat16 per-row scales, dequantized: q * s rounded once, the values of the plain-torch
// weight.float() * scale.float()
struct Int8Weights {
  static constexpr int64_t kBytes = 1;
  static constexpr int64_t kPerLine = kLine / kBytes;
  const int8_t* w;
  const uint16_t* scale;
  int64_t K;
  Vec load(int64_t row, int64_t k) const { return int8_lanes(w + row * K + k) * Vec(bf16_to_float(scale[row])); }
  const void* address(int64_t row, int64_t k) const { return w + row * K + k; }
};

// More rows than one pass takes: K in chunks of kChunk, every pass over a chunk before the next one, so the
// tile's chunk and the rows' chunks are read from L1 by each pass (whole rows would not fit: a K = 2048 tile
// is 48 KB, a group's activation rows of K = 768 as much again). The accumulators of a group of up to
// kGroupRows rows wait in `partial` between chunks. A group is a whole number of full passes (AVX2's passes
// take 3 rows: groups of 16 rows ended in a pass of one, at half the multiply-add rate; with 18, the 125M
// Llama's 16-bit products at 128 rows ran 3-17 % faster, alternating in one process on the AMD EPYC of
// docs/performance.md).
constexpr int64_t kChunk = 512, kGroupRows = (16 + kMaxPassRows - 1) / kMaxPassRows * kMaxPassRows;

// Accumulates x[i, k0:k1] . w[n0 + j, k0:k1] into partial[i * kTile + j] (starting from zero at k0 = 0) for
// ROWS rows of x and the tile's rows, while prefetching rows [pf_begin, pf_end) of the tile at `ahead`.
template <int ROWS, typename W>
inline void chunk_pass(const float* x, const W& w, int64_t K, int64_t n0, int valid, int64_t k0, int64_t k1,
                       Vec* partial, int64_t ahead, int pf_begin, int pf_end) {
  Vec acc[ROWS][kTile];
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < kTile; ++j) acc[i][j] = k0 == 0 ? Vec(0.f) : partial[i * kTile + j];
  for (int64_t k = k0; k < k1; k += kLanes) {
    Vec xv[ROWS];
    for (int i = 0; i < ROWS; ++i) xv[i] = Vec::loadu(x + i * K + k);
    if (k % W::kPerLine == 0)  // once per cache line of the stored weights
      for (int j = pf_begin; j < pf_end; ++j) prefetch(w.address(ahead + j, k));
    for (int j = 0; j < kTile; ++j) {
      const Vec wv = w.load(n0 + (j < valid ? j : 0), k);
      for (int i = 0; i < ROWS; ++i) acc[i][j] = at::vec::fmadd(xv[i], wv, acc[i][j]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < kTile; ++j) partial[i * kTile + j] = acc[i][j];
}

// y[i, j] = x[i, :] . w[n0 + j, :] for ROWS rows of x and the tile's `valid` rows, one weight row after the
// other: the thread reads its weights as one sequential stream, which the prefetchers follow (at one row 5-30 %
// more bandwidth than interleaving the tile's rows, on the AMD EPYC of docs/performance.md; prefetch_stream). The
// sums are the tiled passes' (chunk_pass), in the same order, bit for bit.
template <int ROWS, typename W>
inline void row_by_row(const float* x, const W& w, int64_t K, int64_t n0, int valid, float* y, int64_t ldy) {
  for (int j = 0; j < valid; ++j) {
    Vec acc[ROWS];
    for (int i = 0; i < ROWS; ++i) acc[i] = Vec(0.f);
    for (int64_t k = 0; k < K; k += kLanes) {
      prefetch_stream<kLanes * W::kBytes>(w.address(n0 + j, k), k / kLanes);
      const Vec wv = w.load(n0 + j, k);
      for (int i = 0; i < ROWS; ++i) acc[i] = at::vec::fmadd(Vec::loadu(x + i * K + k), wv, acc[i]);
    }
    for (int i = 0; i < ROWS; ++i) y[i * ldy + j] = sum_lanes(acc[i]);
  }
}

// One tile over rows [0, M), more than one pass takes (see kChunk); chunk(k0, k1) gives the weight source
// the passes read for columns [k0, k1) of the tile.
template <typename ChunkSource>
inline void tile_in_chunks(const float* x, int64_t M, int64_t N, int64_t K, int64_t n0, int valid, float* y,
                           int64_t ahead, int ahead_rows, const ChunkSource& chunk) {
  Vec partial[kGroupRows * kTile];
  for (int64_t g0 = 0; g0 < M; g0 += kGroupRows) {
    const int64_t group_end = std::min(M, g0 + kGroupRows);
    const int64_t passes = (group_end - g0 + kMaxPassRows - 1) / kMaxPassRows;
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t k1 = std::min(K, k0 + kChunk);
      const auto w = chunk(k0, k1);
      int64_t m = g0;
      for (int64_t p = 0; p < passes; ++p) {
        // the first group prefetches the tile ahead, spread over its passes
        const int pf_begin = g0 == 0 ? static_cast<int>(ahead_rows * p / passes) : 0;
        const int pf_end = g0 == 0 ? static_cast<int>(ahead_rows * (p + 1) / passes) : 0;
        const int64_t rows = std::min<int64_t>(group_end - m, kMaxPassRows);
        with_rows<kMaxPassRows>(rows, [&](auto r) {
          chunk_pass<decltype(r)::value>(x + m * K, w, K, n0, valid, k0, k1, partial + (m - g0) * kTile, ahead,
                                         pf_begin, pf_end);
        });
        m += rows;
      }
    }
    for (int64_t i = 0; i < group_end - g0; ++i)
      for (int j = 0; j < valid; ++j) y[(g0 + i) * N + n0 + j] = sum_lanes(partial[i * kTile + j]);
  }
}

// A tile's rows widened to float32 for the passes to read (Widened, below); prefetches read the stored weights.
// For many rows (prompts) every group of kGroupRows rows passes over the tile, and would widen the weights
// again (16-bit ones in registers for each pass): there the whole tile is widened once, chunk-major (each
// chunk's kTile x kChunk floats contiguous), for 4-bit and int8 weights, and on AVX2 for 16-bit ones. Measured
// on the AMD EPYC of docs/performance.md (the 125M Llama's shapes, 2 threads, 128 rows, alternating in one
// process, with Widened's address form): 16-bit weights widened once per tile 1.19x faster than in registers
// on AVX2, 0.95x on AVX-512; so widened, the 4-bit and int8 prompt products run as fast as the float32 one
// (0.99-1.08x) on both.
#if defined(CPU_CAPABILITY_AVX2)
constexpr bool kWidenHalfTiles = true;
#else
constexpr bool kWidenHalfTiles = false;
#endif
template <typename W>
constexpr bool widens_tiles() {
  if constexpr (std::is_same_v<W, F32Weights>) return false;
  else if constexpr (std::is_same_v<W, Int8Weights>) return true;
  else return kWidenHalfTiles;
}
// The chunk of rows [n0, n0 + kTile) that starts at column k0, widened into kChunk floats per row (`chunk`).
// load(row, k) reads origin + row * kChunk + k, the address form of F32Weights: with the offsets row - n0 and
// k - k0 in each load, the passes over a widened tile ran 15 % slower than over float32 weights in memory (the
// 125M Llama's products at 128 rows, AVX-512, alternating in one process), and as fast with this form. origin is
// the address of row 0, column 0 of such a layout: outside the scratch, so kept as an integer.
template <typename Source>
struct Widened {
  static constexpr int64_t kPerLine = Source::kPerLine;  // of the stored weights, which address() gives
  uintptr_t origin;
  Source source;
  Widened(const float* chunk, int64_t n0, int64_t k0, Source stored)
      : origin(reinterpret_cast<uintptr_t>(chunk) - static_cast<uintptr_t>(n0 * kChunk + k0) * sizeof(float)),
        source(stored) {}
  Vec load(int64_t row, int64_t k) const {
    return Vec::loadu(reinterpret_cast<const float*>(origin) + row * kChunk + k);
  }
  const void* address(int64_t row, int64_t k) const { return source.address(row, k); }
};
// Scratch memory aligned to the cache line: a vector load from memory only 16-byte aligned (what new[] gives)
// straddles two cache lines, every time for AVX-512's 64-byte vectors, half the time for AVX2's. Taken from
// malloc a line larger and aligned here, the address malloc gave stored just below: a decode step allocates a
// few small scratches per product, which malloc's per-thread cache serves, where aligned_alloc took glibc's
// slower general path every time (the int4 engine's decode step 1.015x, AVX2, docs/performance.md).
struct FreeScratch {
  void operator()(void* p) const {
    if (p) std::free(static_cast<void**>(p)[-1]);
  }
};
template <typename T>
using Scratch = std::unique_ptr<T[], FreeScratch>;
template <typename T>
Scratch<T> scratch(int64_t count) {  // null without memory (or for none)
  const size_t bytes = (static_cast<size_t>(count) * sizeof(T) + kLine - 1) / kLine * kLine;  // whole lines
  if (bytes == 0) return nullptr;
  void* block = std::malloc(bytes + kLine);  // malloc aligns to at least 8: room below for its address
  if (!block) return nullptr;
  const uintptr_t aligned = (reinterpret_cast<uintptr_t>(block) + kLine) & ~static_cast<uintptr_t>(kLine - 1);
  reinterpret_cast<void**>(aligned)[-1] = block;
  return Scratch<T>(reinterpret_cast<T*>(aligned));
}

// Parallel over tiles [0, tiles) in contiguous chunks (each thread's tiles are consecutive, so the tile it
// prefetches ahead is its own; at::parallel_for shares torch's threads), each thread with a scratch of
// `floats` floats: tile(t, scratch) for each of its tiles (scratch null for none), or tile(t, scratch, first)
// where first says t is the thread's first tile. Returns -1 if a scratch could not be allocated, else 0.
template <typename F>
inline int parallel_tiles(int64_t tiles, int64_t floats, const F& tile) {
  std::atomic<int> status{0};
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    const Scratch<float> memory = scratch<float>(floats);
    if (floats > 0 && !memory) {
      status = -1;
      return;
    }
    for (int64_t t = begin; t < end; ++t) {
      if constexpr (std::is_invocable_v<const F&, int64_t, float*, bool>) tile(t, memory.get(), t == begin);
      else tile(t, memory.get());
    }
  });
  return status;
}

// The chunk of a tile widened chunk-major into `widened` (each chunk's kTile x kChunk floats contiguous, as
// the passes read them) that starts at column k0
inline float* chunk_at(float* widened, int64_t k0) { return widened + k0 * kTile; }

template <typename W>
int gemm(const float* x, const W& w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0) return 0;
  const bool widen = widens_tiles<W>() && M > kGroupRows;
  const int64_t tiles = (N + kTile - 1) / kTile;
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  return parallel_tiles(tiles, widen ? chunks * kTile * kChunk : 0, [&](int64_t t, float* widened, bool first) {
    const int64_t n0 = t * kTile;
    const int valid = static_cast<int>(std::min<int64_t>(kTile, N - n0));
    const int64_t ahead = n0 + kPrefetchTiles * kTile;
    const int ahead_rows = ahead >= N ? 0 : static_cast<int>(std::min<int64_t>(kTile, N - ahead));
    if (M <= kMaxPassRows) {  // few rows: one weight row after the other (row_by_row)
      if (first) prefetch_stream_start(w.address(n0, 0));
      with_rows<kMaxPassRows>(M, [&](auto r) { row_by_row<decltype(r)::value>(x, w, K, n0, valid, y + n0, N); });
    } else if (widen) {
      for (int64_t k0 = 0; k0 < K; k0 += kChunk)
        for (int j = 0; j < valid; ++j)
          for (int64_t k = k0; k < std::min(K, k0 + kChunk); k += kLanes)
            w.load(n0 + j, k).store(chunk_at(widened, k0) + j * kChunk + (k - k0));
      tile_in_chunks(x, M, N, K, n0, valid, y, ahead, ahead_rows, [&](int64_t k0, int64_t) {
        return Widened<W>(chunk_at(widened, k0), n0, k0, w);
      });
    } else {
      tile_in_chunks(x, M, N, K, n0, valid, y, ahead, ahead_rows, [&](int64_t, int64_t) { return w; });
    }
  });
}

void f32_gemm(const float* x, const float* w, float* y, int64_t M, int64_t N, int64_t K) {
  gemm(x, F32Weights{w, K}, y, M, N, K);  // no scratch: cannot fail
}

int int8_gemm(const float* x, const int8_t* w, const uint16_t* scale, float* y, int64_t M, int64_t N, int64_t K) {
  return gemm(x, Int8Weights{w, scale, K}, y, M, N, K);
}

int half_gemm(const float* x, const uint16_t* w, bool bf16, float* y, int64_t M, int64_t N, int64_t K) {
  if (bf16) return gemm(x, HalfWeights<c10::BFloat16>{reinterpret_cast<const c10::BFloat16*>(w), K}, y, M, N, K);
  return gemm(x, HalfWeights<c10::Half>{reinterpret_cast<const c10::Half*>(w), K}, y, M, N, K);
}

// ---- float32 weights packed in panels of kPanel rows (KernelTable::f32_packed_gemm): one lane per weight row ----
// f32_gemm reads the weight [N, K] by rows, so each output is a dot product: a pass of R activation rows over a
// tile of T weight rows holds R x T vectors of partial sums, reads all R x K activations again for every tile,
// and sums each vector's lanes at the end. Packed (pack_f32_panels in linear.py), a panel's kPanel rows lie
// k-major: weight k of each of the rows side by side, kPanel floats. A pass then keeps, for each activation row,
// the panel's kPanel outputs themselves in kPanel / kLanes vectors, adding one broadcast activation times the
// panel's k-th vector per step: the activations are scalars read once per panel, and nothing is left to sum.
// Each output is summed over k in order, from k = 0, so a row's result does not depend on the rows beside it
// nor on the pass or chunk that computes it: a decode row and the same row in a prompt agree bit for bit.
// Measured on the AMD EPYC (Zen 5) of docs/performance.md, one thread, 16 rows over 72 MB of weights: 258
// GFLOP/s against f32_gemm's tiles' 114 ("Issue 18, twenty-third round").

constexpr int64_t kPanel = 16;                       // weight rows per panel: one layout for every build
constexpr int kPanelVectors = kPanel / kLanes;       // 1 (AVX-512), 2 (AVX2), 4 (NEON)
// activation rows per pass: ROWS x kPanelVectors accumulators, the panel's vectors and a broadcast in registers
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kPanelPassRows = 16, kPairPassRows = 12;  // 16 and 24 accumulators of 32 registers
#else
// no passes over two panels: on AVX2 they need 17 registers with 3 rows, and ran slower than single panels with 2
// (the 125M Llama's products, 0.81x at 16 rows and 0.47x at 128 against 1.09x and 0.59x; AMD EPYC, "twenty-third
// round"); NEON's 32 registers would hold 2 rows, untimed
constexpr int kPanelPassRows = 6, kPairPassRows = 0;    // AVX2: 12 accumulators of 16; NEON: 24 of 32
#endif
// K per chunk of more than one pass: a panel's chunk (16 KB) stays in L1 for the passes after the first
constexpr int64_t kPanelChunk = 256;
// rows per group: the panels of a group's rows are read once per group, its activations (up to 1.5 MB at K =
// 2048) stay in L2 while the thread's panels stream past
constexpr int64_t kPanelGroupRows = 512;

// 16-bit panels are widened once per chunk from this many passes on: the AVX2 build's bfloat16 products of the
// 125M Llama ran 1.04-1.18x faster at 64-2048 rows, even at 32 (6 passes); at 7-19 rows (2-4 passes) 0.73-0.95x,
// where the widening, done before the passes, no longer overlaps the memory's reads with the arithmetic (AMD EPYC
// Zen 4, "twenty-seventh round")
constexpr int64_t kWidenMinPasses = 6;
static_assert(kPanel % kLanes == 0, "a panel is whole vectors");
// KernelTable::f32_pack_width: the x86 builds. On AVX2 (16 registers: passes of 6 rows) the 125M Llama's products
// ran at 0.94-1.18x f32_linear's at 1-64 rows and 1.0-1.08x its oneDNN GEMM at 128-2048, and the engine's
// batch-16 decode 1.07-1.17x faster (AMD EPYC, "twenty-fourth round"). NEON's are untimed on hardware, so
// pack_f32_weights leaves their weights by rows
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr int kF32PackWidth = kPanel;
#else
constexpr int kF32PackWidth = 0;
#endif
// KernelTable::half_pack_width: the AVX2 build. Its 16-bit panels ran the 125M Llama's bfloat16 products 1.03-1.4x
// faster than half_linear's kernel at one row (bound by the memory in its slow spells), 1.1-1.9x at 2-16 rows,
// 1.13x at 64 and 1.04-1.08x at 512 (oneDNN over widened blocks); on AVX-512 0.85-0.99x at 1-2 rows (1.3-1.4x at
// 16 and more), so that build keeps them by rows (AMD EPYC, "twenty-fourth round"); NEON untimed
#if defined(CPU_CAPABILITY_AVX2)
constexpr int kHalfPackWidth = kPanel;
#else
constexpr int kHalfPackWidth = 0;
#endif

// out[i * ld + c] (+)= x[i, k0:k1] . panel[k0:k1, c] for ROWS rows and the panel's kPanel columns, the rows'
// activations transposed (xt[k * ROWS + i]: one address register for all rows): from zero where k0 is 0, else
// from what out holds. `stream` prefetches the panel ahead (the first pass over it).
// The accumulators of a pass as the build's raw vector type: as an array of Vec, GCC kept 16 rows of them in
// memory (an add from memory and a store per multiply-add, 2.3x slower)
#if defined(CPU_CAPABILITY_AVX512)
using PanelAcc = __m512;
#elif defined(CPU_CAPABILITY_AVX2)
using PanelAcc = __m256;
#else
using PanelAcc = Vec;
#endif

// kLanes of a panel's k-th row as floats: float32 panels as they are, 16-bit ones widened (exactly)
template <typename T>
inline Vec panel_lanes(const T* at) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(at);
  } else {
    Vec out;
    at::vec::load_to_float<T>(at, out);
    return out;
  }
}

// One row over one panel: two chains of multiply-adds (even and odd k) for each of the panel's vectors, so that
// the adds' latency does not bound the pass (5 % faster at one row of the 125M Llama's float32 products on
// AVX-512; on AVX2, whose panel is two vectors, 1.04x float32 and 1.4x bfloat16 against one chain, "twenty-fourth
// round")
template <typename T>
inline void one_row_panel_pass(const float* xt, const T* panel, int64_t k0, int64_t k1, float* out, bool stream) {
  PanelAcc acc[kPanelVectors], odd[kPanelVectors];
#pragma GCC unroll 4
  for (int v = 0; v < kPanelVectors; ++v) {
    acc[v] = k0 == 0 ? Vec(0.f) : Vec::loadu(out + v * kLanes);
    odd[v] = Vec(0.f);
  }
  int64_t k = k0;
  for (; k + 1 < k1; k += 2) {
    const T* at = panel + k * kPanel;
    if (stream) prefetch_lines<2 * kPanel * sizeof(T)>(at);
#pragma GCC unroll 4
    for (int v = 0; v < kPanelVectors; ++v) {
      acc[v] = at::vec::fmadd(Vec(xt[k]), panel_lanes(at + v * kLanes), Vec(acc[v]));
      odd[v] = at::vec::fmadd(Vec(xt[k + 1]), panel_lanes(at + kPanel + v * kLanes), Vec(odd[v]));
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < kPanelVectors; ++v) {
    if (k < k1) acc[v] = at::vec::fmadd(Vec(xt[k]), panel_lanes(panel + k * kPanel + v * kLanes), Vec(acc[v]));
    (Vec(acc[v]) + Vec(odd[v])).store(out + v * kLanes);
  }
}

// The float32 one-row pass, a function of its own: inlined into packed_gemm's tile loop it streamed its weights
// 1.13x slower on AVX2 (the engine's float32 decode step 15.2 -> 13.3 ms as a call; the Intel Xeon of
// docs/performance.md, "thirty-eighth round"). The 16-bit passes stay inlined: as calls the AVX2 engine's bf16
// decode step ran 0.90x. The loops inlined and out of line differ by one spilled bound or counter (a load or a
// store on the stack an iteration); why that moves a stream bound by the memory 10-15 %, either way, is not found.
// The AVX-512 build reads the panel in 256-bit halves, as AVX2 does (the same sums: a lane is a column): its
// 512-bit loads streamed 1.07-1.10x slower (the engine's float32 decode step 15.4 -> 13.6 ms with both changes).
__attribute__((noinline)) void one_row_float_panel_pass(const float* xt, const float* panel, int64_t k0, int64_t k1,
                                                        float* out, bool stream) {
#if defined(CPU_CAPABILITY_AVX512)
  static_assert(kPanel == 16, "two 256-bit halves");
  __m256 acc[2], odd[2];
  for (int v = 0; v < 2; ++v) {
    acc[v] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + v * 8);
    odd[v] = _mm256_setzero_ps();
  }
  int64_t k = k0;
  for (; k + 1 < k1; k += 2) {
    const float* at = panel + k * kPanel;
    if (stream) prefetch_lines<2 * kPanel * sizeof(float)>(at);
    for (int v = 0; v < 2; ++v) {
      acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(xt[k]), _mm256_loadu_ps(at + v * 8), acc[v]);
      odd[v] = _mm256_fmadd_ps(_mm256_set1_ps(xt[k + 1]), _mm256_loadu_ps(at + kPanel + v * 8), odd[v]);
    }
  }
  for (int v = 0; v < 2; ++v) {
    if (k < k1) acc[v] = _mm256_fmadd_ps(_mm256_set1_ps(xt[k]), _mm256_loadu_ps(panel + k * kPanel + v * 8), acc[v]);
    _mm256_storeu_ps(out + v * 8, _mm256_add_ps(acc[v], odd[v]));
  }
#else
  one_row_panel_pass(xt, panel, k0, k1, out, stream);
#endif
}

template <int ROWS, int PANELS, typename T>
inline void panel_pass(const float* xt, const T* panel, int64_t K, int64_t k0, int64_t k1, float* const* out,
                       const int64_t* ld, bool stream) {
  if constexpr (ROWS == 1 && PANELS == 1) {
    if constexpr (std::is_same_v<T, float>) one_row_float_panel_pass(xt, panel, k0, k1, out[0], stream);
    else one_row_panel_pass(xt, panel, k0, k1, out[0], stream);
    return;
  }
  constexpr int kVectors = PANELS * kPanelVectors;
  PanelAcc acc[ROWS][kVectors];
#pragma GCC unroll 16
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v) {
      const int p = v / kPanelVectors;
      acc[i][v] = k0 == 0 ? Vec(0.f) : Vec::loadu(out[p] + i * ld[p] + v % kPanelVectors * kLanes);
    }
  for (int64_t k = k0; k < k1; ++k) {
    const T* at = panel + k * kPanel;
    if (stream)
#pragma GCC unroll 2
      for (int p = 0; p < PANELS; ++p) prefetch_stream<kPanel * sizeof(T)>(at + p * K * kPanel, k);
    Vec w[kVectors];
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v)
      w[v] = panel_lanes(at + v / kPanelVectors * K * kPanel + v % kPanelVectors * kLanes);
    const float* xk = xt + k * ROWS;
#pragma GCC unroll 16
    for (int i = 0; i < ROWS; ++i) {
      const Vec xi(xk[i]);
#pragma GCC unroll 8
      for (int v = 0; v < kVectors; ++v) acc[i][v] = at::vec::fmadd(xi, w[v], Vec(acc[i][v]));
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < ROWS; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < kVectors; ++v) {
      const int p = v / kPanelVectors;
      Vec(acc[i][v]).store(out[p] + i * ld[p] + v % kPanelVectors * kLanes);
    }
}

template <typename T>
int packed_gemm(const float* x, const T* panels, float* y, int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0) return 0;
  const int64_t count = (N + kPanel - 1) / kPanel;
  // more rows than one pass takes: passes over two panels at a time (one broadcast feeds both)
  const bool paired = kPairPassRows > 0 && M > kPanelPassRows;
  const int64_t pass_rows = paired ? kPairPassRows : kPanelPassRows, panels_per_tile = paired ? 2 : 1;
  // a group's rows transposed per pass: xt[pass] is [K][rows of the pass] (no padding: one row's activations
  // k-major, as a decode row's are, take K floats, not 16 K)
  const Scratch<float> xt = scratch<float>(std::min(M, kPanelGroupRows) * K);
  if (!xt) return -1;
  for (int64_t g0 = 0; g0 < M; g0 += kPanelGroupRows) {
    const int64_t rows = std::min(M - g0, kPanelGroupRows);
    at::parallel_for(0, (rows + pass_rows - 1) / pass_rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {  // written in order, the pass's rows read side by side
        const int64_t in_pass = std::min(pass_rows, rows - p * pass_rows);
        const float* from = x + (g0 + p * pass_rows) * K;
        float* to = xt.get() + p * pass_rows * K;
        for (int64_t k = 0; k < K; ++k)
          for (int64_t i = 0; i < in_pass; ++i) to[k * in_pass + i] = from[i * K + k];
      }
    });
    const int64_t step = rows > pass_rows ? kPanelChunk : K;  // one pass reads its panels once: no chunks
    // 16-bit panels read by many passes: each chunk is widened to float32 once, into the thread's copy of the
    // panel, and the passes read that (widened in each pass, the conversions share the ports of the
    // multiply-adds)
    const bool widen = !std::is_same_v<T, float> && !paired && rows > (kWidenMinPasses - 1) * pass_rows;
    const int64_t wide_floats = widen ? K * kPanel : 0;
    const int status = parallel_tiles((count + panels_per_tile - 1) / panels_per_tile, wide_floats,
                                      [&](int64_t t, float* wide, bool first) {
      const int64_t p0 = t * panels_per_tile, here = std::min(panels_per_tile, count - p0);
      const T* panel = panels + p0 * K * kPanel;
      if (first) prefetch_stream_start(panel);
      // the last panel of an N that is no multiple of kPanel sums into a tile of its own
      alignas(64) float edge[kPanelGroupRows * kPanel];
      float* out[2];
      int64_t ld[2];
      for (int64_t j = 0; j < here; ++j) {
        const bool whole = (p0 + j + 1) * kPanel <= N;
        out[j] = whole ? y + g0 * N + (p0 + j) * kPanel : edge;
        ld[j] = whole ? N : kPanel;
      }
      for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t k1 = std::min(K, k0 + step);
        if (widen) {
          for (int64_t k = k0; k < k1; ++k) {
            prefetch_stream<kPanel * sizeof(T)>(panel + k * kPanel, k);
#pragma GCC unroll 4
            for (int v = 0; v < kPanelVectors; ++v)
              panel_lanes(panel + k * kPanel + v * kLanes).store(wide + k * kPanel + v * kLanes);
          }
          for (int64_t m = 0; m < rows; m += pass_rows) {
            float* pass_out[2] = {out[0] + m * ld[0], nullptr};
            with_rows<kPanelPassRows>(std::min(pass_rows, rows - m), [&](auto r) {
              panel_pass<decltype(r)::value, 1, float>(xt.get() + m * K, wide, K, k0, k1, pass_out, ld, false);
            });
          }
          continue;
        }
        for (int64_t m = 0; m < rows; m += pass_rows) {
          float* pass_out[2] = {out[0] + m * ld[0], here > 1 ? out[1] + m * ld[1] : nullptr};
          const float* pass_x = xt.get() + m * K;
          if constexpr (kPairPassRows > 0) {
            if (here == 2) {
              with_rows<kPairPassRows>(std::min(pass_rows, rows - m), [&](auto r) {
                panel_pass<decltype(r)::value, 2, T>(pass_x, panel, K, k0, k1, pass_out, ld, m == 0);
              });
              continue;
            }
          }
          with_rows<kPanelPassRows>(std::min(pass_rows, rows - m), [&](auto r) {
            panel_pass<decltype(r)::value, 1, T>(pass_x, panel, K, k0, k1, pass_out, ld, m == 0);
          });
        }
      }
      const int64_t n_last = (p0 + here - 1) * kPanel;
      if (n_last + kPanel > N)
        for (int64_t i = 0; i < rows; ++i)
          std::memcpy(y + (g0 + i) * N + n_last, edge + i * kPanel, (N - n_last) * sizeof(float));
    });
    if (status != 0) return status;
  }
  return 0;
}

// KernelTable::f32_packed_gemm
int f32_packed_gemm(const float* x, const float* panels, float* y, int64_t M, int64_t N, int64_t K) {
  return packed_gemm(x, panels, y, M, N, K);
}

// KernelTable::half_packed_gemm
int half_packed_gemm(const float* x, const uint16_t* panels, bool bf16, float* y, int64_t M, int64_t N, int64_t K) {
  if (bf16) return packed_gemm(x, reinterpret_cast<const c10::BFloat16*>(panels), y, M, N, K);
  return packed_gemm(x, reinterpret_cast<const c10::Half*>(panels), y, M, N, K);
}

// ---- 4-bit weights ----
// Up to kInt4GemvMaxRows rows take exact integer products of 8-bit activation blocks (int4_gemv, below), and on
// x86 so do more rows (int4_quad_gemm). More rows elsewhere take float32 arithmetic over the dequantized weights
// (int4_widened_gemm): read kLanes bytes (2 * kLanes weights) at a time, the low nibbles the even elements and the
// high ones the odd, so the activations are reordered to match: in each block of 2 * kLanes, first the even
// elements, then the odd. The group scales of
// a tile are widened once per tile, and the tile (Int4Group) a chunk at a time into L1, read by the float32
// passes (for prompts, the whole tile once).

constexpr int64_t kInt4GemvMaxRows = 16;

// kLanes bytes -> their low (or high) nibbles as floats
inline Vec nibbles(const uint8_t* bytes, bool high) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  return Vec(_mm512_cvtepi32_ps(high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  return Vec(_mm256_cvtepi32_ps(high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15))));
#elif defined(__aarch64__)
  uint32_t four;
  std::memcpy(&four, bytes, sizeof four);
  const uint32x4_t v = vmovl_u16(vget_low_u16(vmovl_u8(vcreate_u8(four))));
  return Vec(vcvtq_f32_u32(high ? vshrq_n_u32(v, 4) : vandq_u32(v, vdupq_n_u32(15))));
#else
  float values[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) values[i] = static_cast<float>(high ? bytes[i] >> 4 : bytes[i] & 15);
  return Vec::loadu(values);
#endif
}

// One row's group of 4-bit values as floats: s * (nibble - 8), bitwise the same on every path (the product
// of s and an exact small integer, rounded once)
struct Int4Group {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 table;  // s * (i - 8) for i = 0..15: a nibble's value is one permute away
  Int4Group() = default;
  explicit Int4Group(float s)
      : table(_mm512_mul_ps(_mm512_set1_ps(s), _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7))) {}
  Vec operator()(const uint8_t* bytes, bool high) const {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    // the permute reads the low 4 bits of each index: the low nibble needs no mask
    return Vec(_mm512_permutexvar_ps(high ? _mm512_srli_epi32(v, 4) : v, table));
  }
#else
  Vec s, offset;  // s and -8 s: q * s - 8 s is s * (q - 8) rounded once (8 s is exact)
  Int4Group() = default;
  explicit Int4Group(float scale) : s(scale), offset(-8.f * scale) {}
  Vec operator()(const uint8_t* bytes, bool high) const { return at::vec::fmadd(nibbles(bytes, high), s, offset); }
#endif
};

// Where a tile's 4-bit rows lie, for the prefetches of passes that read them widened
struct Int4Rows {
  static constexpr int64_t kPerLine = 2 * kLine;  // weights per cache line
  const uint8_t* qw;
  int64_t row_bytes;
  const void* address(int64_t row, int64_t k) const { return qw + row * row_bytes + k / 2; }
};

// columns [k0, k1) of a tile's `valid` 4-bit rows (from `tile`, scales [kTile][groups] floats) widened to
// float32 in the reordered order into out (row stride `stride`)
inline void widen_int4_tile(const uint8_t* tile, const float* scales, int64_t groups, int64_t group,
                            int64_t row_bytes, int valid, int64_t k0, int64_t k1, float* out, int64_t stride) {
  for (int j = 0; j < valid; ++j)
    for (int64_t k = k0; k < k1; k += 2 * kLanes) {
      const Int4Group values(scales[j * groups + k / group]);
      const uint8_t* bytes = tile + j * row_bytes + k / 2;
      values(bytes, false).store(out + j * stride + (k - k0));
      values(bytes, true).store(out + j * stride + (k - k0) + kLanes);
    }
}

// int4_gemm with float32 arithmetic over the dequantized weights (every row count; int4_gemm, below, sends
// decode rows to the integer products)
int int4_widened_gemm(const float* x, const uint8_t* qw, const uint16_t* scale, int64_t group, float* y,
                      int64_t M, int64_t N, int64_t K) {
  // the activations in the weights' order: per block of 2 * kLanes, the even elements, then the odd
  const Scratch<float> reordered = scratch<float>(M * K);
  if (!reordered) return -1;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t block = 0; block < K; block += 2 * kLanes)
      for (int64_t i = 0; i < kLanes; ++i) {
        reordered[m * K + block + i] = x[m * K + block + 2 * i];
        reordered[m * K + block + kLanes + i] = x[m * K + block + 2 * i + 1];
      }
  const int64_t groups = K / group, row_bytes = K / 2;
  const int64_t tiles = (N + kTile - 1) / kTile;
  // each weight is dequantized once: a chunk of the tile at a time into L1, read by the float32 passes of the
  // rows' one group; for more groups of rows (prompts) the whole tile
  const bool whole_tile = M > kGroupRows;
  const Int4Rows rows{qw, row_bytes};
  const int64_t chunks = (K + kChunk - 1) / kChunk;
  return parallel_tiles(tiles, kTile * (groups + (whole_tile ? chunks * kChunk : 0)), [&](int64_t t, float* scratch) {
    const int64_t n0 = t * kTile;
    const int valid = static_cast<int>(std::min<int64_t>(kTile, N - n0));
    float* scales = scratch;
    at::vec::convert(reinterpret_cast<const c10::BFloat16*>(scale) + n0 * groups, scales, valid * groups);
    const int64_t ahead = n0 + kPrefetchTiles * kTile;
    const int ahead_rows = ahead >= N ? 0 : static_cast<int>(std::min<int64_t>(kTile, N - ahead));
    const uint8_t* tile = qw + n0 * row_bytes;
    if (whole_tile) {
      float* widened = scratch + kTile * groups;
      for (int64_t k0 = 0; k0 < K; k0 += kChunk)
        widen_int4_tile(tile, scales, groups, group, row_bytes, valid, k0, std::min(K, k0 + kChunk),
                        chunk_at(widened, k0), kChunk);
      tile_in_chunks(reordered.get(), M, N, K, n0, valid, y, ahead, ahead_rows, [&](int64_t k0, int64_t) {
        return Widened<Int4Rows>(chunk_at(widened, k0), n0, k0, rows);
      });
    } else {
      alignas(64) float widened[kTile * kChunk];
      tile_in_chunks(reordered.get(), M, N, K, n0, valid, y, ahead, ahead_rows, [&](int64_t k0, int64_t k1) {
        widen_int4_tile(tile, scales, groups, group, row_bytes, valid, k0, k1, widened, kChunk);
        return Widened<Int4Rows>(widened, n0, k0, rows);
      });
    }
  });
}

void int4_widen(const uint8_t* qw, const uint16_t* scale, int64_t group, int64_t K, int64_t rows, float* out) {
  const int64_t groups = K / group, row_bytes = K / 2;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; k += 2 * kLanes) {
        const uint8_t* bytes = qw + n * row_bytes + k / 2;
        const Int4Group values(bf16_to_float(scale[n * groups + k / group]));
        // the low nibbles are the even elements, the high ones the odd: interleaved back into row order
        const auto [first, second] = at::vec::interleave2<float>(values(bytes, false), values(bytes, true));
        first.store(out + n * K + k);
        second.store(out + n * K + k + kLanes);
      }
  });
}

// ---- int8 weights: exact integer dot products of 16-bit activations ----

constexpr int kLevels = 32767;

// The kLanes floats of v, integers within T's range (int16_t or int8_t), stored as T: converted and narrowed in
// vectors on x86 (stored lane by lane, a scalar conversion each, they took 2-3 % of an int8 or 4-bit prompt)
template <typename T>
inline void store_integers(const Vec& v, T* out) {
  static_assert(std::is_same_v<T, int16_t> || std::is_same_v<T, int8_t>, "16- or 8-bit integers");
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i whole = _mm512_cvtps_epi32(v);  // exact: v holds integers
  if constexpr (std::is_same_v<T, int16_t>)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtsepi32_epi16(whole));
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(whole));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i whole = _mm256_cvtps_epi32(v);
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(whole), _mm256_extracti128_si256(whole, 1));
  if constexpr (std::is_same_v<T, int16_t>)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), words);
  else
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packs_epi16(words, words));
#else
  float lanes[kLanes];
  v.store(lanes);
  for (int64_t i = 0; i < kLanes; ++i) out[i] = static_cast<T>(lanes[i]);
#endif
}

// One row to q = round(x / sx) (half to even), sx = max|x| / 32767 (1 for an all-zero row); returns sx.
float quantize_row16(const float* x, int64_t K, int16_t* q) {
  const float amax = at::vec::map_reduce_all<float>([](Vec v) { return v.abs(); },
                                                    [](Vec a, Vec b) { return at::vec::maximum(a, b); }, x, K);
  const float sx = amax > 0.f ? amax / static_cast<float>(kLevels) : 1.f;
  const Vec inverse(1.f / sx), low(-kLevels), high(kLevels);
  for (int64_t k = 0; k < K; k += kLanes)
    store_integers(at::vec::clamp(Vec(Vec::loadu(x + k) * inverse).round(), low, high), q + k);
  return sx;
}

// ---- 8-bit activation blocks (the 4-bit products' activations) ----
constexpr int64_t kQ8Block = 32;  // activations per scale; the 4-bit weights' group sizes are multiples of it
constexpr int kQ8Levels = 127;

// One row, a whole number of blocks of kQ8Block, to q = round(x / sa) per block (half to even), sa = max|x| / 127
// of the block (1 for an all-zero block), written to sa[K / kQ8Block]; q in the order of x, as T
// (int8_t, or int16_t where the products take 16-bit lanes); with `sums`, each block's sum of q there.
// round_blocks8 in int4_linear.py, bit for bit.
template <typename T>
void quantize_blocks8(const float* x, int64_t K, T* q, float* sa, int32_t* sums = nullptr) {
  static_assert(kQ8Block % kLanes == 0, "a block is whole vectors");
  const Vec low(-kQ8Levels), high(kQ8Levels);
  for (int64_t b = 0; b < K / kQ8Block; ++b) {
    const float* block = x + b * kQ8Block;
    Vec top = Vec::loadu(block).abs();
    for (int64_t i = kLanes; i < kQ8Block; i += kLanes) top = at::vec::maximum(top, Vec::loadu(block + i).abs());
    const float amax = at::vec::vec_reduce_all<float>([](Vec& a, Vec& c) { return at::vec::maximum(a, c); }, top);
    sa[b] = amax > 0.f ? amax / static_cast<float>(kQ8Levels) : 1.f;
    const Vec inverse(1.f / sa[b]);
    Vec total(0.f);  // integers of at most 32 x 127: exact in float32
    for (int64_t i = 0; i < kQ8Block; i += kLanes) {
      const Vec rounded = at::vec::clamp(Vec(Vec::loadu(block + i) * inverse).round(), low, high);
      store_integers(rounded, q + b * kQ8Block + i);
      total = total + rounded;
    }
    if (sums) sums[b] = static_cast<int32_t>(sum_lanes(total));
  }
}

// int16 x int8 products summed in int32 lanes, kStep weights per step; kFlushSteps steps at most before a
// lane could overflow (each step adds at most 2 * 32767 * 128 per lane), so sums are widened to int64 then.
#if defined(CPU_CAPABILITY_AVX512)
struct IntDot {
  using Acc = __m512i;
  static constexpr int64_t kStep = 32;
  static Acc zero() { return _mm512_setzero_si512(); }
  static Acc weights(const int8_t* w) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)w)); }
  static Acc activations(const int16_t* q) { return _mm512_loadu_si512(q); }
  static Acc madd(Acc acc, Acc q, Acc w) { return _mm512_add_epi32(acc, _mm512_madd_epi16(q, w)); }
  static int64_t sum(Acc acc) {
    const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc));
    const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1));
    return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
  }
};
#elif defined(CPU_CAPABILITY_AVX2)
struct IntDot {
  using Acc = __m256i;
  static constexpr int64_t kStep = 16;
  static Acc zero() { return _mm256_setzero_si256(); }
  static Acc weights(const int8_t* w) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w)); }
  static Acc activations(const int16_t* q) { return _mm256_loadu_si256((const __m256i*)q); }
  static Acc madd(Acc acc, Acc q, Acc w) { return keep_in_register(_mm256_add_epi32(acc, _mm256_madd_epi16(q, w))); }
  static int64_t sum(Acc acc) {
    const __m256i wide = _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(acc)),
                                          _mm256_cvtepi32_epi64(_mm256_extracti128_si256(acc, 1)));
    int64_t lanes[4];
    _mm256_storeu_si256((__m256i*)lanes, wide);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
  }
};
#elif defined(__aarch64__)
struct IntDot {
  using Acc = int32x4_t;
  static constexpr int64_t kStep = 8;
  static Acc zero() { return vdupq_n_s32(0); }
  static int16x8_t weights(const int8_t* w) { return vmovl_s8(vld1_s8(w)); }
  static int16x8_t activations(const int16_t* q) { return vld1q_s16(q); }
  static Acc madd(Acc acc, int16x8_t q, int16x8_t w) {
    return vmlal_high_s16(vmlal_s16(acc, vget_low_s16(q), vget_low_s16(w)), q, w);
  }
  static int64_t sum(Acc acc) { return vaddlvq_s32(acc); }
};
#else
struct IntDot {
  using Acc = int64_t;
  static constexpr int64_t kStep = 8;
  static Acc zero() { return 0; }
  struct Block {
    int16_t v[8];
  };
  static Block weights(const int8_t* w) {
    Block b;
    for (int i = 0; i < 8; ++i) b.v[i] = w[i];
    return b;
  }
  static Block activations(const int16_t* q) {
    Block b;
    std::memcpy(b.v, q, sizeof b.v);
    return b;
  }
  static Acc madd(Acc acc, const Block& q, const Block& w) {
    for (int i = 0; i < 8; ++i) acc += static_cast<int64_t>(q.v[i]) * w.v[i];
    return acc;
  }
  static int64_t sum(Acc acc) { return acc; }
};
#endif
constexpr int64_t kFlushSteps = 256;

#if defined(CPU_CAPABILITY_AVX2)
constexpr int kIntRows = 2;  // activation rows per pass: 2 x 4 accumulators in 16 registers
#else
constexpr int kIntRows = 4;
#endif
// Up to this many activation rows int8_gemv reads each weight row once for all of them (int_row: two chains
// of adds a row up to 2 rows, one beyond), more take tiles of kIntTile weight rows in passes of kIntRows. On the
// Intel Xeon of docs/performance.md (the 125M Llama's 49 products, 2 threads, alternating in one process) streaming ran
// 1.26x, 1.17x, 1.32x, 1.24x and 1.30x the tiles at 3, 4, 5, 6 and 8 rows on AVX2 (1.06x at 12, 0.93x at 16),
// 1.19x, 1.16x and 1.12x at 5, 6 and 8 on AVX-512. NEON keeps kIntRows (untimed).
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr int kIntStreamRows = 8;
#else
constexpr int kIntStreamRows = kIntRows;
#endif
constexpr int kIntTile = 4;  // weight rows per tile

// ---- prompts of int8 weights on x86: integer products of pairs of 16-bit activations ----
// For many rows the integer product beats float32 FMAs: vpmaddwd multiplies a pair of consecutive
// activations (rounded to 16 bits per row, quantize_row16; the pair broadcast to every lane) by the pair of
// weights of each lane's row and adds the two products into the lane: 16 multiply-adds per AVX2 instruction
// (and one add) where an FMA does 8. Timed in L1 on the AMD EPYC of docs/performance.md, one thread: 4 rows x 2
// vectors ran at 89-97 G multiply-adds/s on AVX2 against 58-62 for float32's best pass, 4 x 4 at 153-174
// against 116-119 on AVX-512 (larger passes spill: each product needs a register before its add).
// Each thread takes tiles of kPairTile weight rows; per chunk of kPairChunk weights the tile is packed
// pair-major ([pair][row] int32 lanes, a row's two int16 weights in one lane, gathered from the rows and
// widened: a few instructions per lane, against the kPairRows-row passes that each read it from L1).
// Sums: exact, the int32 lanes added into int64 after each chunk (128 pairs, within int32), so the products are
// int8_gemv's bit for bit. (4-bit weights took these pairs too until their activations became 8-bit blocks;
// their quads, below, reuse the tiles, the chunks and the gathers.)
// x's rows rounded to 16 bits (q [M, K], scales sx [M]), rows in parallel
inline void quantize_rows16(const float* x, int64_t M, int64_t K, int16_t* q, float* sx) {
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) sx[m] = quantize_row16(x + m * K, K, q + m * K);
  });
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#define AUTODEPLOY_PAIR_PRODUCTS 1

// byte masks for vpshufb (within each 128-bit lane): dword j takes bytes from the same dword
inline int32_t dword_mask(int j, int a, int b, int c, int d) {
  auto at = [j](int byte) { return byte < 0 ? 0x80 : 4 * j + byte; };
  return at(a) | at(b) << 8 | at(c) << 16 | at(d) << 24;
}

#if defined(CPU_CAPABILITY_AVX512)
struct Pairs {
  using I = __m512i;
  using F = __m512;
  static constexpr int kRows = 16;  // weight rows per vector
  static constexpr int kVectors = 4;  // vectors per tile
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static void store(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
  static I broadcast(const int16_t* pair) {
    int32_t v;
    std::memcpy(&v, pair, sizeof v);
    return _mm512_set1_epi32(v);
  }
  static I madd(I acc, I a, I b) { return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b)); }
  static I offsets(int64_t stride, int rows) {  // lane i: row min(i, rows - 1)
    alignas(64) int32_t lanes[kRows];
    for (int i = 0; i < kRows; ++i) lanes[i] = static_cast<int32_t>(std::min(i, rows - 1) * stride);
    return _mm512_load_si512(lanes);
  }
  static I gather(const void* base, I offsets) { return _mm512_i32gather_epi32(offsets, base, 1); }
  static I masks(int a, int b, int c, int d) {
    return _mm512_setr_epi32(dword_mask(0, a, b, c, d), dword_mask(1, a, b, c, d), dword_mask(2, a, b, c, d),
                             dword_mask(3, a, b, c, d), dword_mask(0, a, b, c, d), dword_mask(1, a, b, c, d),
                             dword_mask(2, a, b, c, d), dword_mask(3, a, b, c, d), dword_mask(0, a, b, c, d),
                             dword_mask(1, a, b, c, d), dword_mask(2, a, b, c, d), dword_mask(3, a, b, c, d),
                             dword_mask(0, a, b, c, d), dword_mask(1, a, b, c, d), dword_mask(2, a, b, c, d),
                             dword_mask(3, a, b, c, d));
  }
  static I shuffle(I v, I mask) { return _mm512_shuffle_epi8(v, mask); }
  static I quad_order() {  // per 8 bytes: 0, 2, 4, 6, 1, 3, 5, 7
    return _mm512_setr_epi32(0x06040200, 0x07050301, 0x0E0C0A08, 0x0F0D0B09, 0x06040200, 0x07050301, 0x0E0C0A08,
                             0x0F0D0B09, 0x06040200, 0x07050301, 0x0E0C0A08, 0x0F0D0B09, 0x06040200, 0x07050301,
                             0x0E0C0A08, 0x0F0D0B09);
  }
  static I high_bytes_signed(I v) { return _mm512_srai_epi16(v, 8); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // the quad products of 4-bit weights (int4_quad_gemm): the lanes' four unsigned bytes w times signed bytes x
  // added onto acc, 16-bit sums with vpmaddubsw (or int32 with VNNI); a block's sums as int32 lanes
  template <bool VNNI>
  static I quad_madd(I acc, I w, I x) {
    if constexpr (VNNI) return byte_products_onto(acc, w, x);
    return keep_in_register(_mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x)));
  }
  template <bool VNNI>
  static I quad_sums(I acc) {
    if constexpr (VNNI) return acc;
    return _mm512_madd_epi16(acc, _mm512_set1_epi16(1));
  }
  static I fill(int32_t v) { return _mm512_set1_epi32(v); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I low_nibbles(I v) { return _mm512_and_si512(v, fill(0x0F0F0F0F)); }
  static I high_nibbles(I v) { return low_nibbles(_mm512_srli_epi32(v, 4)); }
  static I minus_eights(I v) { return _mm512_sub_epi8(v, _mm512_set1_epi8(8)); }
  static F fillf(float v) { return _mm512_set1_ps(v); }
  static F bf16s(const uint16_t* p) {  // kRows bfloat16 values as floats
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static void add_to(int64_t* sums, I v) {
    _mm512_storeu_si512(sums, _mm512_add_epi64(_mm512_loadu_si512(sums),
                                               _mm512_cvtepi32_epi64(_mm512_castsi512_si256(v))));
    _mm512_storeu_si512(sums + 8, _mm512_add_epi64(_mm512_loadu_si512(sums + 8),
                                                   _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1))));
  }
};
#else
struct Pairs {
  using I = __m256i;
  using F = __m256;
  static constexpr int kRows = 8;
  static constexpr int kVectors = 2;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(int32_t* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static I broadcast(const int16_t* pair) {
    int32_t v;
    std::memcpy(&v, pair, sizeof v);
    return _mm256_set1_epi32(v);
  }
  // the add in place, written as assembly: GCC otherwise sums into the product's register and copies it back,
  // a register copy per multiply-add with 8 accumulators in AVX2's 16 registers
  static I madd(I acc, I a, I b) {
    const I product = _mm256_madd_epi16(a, b);
    asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(product));
    return acc;
  }
  static I offsets(int64_t stride, int rows) {
    alignas(32) int32_t lanes[kRows];
    for (int i = 0; i < kRows; ++i) lanes[i] = static_cast<int32_t>(std::min(i, rows - 1) * stride);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(lanes));
  }
  static I gather(const void* base, I offsets) {
    return _mm256_i32gather_epi32(static_cast<const int*>(base), offsets, 1);
  }
  static I shuffle(I v, I mask) { return _mm256_shuffle_epi8(v, mask); }
  static I quad_order() {  // per 8 bytes: 0, 2, 4, 6, 1, 3, 5, 7
    return _mm256_setr_epi32(0x06040200, 0x07050301, 0x0E0C0A08, 0x0F0D0B09, 0x06040200, 0x07050301, 0x0E0C0A08,
                             0x0F0D0B09);
  }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  template <bool VNNI>
  static I quad_madd(I acc, I w, I x) { return keep_in_register(_mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))); }
  template <bool VNNI>
  static I quad_sums(I acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
  static I fill(int32_t v) { return _mm256_set1_epi32(v); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I low_nibbles(I v) { return _mm256_and_si256(v, fill(0x0F0F0F0F)); }
  static I high_nibbles(I v) { return low_nibbles(_mm256_srli_epi32(v, 4)); }
  static I minus_eights(I v) { return _mm256_sub_epi8(v, _mm256_set1_epi8(8)); }
  static F fillf(float v) { return _mm256_set1_ps(v); }
  static F bf16s(const uint16_t* p) {  // kRows bfloat16 values as floats
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static void add_to(int64_t* sums, I v) {
    auto* lo = reinterpret_cast<__m256i*>(sums);
    auto* hi = reinterpret_cast<__m256i*>(sums + 4);
    _mm256_storeu_si256(lo, _mm256_add_epi64(_mm256_loadu_si256(lo), _mm256_cvtepi32_epi64(_mm256_castsi256_si128(v))));
    _mm256_storeu_si256(hi, _mm256_add_epi64(_mm256_loadu_si256(hi),
                                             _mm256_cvtepi32_epi64(_mm256_extracti128_si256(v, 1))));
  }
  // four int64 sums as doubles, exactly where |sum| < 2^51 (a pair product's are at most K x 127 x 32767): added
  // to 2^52 + 2^51 in the integer lanes, the bits are that double's, from which 2^52 + 2^51 is subtracted
  static __m256d exact_doubles(const int64_t* sums) {
    const __m256i magic = _mm256_set1_epi64x(0x4338000000000000);
    const __m256i biased = _mm256_add_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums)), magic);
    return _mm256_sub_pd(_mm256_castsi256_pd(biased), _mm256_castsi256_pd(magic));
  }
  static F to_floats(const int64_t* sums) {  // each rounded to float once, as a cast of the sum rounds it
    return _mm256_set_m128(_mm256_cvtpd_ps(exact_doubles(sums + 4)), _mm256_cvtpd_ps(exact_doubles(sums)));
  }
};
#endif

constexpr int kPairTile = Pairs::kRows * Pairs::kVectors;  // weight rows per tile
constexpr int kPairRows = 4;  // activation rows per pass: 4 x kVectors accumulators
constexpr int64_t kPairChunk = 256;  // weights of a row per packed chunk: 128 pairs (int32 lanes cannot overflow)
// More rows than this take the pair products: packing the weights costs about what 16-24 rows of arithmetic
// gain (the 125M Llama's products, 2 threads, alternating in one process: at 5 rows 0.4-0.7x the decode
// kernels, at 32 rows 1.1-1.5x on AVX2, 1.0-1.2x on AVX-512)
constexpr int64_t kPairMinRows = 16;

// How far past column k of a row the packing prefetches: to the next chunk of the row, or from the row's last
// chunk the first of the same row of the next tile (a thread's tiles are consecutive, parallel_tiles)
inline int64_t next_chunk(int64_t k, int64_t K) {
  return k + kPairChunk < K ? kPairChunk : kPairChunk + (kPairTile - 1) * K;
}

// The packed chunk of int8 weights: rows [n0, n0 + valid) of w [N, K], columns [k0, k1) (a multiple of 16: K
// is one of 64, ops.cpp), into packed[pair][kPairTile] (lanes past `valid` repeat the last row)
#if defined(CPU_CAPABILITY_AVX2)
// On AVX2, 16 weights of each of a vector's 8 rows at a time, widened to int16 and transposed as 8 x 8 pairs
// (24 shuffles) instead of gathered (4 gathers of 8 lanes and 16 more instructions)
inline void pack_int8(const int8_t* w, int64_t K, int64_t n0, int valid, int64_t k0, int64_t k1, int32_t* packed) {
  static_assert(Pairs::kRows == 8, "the transpose is 8 x 8");
  for (int v = 0; v < Pairs::kVectors; ++v) {
    const int rows = std::max(1, std::min(Pairs::kRows, valid - v * Pairs::kRows));
    const int8_t* base = w + (n0 + v * Pairs::kRows) * K;
    if (v * Pairs::kRows >= valid) base = w + (n0 + valid - 1) * K;
    const int8_t* row[8];
    for (int i = 0; i < 8; ++i) row[i] = base + std::min(i, rows - 1) * K;
    for (int64_t k = k0; k < k1; k += 16) {
      if (k % 64 == 0)  // the next chunk's cache lines (1.1-1.6x from 5 to 128 rows)
        for (int r = 0; r < rows; ++r) prefetch(base + r * K + k + next_chunk(k, K));
      __m256i a[8];  // row i's pairs k/2 .. k/2 + 7 as int32 lanes of two int16
      for (int i = 0; i < 8; ++i)
        a[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row[i] + k)));
      __m256i t[8], u[8];
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_epi32(a[2 * i], a[2 * i + 1]);  // pairs 0, 1 | 4, 5 of rows 2i, 2i + 1
        t[2 * i + 1] = _mm256_unpackhi_epi32(a[2 * i], a[2 * i + 1]);  // pairs 2, 3 | 6, 7
      }
      for (int h = 0; h < 2; ++h) {  // rows 0-3, then 4-7
        u[4 * h] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);  // pair 0 | 4 of the four rows
        u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);  // pair 1 | 5
        u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);  // pair 2 | 6
        u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);  // pair 3 | 7
      }
      int32_t* out = packed + (k - k0) / 2 * kPairTile + v * Pairs::kRows;
      for (int j = 0; j < 4; ++j) {
        Pairs::store(out + j * kPairTile, _mm256_permute2x128_si256(u[j], u[4 + j], 0x20));
        Pairs::store(out + (j + 4) * kPairTile, _mm256_permute2x128_si256(u[j], u[4 + j], 0x31));
      }
    }
  }
}
#else
inline void pack_int8(const int8_t* w, int64_t K, int64_t n0, int valid, int64_t k0, int64_t k1, int32_t* packed) {
  const auto first = Pairs::masks(-1, 0, -1, 1), second = Pairs::masks(-1, 2, -1, 3);
  for (int v = 0; v < Pairs::kVectors; ++v) {
    const int rows = std::max(1, std::min(Pairs::kRows, valid - v * Pairs::kRows));
    const auto offsets = Pairs::offsets(K, rows);
    const int8_t* base = w + (n0 + v * Pairs::kRows) * K;
    if (v * Pairs::kRows >= valid) base = w + (n0 + valid - 1) * K;
    for (int64_t k = k0; k < k1; k += 4) {
      if (k % 64 == 0)  // the next chunk's cache lines (1.1-1.6x from 5 to 128 rows)
        for (int r = 0; r < rows; ++r) prefetch(base + r * K + k + next_chunk(k, K));
      const auto four = Pairs::gather(base + k, offsets);  // weights k..k+3 of each lane's row
      int32_t* out = packed + (k - k0) / 2 * kPairTile + v * Pairs::kRows;
      Pairs::store(out, Pairs::high_bytes_signed(Pairs::shuffle(four, first)));
      Pairs::store(out + kPairTile, Pairs::high_bytes_signed(Pairs::shuffle(four, second)));
    }
  }
}
#endif

// ROWS rows of q (row stride K, from the chunk's first column) times the packed chunk of `pairs` pairs:
// flush(acc) with their int32 sums
template <int ROWS, typename Flush>
inline void pair_pass(const int16_t* q, int64_t K, const int32_t* packed, int64_t pairs, const Flush& flush) {
  typename Pairs::I acc[ROWS][Pairs::kVectors];
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < Pairs::kVectors; ++v) acc[i][v] = Pairs::zero();
  for (int64_t p = 0; p < pairs; ++p) {
    typename Pairs::I w[Pairs::kVectors];
    for (int v = 0; v < Pairs::kVectors; ++v) w[v] = Pairs::load(packed + p * kPairTile + v * Pairs::kRows);
    for (int i = 0; i < ROWS; ++i) {
      const auto x = Pairs::broadcast(q + i * K + 2 * p);
      for (int v = 0; v < Pairs::kVectors; ++v) acc[i][v] = Pairs::madd(acc[i][v], x, w[v]);
    }
  }
  flush(acc);
}

// A tile's outputs y[m, j] = float(sums[m][j]) * sx[m] * scale[j] for its `valid` rows (row stride N), one at a time
inline void pair_outputs_one_by_one(const int64_t* sums, const float* sx, const uint16_t* scale, float* y, int64_t M,
                                    int64_t N, int valid) {
  for (int64_t m = 0; m < M; ++m)
    for (int j = 0; j < valid; ++j)
      y[m * N + j] = static_cast<float>(sums[m * kPairTile + j]) * sx[m] * bf16_to_float(scale[j]);
}

#if defined(CPU_CAPABILITY_AVX2)
// The passes of all M rows of q (row stride K, from the chunk's first column) over a packed chunk of `pairs`
// pairs, their sums added onto sums[M][kPairTile]. A function of its own so that the compiler allocates the
// passes' registers alone: inlined beside the packing and the outputs, a vector form of the outputs cost the
// passes 8-10 % (register copies in their loop).
__attribute__((noinline)) void pair_chunk(const int16_t* q, int64_t M, int64_t K, const int32_t* packed,
                                          int64_t pairs, int64_t* sums) {
  for (int64_t m = 0; m < M; m += kPairRows) {
    with_rows<kPairRows>(std::min<int64_t>(kPairRows, M - m), [&](auto r) {
      constexpr int ROWS = decltype(r)::value;
      pair_pass<ROWS>(q + m * K, K, packed, pairs, [&](const auto& acc) {
        for (int i = 0; i < ROWS; ++i)
          for (int v = 0; v < Pairs::kVectors; ++v)
            Pairs::add_to(sums + (m + i) * kPairTile + v * Pairs::kRows, acc[i][v]);
      });
    });
  }
}

// The tile's outputs (as pair_outputs_one_by_one), a vector at a time where the tile is whole (not inlined, for the
// reason pair_chunk is not)
__attribute__((noinline)) void pair_outputs(const int64_t* sums, const float* sx, const uint16_t* scale, float* y,
                                            int64_t M, int64_t N, int valid) {
  if (valid != kPairTile) return pair_outputs_one_by_one(sums, sx, scale, y, M, N, valid);
  typename Pairs::F scales[Pairs::kVectors];
  for (int v = 0; v < Pairs::kVectors; ++v) scales[v] = Pairs::bf16s(scale + v * Pairs::kRows);
  for (int64_t m = 0; m < M; ++m)
    for (int v = 0; v < Pairs::kVectors; ++v)
      Pairs::storef(y + m * N + v * Pairs::kRows,
                    Pairs::mul(Pairs::mul(Pairs::to_floats(sums + m * kPairTile + v * Pairs::kRows),
                                          Pairs::fillf(sx[m])), scales[v]));
}
#endif

// int8_gemv's products for many rows (the same sums); K a multiple of 64
int int8_pair_gemm(const float* x, const int8_t* w, const uint16_t* scale, float* y, int64_t M, int64_t N,
                   int64_t K) {
  const Scratch<int16_t> q = scratch<int16_t>(M * K);
  const Scratch<float> sx = scratch<float>(M);
  if (!q || !sx) return -1;
  quantize_rows16(x, M, K, q.get(), sx.get());
  const int64_t tiles = (N + kPairTile - 1) / kPairTile, chunk_lanes = kPairChunk / 2 * kPairTile;
  // per thread: the packed chunk, then the tile's int64 sums [M][kPairTile]
  return parallel_tiles(tiles, chunk_lanes + 2 * M * kPairTile, [&](int64_t t, float* memory) {
    const int64_t n0 = t * kPairTile;
    const int valid = static_cast<int>(std::min<int64_t>(kPairTile, N - n0));
    int32_t* packed = reinterpret_cast<int32_t*>(memory);
    int64_t* sums = reinterpret_cast<int64_t*>(memory + chunk_lanes);
    std::fill(sums, sums + M * kPairTile, 0);
    for (int64_t k0 = 0; k0 < K; k0 += kPairChunk) {
      const int64_t k1 = std::min(K, k0 + kPairChunk), pairs = (k1 - k0) / 2;
      pack_int8(w, K, n0, valid, k0, k1, packed);
#if defined(CPU_CAPABILITY_AVX2)
      pair_chunk(q.get() + k0, M, K, packed, pairs, sums);
#else  // the passes written inline: as pair_chunk, or as a function it shares (always_inline), AVX-512 ran 0.93-0.97x
      for (int64_t m = 0; m < M; m += kPairRows) {
        with_rows<kPairRows>(std::min<int64_t>(kPairRows, M - m), [&](auto r) {
          constexpr int ROWS = decltype(r)::value;
          pair_pass<ROWS>(q.get() + m * K + k0, K, packed, pairs, [&](const auto& acc) {
            for (int i = 0; i < ROWS; ++i)
              for (int v = 0; v < Pairs::kVectors; ++v)
                Pairs::add_to(sums + (m + i) * kPairTile + v * Pairs::kRows, acc[i][v]);
          });
        });
      }
#endif
    }
#if defined(CPU_CAPABILITY_AVX2)
    pair_outputs(sums, sx.get(), scale + n0, y + n0, M, N, valid);
#else
    pair_outputs_one_by_one(sums, sx.get(), scale + n0, y + n0, M, N, valid);
#endif
  });
}

// ---- prompts of 4-bit weights on x86: integer products of quads of 8-bit activations ----
// The same tiles and chunks as the pair products, with 8-bit activations (quantize_blocks8): each int32 lane
// holds four of its row's nibbles as unsigned bytes, the even or the odd weights of 8 consecutive ones, and
// the four activations they meet are broadcast to every lane. With VNNI, vpdpbusd adds the lane's four products
// into it (two pair products' work in one instruction); without, vpmaddubsw adds pairs of them into 16-bit
// lanes, which take a block's 8 quads (at most 8 x 2 x 15 x 127 = 30480) before vpmaddwd by ones widens them,
// so about two instructions per quad where the pairs take two per pair. Each block of kQ8Block weights is
// summed exactly, offset by -8 * the block's sum of q (the nibbles are q + 8), scaled by the block's activation
// scale times its group's weight scale and summed in float32: int4_decode_reference's arithmetic.
constexpr int64_t kQuadsPerBlock = kQ8Block / 4;
// A pass keeps kQuadRows x kQuadVectors integer sums of the current block and as many float32 sums of the chunk
// in registers (with the weights, a broadcast and the block's scales: 29 of AVX-512's 32, 15 of AVX2's 16), so a
// block's float work is a conversion, a multiply and a multiply-add per pair of them; the float sums go to
// memory once a chunk.
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kQuadRows = 4, kQuadVectors = 2;
#else
constexpr int kQuadRows = 2, kQuadVectors = 2;
#endif
constexpr int kQuadTile = Pairs::kRows * kQuadVectors;  // weight rows per tile
constexpr int kPackRows = Pairs::kRows;  // weight rows per tile of int4_packed_gemm's layout (below)

// Rows [n0, n0 + valid) of a 4-bit weight qw [N, K/2], columns [k0, k1) (multiples of 8), packed quad-major:
// packed[quad][kQuadTile], quad 2j the low nibbles (weights 8j, 8j + 2, 8j + 4, 8j + 6 of the chunk) and 2j + 1
// the high ones (8j + 1, ...); lanes past `valid` repeat the last row
// (centered: as signed bytes nibble - 8, for AMX's signed x signed products)
inline void pack_int4_quads(const uint8_t* qw, int64_t K, int64_t n0, int valid, int64_t k0, int64_t k1,
                            int32_t* packed, bool centered = false) {
  const int64_t row_bytes = K / 2;
  for (int v = 0; v < kQuadVectors; ++v) {
    const int rows = std::max(1, std::min(Pairs::kRows, valid - v * Pairs::kRows));
    const auto offsets = Pairs::offsets(row_bytes, rows);
    const uint8_t* base = qw + (n0 + v * Pairs::kRows) * row_bytes;
    if (v * Pairs::kRows >= valid) base = qw + (n0 + valid - 1) * row_bytes;
    for (int64_t k = k0; k < k1; k += 8) {
      if (k % 128 == 0)  // the next chunk's cache lines
        for (int r = 0; r < rows; ++r) prefetch(base + r * row_bytes + k / 2 + kPairChunk / 2);
      const auto four = Pairs::gather(base + k / 2, offsets);  // bytes k/2..k/2+3 of each lane's row
      int32_t* out = packed + (k - k0) / 4 * kQuadTile + v * Pairs::kRows;
      const auto low = Pairs::low_nibbles(four), high = Pairs::high_nibbles(four);
      Pairs::store(out, centered ? Pairs::minus_eights(low) : low);
      Pairs::store(out + kQuadTile, centered ? Pairs::minus_eights(high) : high);
    }
  }
}

// pack_int4_quads from a weight packed in tiles of kPackRows rows (int4_packed_gemm): each packed word vector
// holds the quads of its rows; tiles past the last (lanes no row reads) repeat it
inline void unpack_int4_tiles(const int32_t* words, int64_t N, int64_t K, int64_t n0, int64_t k0, int64_t k1,
                              int32_t* packed, bool centered) {
  const int64_t last_tile = (N - 1) / kPackRows;
  for (int v = 0; v < kQuadVectors; ++v) {
    const int32_t* tile = words + std::min(n0 / kPackRows + v, last_tile) * (K / 8) * kPackRows;
    for (int64_t k = k0; k < k1; k += 8) {
      const auto four = Pairs::load(tile + k / 8 * kPackRows);
      int32_t* out = packed + (k - k0) / 4 * kQuadTile + v * Pairs::kRows;
      const auto low = Pairs::low_nibbles(four), high = Pairs::high_nibbles(four);
      Pairs::store(out, centered ? Pairs::minus_eights(low) : low);
      Pairs::store(out + kQuadTile, centered ? Pairs::minus_eights(high) : high);
    }
  }
}

// The activations of int4_quad_gemm: rows rounded to 8 bits per block, each 8 weights' activations reordered
// to the packed quads' order (the 4 even ones, then the 4 odd ones); per row and block -8 * the block's sum of
// q and the block's scale. With side > 1 (int4_packed_gemm's passes), each group of `side` rows lies side by side:
// word j (8 bytes: 8 weights' activations) of the group's row i at q[g * side * K + (j * side + i) * 8], the offset
// and scale of its block b at [g * side * blocks + b * side + i]. Read so, through one pointer where a pointer per
// row held them, the AVX2 passes kept their addresses in registers (four had been reloaded from the stack every
// word): the 125M Llama's 49 products 1.07x faster at 128 rows and 1.02x at 16 on AVX2 (the Intel Xeon of
// docs/performance.md, thirty-ninth round). side 1 is the rows one after the other.
struct QuadActivations {
  Scratch<int8_t> q;  // [padded][K]
  Scratch<int32_t> offset;  // [padded][K / kQ8Block]
  Scratch<float> sa;  // [padded][K / kQ8Block]

  // rows past M, up to `padded` (a multiple of side), are zeros (AMX's tiles take 16 rows at a time)
  bool prepare(const float* x, int64_t M, int64_t K, int64_t padded, int64_t side = 1) {
    const int64_t blocks = K / kQ8Block;
    q = scratch<int8_t>(padded * K);
    offset = scratch<int32_t>(padded * blocks);
    sa = scratch<float>(padded * blocks);
    if (!q || !offset || !sa) return false;
    const int64_t whole = M / side * side;  // the rows of whole groups; from there on, zeros where no row comes
    std::fill(q.get() + whole * K, q.get() + padded * K, int8_t{0});
    std::fill(offset.get() + whole * blocks, offset.get() + padded * blocks, 0);
    std::fill(sa.get() + whole * blocks, sa.get() + padded * blocks, 0.f);
    std::atomic<bool> ok{true};
    const bool placed = side > 1;  // rows side by side: each row made in a scratch, then placed
    at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
      // a row's rounded activations; when placed, also its reordered ones, offsets and scales
      const Scratch<int8_t> rounded = scratch<int8_t>(placed ? 2 * K : K);
      const Scratch<int32_t> row_offset = scratch<int32_t>(placed ? blocks : 0);
      const Scratch<float> row_sa = scratch<float>(placed ? blocks : 0);
      if (!rounded || (placed && (!row_offset || !row_sa))) {
        ok = false;
        return;
      }
      const auto order = Pairs::quad_order();
      constexpr int64_t kBytes = 4 * Pairs::kRows;
      for (int64_t m = begin; m < end; ++m) {
        int32_t* sums = placed ? row_offset.get() : offset.get() + m * blocks;
        float* scales = placed ? row_sa.get() : sa.get() + m * blocks;
        quantize_blocks8(x + m * K, K, rounded.get(), scales, sums);
        for (int64_t b = 0; b < blocks; ++b) sums[b] *= -8;
        int8_t* row = placed ? rounded.get() + K : q.get() + m * K;
        int64_t k = 0;
        for (; k + kBytes <= K; k += kBytes)  // a vector of bytes at a time (as scalar moves: 1-2 % of a prompt)
          Pairs::store(reinterpret_cast<int32_t*>(row + k),
                       Pairs::shuffle(Pairs::load(reinterpret_cast<const int32_t*>(rounded.get() + k)), order));
        for (; k < K; k += 8)
          for (int i = 0; i < 4; ++i) {
            row[k + i] = rounded[k + 2 * i];
            row[k + 4 + i] = rounded[k + 2 * i + 1];
          }
        if (!placed) continue;
        const int64_t group = m / side * side, i = m - group;
        for (int64_t j = 0; j < K / 8; ++j) std::memcpy(q.get() + group * K + (j * side + i) * 8, row + 8 * j, 8);
        for (int64_t b = 0; b < blocks; ++b) {
          offset[group * blocks + b * side + i] = sums[b];
          sa[group * blocks + b * side + i] = scales[b];
        }
      }
    });
    return ok;
  }
};

// ROWS activation rows (from row m) times a packed chunk of blocks [b0, b1) (the chunk's first block b0 of the
// row's), added onto their float32 sums (row stride kQuadTile)
template <int ROWS, bool VNNI>
inline void quad_pass(const QuadActivations& a, int64_t m, int64_t K, int64_t b0, int64_t b1, const int32_t* packed,
                      const float* block_scales, float* sums) {
  const int64_t blocks = K / kQ8Block;
  typename Pairs::F total[ROWS][kQuadVectors];
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < kQuadVectors; ++v) total[i][v] = Pairs::loadf(sums + (m + i) * kQuadTile + v * Pairs::kRows);
  for (int64_t b = b0; b < b1; ++b) {
    typename Pairs::I acc[ROWS][kQuadVectors];
    for (int i = 0; i < ROWS; ++i)
      for (int v = 0; v < kQuadVectors; ++v) acc[i][v] = Pairs::zero();
    const int32_t* block = packed + (b - b0) * kQuadsPerBlock * kQuadTile;
    const int8_t* xs = a.q.get() + m * K + b * kQ8Block;
    for (int64_t p = 0; p < kQuadsPerBlock; ++p) {
      typename Pairs::I w[kQuadVectors];
      for (int v = 0; v < kQuadVectors; ++v) w[v] = Pairs::load(block + p * kQuadTile + v * Pairs::kRows);
      for (int i = 0; i < ROWS; ++i) {
        int32_t four;
        std::memcpy(&four, xs + i * K + 4 * p, sizeof four);
        const auto x = Pairs::fill(four);
        for (int v = 0; v < kQuadVectors; ++v) acc[i][v] = Pairs::template quad_madd<VNNI>(acc[i][v], w[v], x);
      }
    }
    typename Pairs::F s[kQuadVectors];
    for (int v = 0; v < kQuadVectors; ++v) s[v] = Pairs::loadf(block_scales + b * kQuadTile + v * Pairs::kRows);
    for (int i = 0; i < ROWS; ++i) {
      const auto offset = Pairs::fill(a.offset[(m + i) * blocks + b]);
      const auto row_scale = Pairs::fillf(a.sa[(m + i) * blocks + b]);
      for (int v = 0; v < kQuadVectors; ++v) {
        const auto exact = Pairs::add(Pairs::template quad_sums<VNNI>(acc[i][v]), offset);
        total[i][v] = Pairs::fmadd(Pairs::to_float(exact), Pairs::mul(s[v], row_scale), total[i][v]);
      }
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int v = 0; v < kQuadVectors; ++v) Pairs::storef(sums + (m + i) * kQuadTile + v * Pairs::kRows, total[i][v]);
}

#if defined(CPU_CAPABILITY_AVX512)
// ---- the quads on AMX's int8 tiles ----
// Where oneDNN runs AMX here (ops.cpp asks it, the int8 prompts' test), the quads of a block of 32 weights are one
// tdpbssd: 16 activation rows (the A tile, 16 x 32 bytes of the reordered activations) times the 16 weight rows
// of a packed vector (the B tile: 8 quads x 16 lanes, the nibbles centered to signed bytes, so no offset), into
// 16 x 16 exact int32 sums, stored and scaled per block into float32 sums held in registers, as the vector passes
// do. One tile product does the work of 128 vpdpbusd.
constexpr int64_t kAmxRows = 16;
// Fewer rows than this stay on the vector passes: the tiles take 16 rows at a time, so 17-31 rows pay for 32 (the
// 125M Llama's 48 layer products, 2 threads, against the vector passes with VNNI: 0.78x at 17 rows, 0.95x at 24,
// 1.13x at 32, 1.22x at 64, 1.27x at 128)
constexpr int64_t kAmxMinRows = 32;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out AMX's tile state only on request, per process (oneDNN has asked by the time it reports AMX)
bool amx_tiles_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// rows [0, padded) (a multiple of kAmxRows) of prepared activations times a packed chunk of blocks [b0, b1),
// added onto their float32 sums (row stride kQuadTile)
__attribute__((target("amx-tile,amx-int8"))) void amx_quad_chunk(const QuadActivations& a, int64_t padded, int64_t K,
                                                                  int64_t b0, int64_t b1, const int32_t* packed,
                                                                  const float* block_scales, float* sums) {
  TileConfig config;
  config.rows[0] = kAmxRows, config.colsb[0] = 64;  // tmm0, the sums: 16 rows x 16 int32
  config.rows[1] = kAmxRows, config.colsb[1] = kQ8Block;  // tmm1, the activations: 16 rows x one block
  config.rows[2] = kQuadsPerBlock, config.colsb[2] = 64;  // tmm2, the weights: a block's quads x 16 lanes
  asm volatile("" ::: "memory");  // ldtilecfg reads all 64 bytes, which its asm does not say
  _tile_loadconfig(&config);
  alignas(64) int32_t products[kAmxRows * 16];
  const int64_t blocks = K / kQ8Block;
  for (int64_t m0 = 0; m0 < padded; m0 += kAmxRows)
    for (int v = 0; v < kQuadVectors; ++v) {
      float* out = sums + m0 * kQuadTile + v * Pairs::kRows;
      __m512 total[kAmxRows];
      for (int r = 0; r < kAmxRows; ++r) total[r] = _mm512_loadu_ps(out + r * kQuadTile);
      for (int64_t b = b0; b < b1; ++b) {
        _tile_zero(0);
        _tile_loadd(1, a.q.get() + m0 * K + b * kQ8Block, K);
        _tile_loadd(2, packed + (b - b0) * kQuadsPerBlock * kQuadTile + v * Pairs::kRows, kQuadTile * 4);
        _tile_dpbssd(0, 1, 2);
        _tile_stored(0, products, 64);
        const __m512 s = _mm512_loadu_ps(block_scales + b * kQuadTile + v * Pairs::kRows);
        const float* sa = a.sa.get() + m0 * blocks + b;
        for (int r = 0; r < kAmxRows; ++r)
          total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(products + r * 16)),
                                     _mm512_mul_ps(s, _mm512_set1_ps(sa[r * blocks])), total[r]);
      }
      for (int r = 0; r < kAmxRows; ++r) _mm512_storeu_ps(out + r * kQuadTile, total[r]);
    }
  _tile_release();
}
#endif

// int4_gemm's products for many rows; group a multiple of kQ8Block, K of group. amx: the AVX-512 build runs the
// blocks on AMX's tiles (the same exact sums)
// words: the weight packed in tiles (int4_packed_gemm; scale then the packed scales), or null for qw and scale by rows
template <bool VNNI>
int int4_quad_gemm(const float* x, const uint8_t* qw, const uint16_t* scale, const int32_t* words, int64_t group,
                   float* y, int64_t M, int64_t N, int64_t K, bool amx) {
#if defined(CPU_CAPABILITY_AVX512)
  amx = amx && M >= kAmxMinRows && amx_tiles_granted();
  const int64_t padded = amx ? (M + kAmxRows - 1) / kAmxRows * kAmxRows : M;
#else
  amx = false;
  const int64_t padded = M;
#endif
  QuadActivations a;
  if (!a.prepare(x, M, K, padded)) return -1;
  const int64_t tiles = (N + kQuadTile - 1) / kQuadTile, chunk_lanes = kPairChunk / 4 * kQuadTile;
  const int64_t blocks = K / kQ8Block, groups = K / group;
  // per thread: the packed chunk, the tile's block scales [blocks][kQuadTile] and float32 sums [padded][kQuadTile]
  return parallel_tiles(tiles, chunk_lanes + (blocks + padded) * kQuadTile, [&](int64_t t, float* memory) {
    const int64_t n0 = t * kQuadTile;
    const int valid = static_cast<int>(std::min<int64_t>(kQuadTile, N - n0));
    int32_t* packed = reinterpret_cast<int32_t*>(memory);
    float* block_scales = memory + chunk_lanes;
    float* sums = block_scales + blocks * kQuadTile;
    const int64_t per_group = group / kQ8Block;
    for (int j = 0; j < kQuadTile; ++j) {  // [blocks][kQuadTile], lanes past `valid` repeating the last row
      const int64_t n = n0 + std::min(j, valid - 1), stride = words ? kPackRows : 1;
      const uint16_t* row = words ? scale + n / kPackRows * groups * kPackRows + n % kPackRows : scale + n * groups;
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b)
          block_scales[b * kQuadTile + j] = bf16_to_float(row[g * stride]);
    }
    std::fill(sums, sums + padded * kQuadTile, 0.f);
    for (int64_t k0 = 0; k0 < K; k0 += kPairChunk) {
      const int64_t k1 = std::min(K, k0 + kPairChunk);
      if (words) unpack_int4_tiles(words, N, K, n0, k0, k1, packed, amx);
      else pack_int4_quads(qw, K, n0, valid, k0, k1, packed, amx);
#if defined(CPU_CAPABILITY_AVX512)
      if (amx) {
        amx_quad_chunk(a, padded, K, k0 / kQ8Block, k1 / kQ8Block, packed, block_scales, sums);
        continue;
      }
#endif
      for (int64_t m = 0; m < M; m += kQuadRows)
        with_rows<kQuadRows>(std::min<int64_t>(kQuadRows, M - m), [&](auto r) {
          quad_pass<decltype(r)::value, VNNI>(a, m, K, k0 / kQ8Block, k1 / kQ8Block, packed, block_scales, sums);
        });
    }
    if (valid == kQuadTile) {  // whole tiles in vectors: a call to memcpy per row took 6-7 % of a 4-bit prompt
      for (int64_t m = 0; m < M; ++m)
        for (int v = 0; v < kQuadVectors; ++v)
          Pairs::storef(y + m * N + n0 + v * Pairs::kRows, Pairs::loadf(sums + m * kQuadTile + v * Pairs::kRows));
    } else {
      for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, sums + m * kQuadTile, valid * sizeof(float));
    }
  });
}
// ---- 4-bit weights packed in tiles of rows (KernelTable::int4_packed_gemm): one lane per weight row ----
// int4_gemv reads one weight row at a time, so each step of 64 weights pays for unpacking, the block scales and a
// float multiply-add per block in every lane. Packed (pack_int4_tiles in int4_linear.py), a tile's kPackRows rows
// lie word-major: word j of each row (the 4 bytes holding weights 8j..8j+7) side by side, one vector per word, the
// rows' scales likewise ([group][kPackRows] bfloat16). A vector then holds two quads of int4_quad_gemm (low
// nibbles: the even weights, high: the odd), one lane per weight row, so a block's activations are broadcasts and
// its float work one conversion and multiply-add per kPackRows rows: the quad products' arithmetic in the same
// order, so the sums equal int4_quad_gemm's bit for bit. A tile is one sequential stream of K/2 x kPackRows bytes.
// The 125M Llama's 48 layer products (2 threads, the Intel Xeon of docs/performance.md, "twenty-first round",
// against int4_gemv over the rows): AVX2 1.14x at one row, 1.27x at 2, 1.57x at 4, 1.73x at 16; AVX-512 with VNNI
// 1.05x at one row, 1.42x at 4, 1.86x at 16.

constexpr int kPackedPassRows = 4;  // activation rows per pass: the tile from L1 after the first pass

// y[m + i, n0 : n0 + valid] for ROWS prepared activation rows (from row m) and one packed tile, UNROLL blocks at a
// time (their integer sums independent, added to the float sums in the blocks' order)
template <int ROWS, bool VNNI, int SIDE, int UNROLL = 1>
[[gnu::always_inline]] inline void packed_pass(const QuadActivations& a, int64_t m, int64_t K, int64_t per_group,
                                               const int32_t* words, const uint16_t* scales, float* y, int64_t N,
                                               int64_t n0, int valid) {
  const int64_t blocks = K / kQ8Block;
  const int8_t* rows = a.q.get() + m * K;  // SIDE rows side by side from row m (QuadActivations)
  const int32_t* offsets = a.offset.get() + m * blocks;
  const float* row_scales = a.sa.get() + m * blocks;
  typename Pairs::F total[ROWS];
  for (int i = 0; i < ROWS; ++i) total[i] = Pairs::fillf(0.f);
  // the group's scales counted, not divided: a 64-bit division per block was a quarter of the one-row pass's
  // cycles (llvm-mca, AVX2: 15.7 -> 11.6 cycles a block; the 49 products at one row 1.06x, docs/performance.md)
  const uint16_t* group_scales = scales;
  typename Pairs::F s = Pairs::fillf(0.f);  // the current group's scales
  int64_t in_group = 0;
  const auto block_scale = [&] {  // the weight scales of the next block
    if (in_group == 0) {
      s = Pairs::bf16s(group_scales);
      group_scales += kPackRows;
    }
    if (++in_group == per_group) in_group = 0;
    return s;
  };
  const auto block_sums = [&](int64_t b, typename Pairs::I (&acc)[ROWS]) {  // block b's exact sums
    for (int i = 0; i < ROWS; ++i) acc[i] = Pairs::zero();
    prefetch_lines<kQuadsPerBlock / 2 * kPackRows * 4>(words + b * kQuadsPerBlock / 2 * kPackRows);
    for (int64_t p = 0; p < kQuadsPerBlock / 2; ++p) {  // a word holds two quads
      const int32_t* at = words + (b * kQuadsPerBlock / 2 + p) * kPackRows;
      const auto w = Pairs::load(at);
      const auto low = Pairs::low_nibbles(w), high = Pairs::high_nibbles(w);
      for (int i = 0; i < ROWS; ++i) {
        const int8_t* xs = rows + ((b * kQuadsPerBlock / 2 + p) * SIDE + i) * 8;
        int32_t even, odd;
        std::memcpy(&even, xs, sizeof even);
        std::memcpy(&odd, xs + 4, sizeof odd);
        acc[i] = Pairs::template quad_madd<VNNI>(acc[i], low, Pairs::fill(even));
        acc[i] = Pairs::template quad_madd<VNNI>(acc[i], high, Pairs::fill(odd));
      }
    }
    for (int i = 0; i < ROWS; ++i)
      acc[i] = Pairs::add(Pairs::template quad_sums<VNNI>(acc[i]), Pairs::fill(offsets[b * SIDE + i]));
  };
  const auto add_block = [&](int64_t b, const typename Pairs::F& scale, const typename Pairs::I (&exact)[ROWS]) {
    for (int i = 0; i < ROWS; ++i)
      total[i] = Pairs::fmadd(Pairs::to_float(exact[i]), Pairs::mul(scale, Pairs::fillf(row_scales[b * SIDE + i])),
                              total[i]);
  };
  int64_t b = 0;
  for (; b + UNROLL <= blocks; b += UNROLL) {
    typename Pairs::F scale[UNROLL];
    typename Pairs::I exact[UNROLL][ROWS];
    for (int u = 0; u < UNROLL; ++u) scale[u] = block_scale();
    for (int u = 0; u < UNROLL; ++u) block_sums(b + u, exact[u]);
    for (int u = 0; u < UNROLL; ++u) add_block(b + u, scale[u], exact[u]);
  }
  for (; b < blocks; ++b) {
    typename Pairs::I exact[ROWS];
    const auto scale = block_scale();
    block_sums(b, exact);
    add_block(b, scale, exact);
  }
  for (int i = 0; i < ROWS; ++i) {
    if (valid == kPackRows) {
      Pairs::storef(y + (m + i) * N + n0, total[i]);
    } else {
      alignas(64) float lanes[kPackRows];
      Pairs::storef(lanes, total[i]);
      std::memcpy(y + (m + i) * N + n0, lanes, valid * sizeof(float));
    }
  }
}

// Up to this many rows int4_packed_gemm makes passes over each tile; more take int4_quad_gemm over the tiles (no
// gathers). The 125M Llama's 48 layer products against int4_linear over the rows (2 threads, the Intel Xeon of
// docs/performance.md): AVX2 1.15x at 32 rows and 1.05x at 128 with passes, 1.04x and 1.03x through
// int4_quad_gemm over the tiles; AVX-512 with passes 1.00x at 32 and 0.78x at 128 (int4_quad_gemm on AMX's tiles).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kPackedPassMaxRows = kInt4GemvMaxRows;
#else
constexpr int64_t kPackedPassMaxRows = std::numeric_limits<int64_t>::max();
#endif

// KernelTable::int4_packed_gemm
int int4_packed_gemm(const float* x, const int32_t* words, const uint16_t* scale, int64_t group, float* y, int64_t M,
                     int64_t N, int64_t K, bool amx) {
  if (M <= 0 || N <= 0) return 0;
  int status = 0;
  if (M > kPackedPassMaxRows) {
    with_vnni([&](auto vnni) {
      status = int4_quad_gemm<decltype(vnni)::value>(x, nullptr, scale, words, group, y, M, N, K, amx);
    });
    return status;
  }
  QuadActivations a;  // a pass's rows side by side (one row: itself)
  const int64_t side = M == 1 ? 1 : kPackedPassRows;
  if (!a.prepare(x, M, K, (M + side - 1) / side * side, side)) return -1;
  const int64_t tiles = (N + kPackRows - 1) / kPackRows, groups = K / group, per_group = group / kQ8Block;
  with_vnni([&](auto vnni) {
    status = parallel_tiles(tiles, 0, [&](int64_t t, float*, bool first) {
      const int32_t* tile = words + t * (K / 8) * kPackRows;
      if (first) prefetch_stream_start(tile);
      const int64_t n0 = t * kPackRows;
      const int valid = static_cast<int>(std::min<int64_t>(kPackRows, N - n0));
      const uint16_t* scales = scale + t * groups * kPackRows;
      constexpr bool kVnni = decltype(vnni)::value;
      // one row: two blocks at a time (the 49 products at one row, 2 MiB pages, 2 threads: 1.04-1.08x on AVX2,
      // 1.01-1.07x on AVX-512; at 2 rows 0.97x)
      if (M == 1) return packed_pass<1, kVnni, 1, 2>(a, 0, K, per_group, tile, scales, y, N, n0, valid);
      for (int64_t m = 0; m < M; m += kPackedPassRows)
        with_rows<kPackedPassRows>(std::min<int64_t>(kPackedPassRows, M - m), [&](auto r) {
          packed_pass<decltype(r)::value, kVnni, kPackedPassRows>(a, m, K, per_group, tile, scales, y, N, n0, valid);
        });
    });
  });
  return status;
}
#endif

// dot[i][j] = q[i, :] . w[j, :] exactly, for ROWS activation rows and `valid` weight rows
template <int ROWS>
inline void int_pass(const int16_t* q, const int8_t* w, int64_t K, int valid, int64_t dot[][kIntTile]) {
  for (int i = 0; i < ROWS; ++i)
    for (int j = 0; j < kIntTile; ++j) dot[i][j] = 0;
  const int8_t* rows[kIntTile];  // rows past `valid` repeat the first (their sums are not stored)
  for (int j = 0; j < kIntTile; ++j) rows[j] = w + (j < valid ? j : 0) * K;
  for (int64_t start = 0; start < K; start += kFlushSteps * IntDot::kStep) {
    const int64_t stop = std::min(K, start + kFlushSteps * IntDot::kStep);
    typename IntDot::Acc acc[ROWS][kIntTile];
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < kIntTile; ++j) acc[i][j] = IntDot::zero();
    for (int64_t k = start; k < stop; k += IntDot::kStep) {
      if (k % kLine == 0)  // once per cache line
        for (int j = 0; j < kIntTile; ++j) prefetch(rows[j] + k + 4096);
      decltype(IntDot::activations(q)) qv[ROWS];
      for (int i = 0; i < ROWS; ++i) qv[i] = IntDot::activations(q + i * K + k);
      for (int j = 0; j < kIntTile; ++j) {
        const auto wv = IntDot::weights(rows[j] + k);
        for (int i = 0; i < ROWS; ++i) acc[i][j] = IntDot::madd(acc[i][j], qv[i], wv);
      }
    }
    // every column, `valid` or not: indexed by a bound known only at run time, the sums would live on the stack
    // (GCC stored them there every step)
    for (int i = 0; i < ROWS; ++i)
      for (int j = 0; j < kIntTile; ++j) dot[i][j] += IntDot::sum(acc[i][j]);
  }
}

// dot[i] = q[i, :] . w[:] exactly for ROWS activation rows and one weight row (the weights as one sequential
// stream, as row_by_row does for the float products). K is a multiple of kLine (int8_gemv's callers check 64):
// each iteration takes a cache line of weights with one prefetch and no branch between its steps, and the steps
// alternate between two accumulators a row. With one step an iteration, a prefetch test and a loop branch every
// 16 weights, the AVX2 build read its weights at 23-31 GB/s on the Intel Xeon of docs/performance.md, where the
// AVX-512 build (32 weights a step) read 31-52 (the 125M Llama's products at one row, "thirtieth round").
// The chains are two named arrays: indexed by the step (acc[i][s % 2]), GCC kept the one-row sums on the stack, a
// store and a reload in the chain every step (the AVX2 products at one row 1.03-1.06x faster without).
template <int ROWS>
inline void int_row(const int16_t* q, const int8_t* w, int64_t K, int64_t dot[]) {
  constexpr int64_t kLineSteps = kLine / IntDot::kStep;
  constexpr bool kTwoChains = ROWS <= 2;  // two chains of adds a row where rows are few
  static_assert(kLineSteps % 2 == 0 && kLine % IntDot::kStep == 0, "whole pairs of steps per cache line");
  for (int i = 0; i < ROWS; ++i) dot[i] = 0;
  for (int64_t start = 0; start < K; start += kFlushSteps * IntDot::kStep) {
    const int64_t stop = std::min(K, start + kFlushSteps * IntDot::kStep);
    typename IntDot::Acc even[ROWS], odd[ROWS];
    for (int i = 0; i < ROWS; ++i) even[i] = odd[i] = IntDot::zero();
    for (int64_t k = start; k < stop; k += kLine) {
      prefetch_stream<kLine>(w + k, k / kLine);
      for (int64_t s = 0; s < kLineSteps; s += 2) {
        const int64_t at = k + s * IntDot::kStep;
        const auto w0 = IntDot::weights(w + at), w1 = IntDot::weights(w + at + IntDot::kStep);
        for (int i = 0; i < ROWS; ++i) {
          even[i] = IntDot::madd(even[i], IntDot::activations(q + i * K + at), w0);
          auto& second = kTwoChains ? odd[i] : even[i];
          second = IntDot::madd(second, IntDot::activations(q + i * K + at + IntDot::kStep), w1);
        }
      }
    }
    for (int i = 0; i < ROWS; ++i) {
      dot[i] += IntDot::sum(even[i]);
      if constexpr (kTwoChains) dot[i] += IntDot::sum(odd[i]);
    }
  }
}

int int8_gemv(const float* x, const int8_t* w, const uint16_t* scale, float* y, int64_t M, int64_t N, int64_t K) {
  if (M <= 0 || N <= 0) return 0;
#if defined(AUTODEPLOY_PAIR_PRODUCTS)
  if (M > kPairMinRows) return int8_pair_gemm(x, w, scale, y, M, N, K);
#endif
  const Scratch<int16_t> q = scratch<int16_t>(M * K);
  const Scratch<float> sx = scratch<float>(M);
  if (!q || !sx) return -1;
  quantize_rows16(x, M, K, q.get(), sx.get());
  const int64_t tiles = (N + kIntTile - 1) / kIntTile;
  auto store = [&](int64_t m, int64_t n, int64_t dot) {
    y[m * N + n] = static_cast<float>(dot) * sx[m] * bf16_to_float(scale[n]);
  };
  parallel_tiles(tiles, 0, [&](int64_t t, float*, bool first) {
    const int64_t n0 = t * kIntTile;
    const int valid = static_cast<int>(std::min<int64_t>(kIntTile, N - n0));
    if (M <= kIntStreamRows) {  // few rows: one weight row after the other, a sequential stream (see row_by_row)
      if (first) prefetch_stream_start(w + n0 * K);
      with_rows<kIntStreamRows>(M, [&](auto r) {
        int64_t row_dot[decltype(r)::value];
        for (int j = 0; j < valid; ++j) {
          int_row<decltype(r)::value>(q.get(), w + (n0 + j) * K, K, row_dot);
          for (int i = 0; i < decltype(r)::value; ++i) store(i, n0 + j, row_dot[i]);
        }
      });
      return;
    }
    int64_t dot[kIntRows][kIntTile];
    for (int64_t m = 0; m < M; m += kIntRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kIntRows, M - m));
      const int16_t* qm = q.get() + m * K;
      with_rows<kIntRows>(rows, [&](auto r) { int_pass<decltype(r)::value>(qm, w + n0 * K, K, valid, dot); });
      for (int i = 0; i < rows; ++i)
        for (int j = 0; j < valid; ++j) store(m + i, n0 + j, dot[i][j]);
    }
  });
  return 0;
}

// ---- int8 weights, prompts with VNNI: the passes around torch's int8 GEMM (kernels.h) ----
// Plain loops the compiler vectorizes (the rounding is roundeven, the halves' conversions exact); rows in
// parallel.

constexpr int kSplitLevels = 16383;  // 15-bit activations: hi in [-64, 64], lo in [-128, 127]

void int8_split_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* row_scale) {
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * K;
      const float amax = at::vec::map_reduce_all<float>([](Vec v) { return v.abs(); },
                                                        [](Vec a, Vec b) { return at::vec::maximum(a, b); }, row, K);
      const float scale = std::max(amax, std::numeric_limits<float>::min()) / static_cast<float>(kSplitLevels);
      row_scale[m] = scale;
      int8_t* hi = q + m * K;
      int8_t* lo = q + (M + m) * K;
      // x / row_scale as torch divides (a true division, rounded half to even), then hi = floor((x15 + 128) /
      // 256) and lo = x15 - 256 hi, so lo = ((x15 + 128) & 255) - 128: every step exact in float32
      const Vec divisor(scale), bound(kSplitLevels), offset(128.f), step(256.f);
      int64_t k = 0;
      for (; k + kLanes <= K; k += kLanes) {
        const Vec v = at::vec::clamp((Vec::loadu(row + k) / divisor).round(), -bound, bound);
        const Vec h = ((v + offset) * Vec(1.f / 256.f)).floor();
        at::vec::convert<int8_t>(h).store(hi + k, kLanes);
        at::vec::convert<int8_t>(v - step * h).store(lo + k, kLanes);
      }
      for (; k < K; ++k) {
        float v = __builtin_roundevenf(row[k] / scale);
        v = v < -kSplitLevels ? -kSplitLevels : (v > kSplitLevels ? kSplitLevels : v);
        const float h = __builtin_floorf((v + 128.f) * (1.f / 256.f));
        hi[k] = static_cast<int8_t>(h);
        lo[k] = static_cast<int8_t>(v - 256.f * h);
      }
    }
  });
}

void int8_split_rescale(const int32_t* hi, const int32_t* lo, int64_t ld, int64_t rows, int64_t cols,
                        const float* row_scale, const float* scale, float* y, int64_t ldy) {
  using Int = at::vec::Vectorized<int32_t>;
  const Vec step(256.f);
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* high = hi + r * ld;
    const int32_t* low = lo + r * ld;
    const float rs = row_scale[r];
    float* out = y + r * ldy;
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) {  // 256 hi is exact: a multiply-add rounds as the add alone
      const Vec h = at::vec::convert_to_fp_of_same_size<float>(Int::loadu(high + c));
      const Vec l = at::vec::convert_to_fp_of_same_size<float>(Int::loadu(low + c));
      ((h * step + l) * (Vec(rs) * Vec::loadu(scale + c))).store(out + c);
    }
    for (; c < cols; ++c)
      out[c] = (static_cast<float>(high[c]) * 256.f + static_cast<float>(low[c])) * (rs * scale[c]);
  }
}

// ---- bfloat16 halves of float32 activations (the AMX prompt products, amx.h) ----

void bf16_split(const float* x, int64_t count, uint16_t* hi, uint16_t* lo) {
  auto* high = reinterpret_cast<c10::BFloat16*>(hi);
  auto* low = reinterpret_cast<c10::BFloat16*>(lo);
  at::parallel_for(0, count, 1 << 14, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 2 * kLanes <= end; i += 2 * kLanes) {
      const Vec a = Vec::loadu(x + i), b = Vec::loadu(x + i + kLanes);
      const auto h = at::vec::convert_float_bfloat16(a, b);
      const auto [ha, hb] = at::vec::convert_bfloat16_float(h);
      h.store(high + i);
      at::vec::convert_float_bfloat16(a - ha, b - hb).store(low + i);
    }
    for (; i < end; ++i) {
      high[i] = c10::BFloat16(x[i]);
      low[i] = c10::BFloat16(x[i] - static_cast<float>(high[i]));
    }
  });
}

// 32-bit words moved as floats (no arithmetic: any bit pattern goes through unchanged), in kLanes x kLanes tiles
void transpose32(const uint32_t* src, int64_t rows, int64_t cols, int64_t ld_src, uint32_t* dst, int64_t ld_dst) {
  const auto* in = reinterpret_cast<const float*>(src);
  auto* out = reinterpret_cast<float*>(dst);
  for (int64_t r = 0; r < rows; r += kLanes) {
    const int height = static_cast<int>(std::min<int64_t>(kLanes, rows - r));
    for (int64_t c = 0; c < cols; c += kLanes) {
      const int width = static_cast<int>(std::min<int64_t>(kLanes, cols - c));
      if (height == kLanes && width == kLanes)
        at::vec::transpose_mxn<float, kLanes, kLanes>(in + r * ld_src + c, ld_src, out + c * ld_dst + r, ld_dst);
      else
        for (int i = 0; i < height; ++i)
          for (int j = 0; j < width; ++j) dst[(c + j) * ld_dst + r + i] = src[(r + i) * ld_src + c + j];
    }
  }
}

// ---- 4-bit weights, decode rows: exact integer dot products of 8-bit activation blocks ----
// The activations are rounded to 8 bits per block of kQ8Block (quantize_blocks8, scale sa per block); each
// block's dot product of those with the 4-bit values q = nibble - 8 is an exact integer sum (at most
// 32 x 127 x 8 in magnitude), scaled by the block's sa times its group's bfloat16 scale and summed in float32:
// y = sum_b sa_b s_b dot_b (int4_decode_reference in int4_linear.py; llama.cpp's Q4_0 x Q8_0 arithmetic).
// On x86 the nibbles stay bytes: vpmaddubsw multiplies unsigned bytes by signed ones and adds pairs into
// 16-bit lanes, vpmaddwd by ones widens them (or, with VNNI, vpdpbusd does both), 2 to 4 times the weights per
// instruction of 16-bit activations' vpmaddwd. Measured in one process, alternating, the 125M Llama's 49
// products (2 threads, the Intel Xeon of docs/performance.md): see "Issue 18, seventeenth round" there.
// (Before them, 16-bit activations per row had halved the instructions of widening the weights to float32:
// AVX2 5.92 -> 3.10 ms per token on the AMD EPYC.)
//
// Int4Dot: kStep weights (kStep / 2 bytes) per step, unpacked into two vectors of nibbles: the step's even
// elements (low nibbles) and its odd ones (high nibbles), so the activations are reordered to match (per step:
// the even elements, then the odd). A step's products are summed in int32 lanes, each lane's weights within
// one block of kQ8Block; a lane starts from its share of the -8 offset (-8 times its activations' sum, so the
// nibbles need no -8 of their own), is scaled by its block's two scales and summed in float32.
#if defined(CPU_CAPABILITY_AVX512)
struct Int4Dot {
  using Act = int8_t;
  using Acc = __m512i;
  using Half = __m512i;
  using Sum = __m512;
  static constexpr int64_t kStep = 128;  // 64 bytes; a lane takes 8 weights (4 even, 4 odd), 4 lanes a block
  static constexpr int64_t kAccLanes = 16;
  static Half activations(const Act* q) { return _mm512_loadu_si512(q); }
  static Half eights() { return _mm512_set1_epi8(8); }
  static Acc load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static void store(int32_t* p, Acc v) { _mm512_storeu_si512(p, v); }
  static Acc negate(Acc v) { return _mm512_sub_epi32(_mm512_setzero_si512(), v); }
  static Acc add(Acc a, Acc b) { return _mm512_add_epi32(a, b); }
  static void unpack(const uint8_t* bytes, Half& low, Half& high) {
    const __m512i v = _mm512_loadu_si512(bytes), mask = _mm512_set1_epi8(15);
    low = _mm512_and_si512(v, mask);
    high = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  }
  // the same for a row's last, partial step of `bytes_left` bytes (the rest of the vectors zero)
  static void unpack_tail(const uint8_t* bytes, int64_t bytes_left, Half& low, Half& high) {
    const __m512i v = _mm512_maskz_loadu_epi8((__mmask64{1} << bytes_left) - 1, bytes), mask = _mm512_set1_epi8(15);
    low = _mm512_and_si512(v, mask);
    high = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
  }
  static Acc products(Half q_low, Half low, Half q_high, Half high) {
    const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(low, q_low), _mm512_maddubs_epi16(high, q_high));
    return _mm512_madd_epi16(pairs, _mm512_set1_epi16(1));
  }
  // lanes 4j..4j+3 sum the step's block j
  static Sum scales(const float* block_scale, int64_t k) {
    const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(lanes, _mm512_castps128_ps512(_mm_loadu_ps(block_scale + k / kQ8Block)));
  }
  static Sum load_sum(const float* p) { return _mm512_loadu_ps(p); }
  static void store_sum(float* p, Sum v) { _mm512_storeu_ps(p, v); }
  static Sum zero() { return _mm512_setzero_ps(); }
  static Sum plus(Sum a, Sum b) { return _mm512_add_ps(a, b); }
  static Sum times(Sum a, Sum b) { return _mm512_mul_ps(a, b); }
  static Sum scale_add(Sum sum, Acc acc, Sum s) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), s, sum); }
  static float total(Sum sum) { return _mm512_reduce_add_ps(sum); }
};
#elif defined(CPU_CAPABILITY_AVX2)
struct Int4Dot {
  using Act = int8_t;
  using Acc = __m256i;
  using Half = __m256i;
  using Sum = __m256;
  static constexpr int64_t kStep = 64;  // 32 bytes; lanes 0-3 the step's first block, 4-7 its second
  static constexpr int64_t kAccLanes = 8;
  static Half activations(const Act* q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)); }
  static Half eights() { return _mm256_set1_epi8(8); }
  static Acc load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(int32_t* p, Acc v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
  static Acc negate(Acc v) { return _mm256_sub_epi32(_mm256_setzero_si256(), v); }
  static Acc add(Acc a, Acc b) { return _mm256_add_epi32(a, b); }
  static void unpack(const uint8_t* bytes, Half& low, Half& high) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes)), mask = _mm256_set1_epi8(15);
    low = _mm256_and_si256(v, mask);
    high = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
  static void unpack_tail(const uint8_t* bytes, int64_t, Half& low, Half& high) {  // 16 bytes (one block)
    const __m256i v = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    const __m256i mask = _mm256_set1_epi8(15);
    low = _mm256_and_si256(v, mask);
    high = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
  static Acc products(Half q_low, Half low, Half q_high, Half high) {
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, q_low), _mm256_maddubs_epi16(high, q_high));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
  static Sum scales(const float* block_scale, int64_t k) {
    return _mm256_insertf128_ps(_mm256_set1_ps(block_scale[k / kQ8Block]), _mm_set1_ps(block_scale[k / kQ8Block + 1]),
                                1);
  }
  static Sum load_sum(const float* p) { return _mm256_loadu_ps(p); }
  static void store_sum(float* p, Sum v) { _mm256_storeu_ps(p, v); }
  static Sum zero() { return _mm256_setzero_ps(); }
  static Sum plus(Sum a, Sum b) { return _mm256_add_ps(a, b); }
  static Sum times(Sum a, Sum b) { return _mm256_mul_ps(a, b); }
  static Sum scale_add(Sum sum, Acc acc, Sum s) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), s, sum); }
  static float total(Sum sum) {
    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
  }
};
#elif defined(__aarch64__)
// 16-bit lanes hold the 8-bit activations and the nibbles (vmull / vmlal)
struct Int4Dot {
  using Act = int16_t;
  using Acc = int32x4_t;
  using Half = int16x8_t;
  using Sum = float32x4_t;
  static constexpr int64_t kStep = 16;  // within one block
  static constexpr int64_t kAccLanes = 4;
  static Half activations(const Act* q) { return vld1q_s16(q); }
  static Half eights() { return vdupq_n_s16(8); }
  static Acc load(const int32_t* p) { return vld1q_s32(p); }
  static void store(int32_t* p, Acc v) { vst1q_s32(p, v); }
  static Acc negate(Acc v) { return vnegq_s32(v); }
  static Acc add(Acc a, Acc b) { return vaddq_s32(a, b); }
  static void unpack(const uint8_t* bytes, Half& low, Half& high) {
    const uint16x8_t v = vmovl_u8(vld1_u8(bytes));
    low = vreinterpretq_s16_u16(vandq_u16(v, vdupq_n_u16(15)));
    high = vreinterpretq_s16_u16(vshrq_n_u16(v, 4));
  }
  static void unpack_tail(const uint8_t* bytes, int64_t, Half& low, Half& high) { unpack(bytes, low, high); }
  static Acc products(Half q_low, Half low, Half q_high, Half high) {
    const Acc lows = vmlal_high_s16(vmull_s16(vget_low_s16(q_low), vget_low_s16(low)), q_low, low);
    return vmlal_high_s16(vmlal_s16(lows, vget_low_s16(q_high), vget_low_s16(high)), q_high, high);
  }
  static Sum scales(const float* block_scale, int64_t k) { return vdupq_n_f32(block_scale[k / kQ8Block]); }
  static Sum load_sum(const float* p) { return vld1q_f32(p); }
  static void store_sum(float* p, Sum v) { vst1q_f32(p, v); }
  static Sum zero() { return vdupq_n_f32(0.f); }
  static Sum plus(Sum a, Sum b) { return vaddq_f32(a, b); }
  static Sum times(Sum a, Sum b) { return vmulq_f32(a, b); }
  static Sum scale_add(Sum sum, Acc acc, Sum s) { return vfmaq_f32(sum, vcvtq_f32_s32(acc), s); }
  static float total(Sum sum) { return vaddvq_f32(sum); }
};
#else
struct Int4Dot {
  using Act = int16_t;
  struct Half {
    int16_t v[8];
  };
  using Acc = int32_t;
  using Sum = float;
  static constexpr int64_t kStep = 16;
  static constexpr int64_t kAccLanes = 1;
  static Half activations(const Act* q) {
    Half h;
    std::memcpy(h.v, q, sizeof h.v);
    return h;
  }
  static Half eights() {
    Half h;
    for (auto& e : h.v) e = 8;
    return h;
  }
  static Acc load(const int32_t* p) { return *p; }
  static void store(int32_t* p, Acc v) { *p = v; }
  static Acc negate(Acc v) { return -v; }
  static Acc add(Acc a, Acc b) { return a + b; }
  static void unpack(const uint8_t* bytes, Half& low, Half& high) {
    for (int i = 0; i < 8; ++i) {
      low.v[i] = bytes[i] & 15;
      high.v[i] = bytes[i] >> 4;
    }
  }
  static void unpack_tail(const uint8_t* bytes, int64_t, Half& low, Half& high) { unpack(bytes, low, high); }
  static Acc products(const Half& q_low, const Half& low, const Half& q_high, const Half& high) {
    Acc acc = 0;
    for (int i = 0; i < 8; ++i) acc += int32_t{q_low.v[i]} * low.v[i] + int32_t{q_high.v[i]} * high.v[i];
    return acc;
  }
  static Sum scales(const float* block_scale, int64_t k) { return block_scale[k / kQ8Block]; }
  static Sum load_sum(const float* p) { return *p; }
  static void store_sum(float* p, Sum v) { *p = v; }
  static Sum zero() { return 0.f; }
  static Sum plus(Sum a, Sum b) { return a + b; }
  static Sum times(Sum a, Sum b) { return a * b; }
  static Sum scale_add(Sum sum, Acc acc, Sum s) { return std::fma(static_cast<float>(acc), s, sum); }
  static float total(Sum sum) { return sum; }
};
#endif
static_assert(Int4Dot::kStep % kQ8Block == 0 || kQ8Block % Int4Dot::kStep == 0, "lanes within one block");
// steps of a row of K weights (K a multiple of kQ8Block): a last, partial step (AVX2, AVX-512) reads only the
// row's bytes; the activations and block scales are padded with zeros to whole steps, so its other lanes add 0
inline int64_t int4_steps(int64_t K) { return (K + Int4Dot::kStep - 1) / Int4Dot::kStep; }

// acc + Int4Dot::products(q_low, low, q_high, high); with VNNI (the AVX-512 build only) two vpdpbusd
template <bool VNNI>
inline Int4Dot::Acc int4_products_onto(Int4Dot::Acc acc, const Int4Dot::Half& q_low, const Int4Dot::Half& low,
                                       const Int4Dot::Half& q_high, const Int4Dot::Half& high) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (VNNI) return byte_products_onto(byte_products_onto(acc, low, q_low), high, q_high);
#endif
  return Int4Dot::add(acc, Int4Dot::products(q_low, low, q_high, high));
}

// The activations of a decode batch, ready for Int4Dot: rows rounded to 8 bits per block and reordered per
// step; per row and step the lanes' -8 * sum(q), where each step's integer sums start, and the lanes' block
// scales
struct Int4Activations {
  Scratch<Int4Dot::Act> q;  // [rows][K]
  Scratch<int32_t> start;  // [rows][K / kStep][Int4Dot::kAccLanes]
  Scratch<float> lane_scale;  // [rows][K / kStep][Int4Dot::kAccLanes]

  bool prepare(const float* x, int64_t M, int64_t K) {
    constexpr int64_t half = Int4Dot::kStep / 2;
    const int64_t steps = int4_steps(K), padded = steps * Int4Dot::kStep;
    const Scratch<Int4Dot::Act> rounded = scratch<Int4Dot::Act>(padded);
    const Scratch<float> sa = scratch<float>(padded / kQ8Block);
    q = scratch<Int4Dot::Act>(M * padded);
    start = scratch<int32_t>(M * steps * Int4Dot::kAccLanes);
    lane_scale = scratch<float>(M * steps * Int4Dot::kAccLanes);
    if (!rounded || !sa || !q || !start || !lane_scale) return false;
    std::fill(rounded.get() + K, rounded.get() + padded, Int4Dot::Act{0});
    std::fill(sa.get() + K / kQ8Block, sa.get() + padded / kQ8Block, 0.f);
    for (int64_t m = 0; m < M; ++m) {
      quantize_blocks8(x + m * K, K, rounded.get(), sa.get());
      Int4Dot::Act* row = q.get() + m * padded;
      for (int64_t step = 0; step < steps; ++step) {
        const int64_t k0 = step * Int4Dot::kStep, lanes = (m * steps + step) * Int4Dot::kAccLanes;
        for (int64_t i = 0; i < half; ++i) {
          row[k0 + i] = rounded[k0 + 2 * i];
          row[k0 + half + i] = rounded[k0 + 2 * i + 1];
        }
        Int4Dot::store(start.get() + lanes,
                       Int4Dot::negate(Int4Dot::products(Int4Dot::activations(row + k0), Int4Dot::eights(),
                                                         Int4Dot::activations(row + k0 + half), Int4Dot::eights())));
        Int4Dot::store_sum(lane_scale.get() + lanes, Int4Dot::scales(sa.get(), k0));
      }
    }
    return true;
  }
};

// dot[i] = sum_b sa_b s_b (q[m0 + i] . (nibbles - 8))_b for ROWS prepared activation rows and one 4-bit weight row
// (its bytes w, its scales per block of kQ8Block weights), the weights read as one sequential stream. Two
// float32 sums per row, for even and odd steps, so that a step need not wait for the previous step's
// multiply-add: one row, a 2048 x 768 weight in L2, one thread, on the AMD EPYC of docs/performance.md: AVX2
// 51-53 -> 40 us per call (AVX-512 32-34 us either way).
// (Inlined by attribute, as is int4_gemv's pass that calls it: with two loops calling them, GCC made each a call
// per weight row, and the decode products ran 4-12 % slower.)
template <int ROWS, bool VNNI>
[[gnu::always_inline]] inline void int4_row(const Int4Activations& a, int64_t m0, const uint8_t* w,
                                            const float* block_scale, int64_t K, float dot[]) {
  constexpr int64_t half = Int4Dot::kStep / 2;
  const int64_t steps = int4_steps(K), full_steps = K / Int4Dot::kStep, padded = steps * Int4Dot::kStep;
  const Int4Dot::Act* rows = a.q.get() + m0 * padded;
  const int32_t* starts = a.start.get() + m0 * steps * Int4Dot::kAccLanes;
  const float* lane_scales = a.lane_scale.get() + m0 * steps * Int4Dot::kAccLanes;
  typename Int4Dot::Sum sums[ROWS][2];
  for (int i = 0; i < ROWS; ++i) sums[i][0] = sums[i][1] = Int4Dot::zero();
  auto step_at = [&](int64_t step, int parity, auto tail) {
    const int64_t k = step * Int4Dot::kStep;
    prefetch_stream<Int4Dot::kStep / 2>(w + k / 2, step);
    typename Int4Dot::Half low, high;
    if constexpr (decltype(tail)::value) Int4Dot::unpack_tail(w + k / 2, (K - k) / 2, low, high);
    else Int4Dot::unpack(w + k / 2, low, high);
    const auto s = Int4Dot::scales(block_scale, k);
    for (int i = 0; i < ROWS; ++i) {
      const Int4Dot::Act* q = rows + i * padded + k;
      const int64_t lanes = (i * steps + step) * Int4Dot::kAccLanes;
      const auto acc = int4_products_onto<VNNI>(Int4Dot::load(starts + lanes), Int4Dot::activations(q), low,
                                                Int4Dot::activations(q + half), high);
      sums[i][parity] =
          Int4Dot::scale_add(sums[i][parity], acc, Int4Dot::times(s, Int4Dot::load_sum(lane_scales + lanes)));
    }
  };
  int64_t step = 0;
  for (; step + 1 < full_steps; step += 2) {
    step_at(step, 0, std::false_type{});
    step_at(step + 1, 1, std::false_type{});
  }
  if (step < full_steps) step_at(step++, 0, std::false_type{});
  if (step < steps) step_at(step, 1, std::true_type{});
  for (int i = 0; i < ROWS; ++i) dot[i] = Int4Dot::total(Int4Dot::plus(sums[i][0], sums[i][1]));
}

// Up to kInt4GemvMaxRows rows (decode batches, short prompts) of int4_gemm: group a multiple of kQ8Block. Each
// row's sums are the same whichever rows come with it (one row's float32 sums, in one order), so a sequence's
// products do not depend on the batch it is decoded in
template <bool VNNI>
int int4_gemv(const float* x, const uint8_t* qw, const uint16_t* scale, int64_t group, float* y, int64_t M,
              int64_t N, int64_t K) {
  Int4Activations a;
  if (!a.prepare(x, M, K)) return -1;
  const int64_t groups = K / group, row_bytes = K / 2, per_group = group / kQ8Block;
  const int64_t blocks = int4_steps(K) * Int4Dot::kStep / kQ8Block;  // a row's blocks, padded to whole steps
  const int64_t tiles = (N + kTile - 1) / kTile;
  // each thread widens a tile's scales to float32 (vectorized), repeated per block of kQ8Block weights
  return parallel_tiles(tiles, kTile * (groups + blocks), [&](int64_t t, float* scratch, bool first) {
    const int64_t n0 = t * kTile, n1 = std::min(N, n0 + kTile);
    if (first) prefetch_stream_start(qw + n0 * row_bytes);
    at::vec::convert(reinterpret_cast<const c10::BFloat16*>(scale) + n0 * groups, scratch, (n1 - n0) * groups);
    float* block_scales = scratch;  // as converted where a group is a block and the steps are whole
    if (blocks != groups) {
      block_scales = scratch + kTile * groups;
      for (int64_t n = 0; n < n1 - n0; ++n) {
        float* row = block_scales + n * blocks;
        for (int64_t g = 0; g < groups; ++g)
          for (int64_t b = 0; b < per_group; ++b) row[g * per_group + b] = scratch[n * groups + g];
        std::fill(row + groups * per_group, row + blocks, 0.f);
      }
    }
    // a weight row for each pass of kMaxPassRows activation rows and a last pass of the rest (1 to kMaxPassRows),
    // the row read from memory by the first pass and from L1 by the others
    auto pass = [&](auto r, int64_t n, int64_t m0) __attribute__((always_inline)) {
      constexpr int ROWS = decltype(r)::value;
      float dot[ROWS];
      int4_row<ROWS, VNNI>(a, m0, qw + n * row_bytes, block_scales + (n - n0) * blocks, K, dot);
      for (int i = 0; i < ROWS; ++i) y[(m0 + i) * N + n] = dot[i];
    };
    // decode: one pass, in a loop of its own (through the general one below: 0.94-0.99x at 1-4 rows)
    if (M <= kMaxPassRows) {
      with_rows<kMaxPassRows>(M, [&](auto r) {
        for (int64_t n = n0; n < n1; ++n) pass(r, n, 0);
      });
      return;
    }
    const int64_t last_m0 = (M - 1) / kMaxPassRows * kMaxPassRows;
    with_rows<kMaxPassRows>(M - last_m0, [&](auto last) {
      for (int64_t n = n0; n < n1; ++n) {
        for (int64_t m0 = 0; m0 < last_m0; m0 += kMaxPassRows)
          pass(std::integral_constant<int, kMaxPassRows>{}, n, m0);
        pass(last, n, last_m0);
      }
    });
  });
}

int int4_gemm(const float* x, const uint8_t* qw, const uint16_t* scale, int64_t group, float* y, int64_t M,
              int64_t N, int64_t K, bool amx) {
  if (M <= 0 || N <= 0) return 0;
  int status = 0;
  if (M <= kInt4GemvMaxRows && group % kQ8Block == 0) {
    with_vnni([&](auto vnni) { status = int4_gemv<decltype(vnni)::value>(x, qw, scale, group, y, M, N, K); });
    return status;
  }
#if defined(AUTODEPLOY_PAIR_PRODUCTS)
  if (M > kPairMinRows && group % kQ8Block == 0) {
    with_vnni([&](auto vnni) {
      status = int4_quad_gemm<decltype(vnni)::value>(x, qw, scale, nullptr, group, y, M, N, K, amx);
    });
    return status;
  }
#endif
  return int4_widened_gemm(x, qw, scale, group, y, M, N, K);
}

// ---- the pointwise work of prompts between the products: RMSNorm, SiLU x up, RoPE ----
// Rows go to the threads in blocks of at least kPointwiseGrain floats, so that a decode row stays on one thread.
constexpr int64_t kPointwiseGrain = 16384;

template <typename F>
inline void parallel_rows(int64_t rows, int64_t row_floats, const F& row) {
  const int64_t grain = std::max<int64_t>(1, kPointwiseGrain / std::max<int64_t>(1, row_floats));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(r);
  });
}

// out[:dim] = w * (in * (1 / sqrt(mean(in^2) + eps))), the reference's order (without w where it is null)
inline void normalize_row(const float* in, const float* w, float eps, float* out, int64_t dim) {
  const float squares =
      at::vec::map_reduce_all<float>([](Vec v) { return v * v; }, [](Vec& a, Vec& b) { return a + b; }, in, dim);
  const float inverse = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
  if (w == nullptr)
    at::vec::map([inverse](Vec v) { return v * Vec(inverse); }, out, in, dim);
  else
    at::vec::map2([inverse](Vec v, Vec weight) { return weight * (v * Vec(inverse)); }, out, in, w, dim);
}

void rms_norm(const float* x, int64_t ld_x, const float* w, float eps, float* y, int64_t rows, int64_t dim) {
  parallel_rows(rows, dim, [&](int64_t r) { normalize_row(x + r * ld_x, w, eps, y + r * dim, dim); });
}

void add_rms_norm(const float* a, int64_t ld_a, const float* b, int64_t ld_b, const float* w, float eps, float* sum,
                  float* y, int64_t rows, int64_t dim) {
  parallel_rows(rows, dim, [&](int64_t r) {
    float* row = sum + r * dim;  // written, then normalized from L1
    at::vec::map2([](Vec x, Vec residual) { return x + residual; }, row, a + r * ld_a, b + r * ld_b, dim);
    normalize_row(row, w, eps, y + r * dim, dim);
  });
}

void silu_mul(const float* gate, int64_t ld_gate, const float* up, int64_t ld_up, float* y, int64_t rows, int64_t n) {
  parallel_rows(rows, n, [&](int64_t r) {
    // silu as torch's CPU kernel computes it: g / (1 + exp(-g))
    at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.f) + g.neg().exp_u20()) * u; }, y + r * n, gate + r * ld_gate,
                  up + r * ld_up, n);
  });
}

void rope(const float* x, int64_t ld_x, int64_t heads, int64_t head_dim, const float* cos, const float* sin,
          int64_t ld_cs, int64_t rot_dim, float* y, int64_t tokens) {
  const int64_t half = rot_dim / 2;
  parallel_rows(tokens, heads * head_dim, [&](int64_t t) {
    const float* c = cos + t * ld_cs;
    const float* s = sin + t * ld_cs;
    for (int64_t h = 0; h < heads; ++h) {
      const float* in = x + t * ld_x + h * head_dim;
      float* out = y + (t * heads + h) * head_dim;
      // rotate_half pairs feature i with i + half: x * cos + (-x[i + half], x[i]) * sin
      int64_t i = 0;
      for (; i + kLanes <= half; i += kLanes) {
        const Vec lo = Vec::loadu(in + i), hi = Vec::loadu(in + half + i);
        (lo * Vec::loadu(c + i) - hi * Vec::loadu(s + i)).store(out + i);
        (hi * Vec::loadu(c + half + i) + lo * Vec::loadu(s + half + i)).store(out + half + i);
      }
      for (; i < half; ++i) {
        out[i] = in[i] * c[i] - in[half + i] * s[i];
        out[half + i] = in[half + i] * c[half + i] + in[i] * s[half + i];
      }
      std::memcpy(out + rot_dim, in + rot_dim, (head_dim - rot_dim) * sizeof(float));
    }
  });
}

// ---- decode attention ----

// row[0:len] = softmax(row[0:len])
void softmax_in_place(float* row, int64_t len) {
  const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, len);
  at::vec::map([top](Vec v) { return (v - Vec(top)).exp_u20(); }, row, row, len);
  const float total = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, row, len);
  const float norm = 1.f / total;
  at::vec::map([norm](Vec v) { return v * Vec(norm); }, row, row, len);
}

// the cache row of position t of a sequence whose page table is `pages`
inline int64_t cache_row(const int64_t* pages, int64_t t, int64_t page_size) {
  return pages[t / page_size] * page_size + t % page_size;
}

inline const float* slot(const float* cache, const int64_t* pages, int64_t t, int64_t page_size, int64_t stride) {
  return cache + cache_row(pages, t, page_size) * stride;
}

// The run of positions from t (of [0, len) after `start`) that lie in one page: a page's positions are
// consecutive cache rows, so a division per page rather than per position (the value pass below)
struct PageRun {
  int64_t row;  // the cache row of position start + t
  int64_t n;  // positions in the run
};
inline PageRun page_run(const int64_t* pages, int64_t start, int64_t t, int64_t len, int64_t page_size) {
  const int64_t at = start + t;
  return {cache_row(pages, at, page_size), std::min(len - t, page_size - at % page_size)};
}

// The kv heads [h0, h1) of one sequence: their query heads (q, os: the sequence's [n_heads, head_dim] and [n_heads,
// v_dim]) over positions [start, start + len). A position's keys of those heads lie side by side in the cache,
// so the scores read one contiguous run per position, not one run per head with the other heads' between.
// HEAD and V are the head sizes when known at compile time (0: read head_dim, v_dim), so the common sizes get
// loops of constant length whose value accumulators stay in registers.
template <int64_t HEAD, int64_t V>
void attend(const float* q, const float* k_cache, const float* v_cache, const int64_t* pages, float* os,
            float* scores, int64_t start, int64_t len, int64_t groups, int64_t h0, int64_t h1, int64_t n_kv,
            int64_t page_size, float scale, int64_t head_dim, int64_t v_dim) {
  if constexpr (HEAD > 0) head_dim = HEAD;
  if constexpr (V > 0) v_dim = V;
  const int64_t first = h0 * groups, heads = (h1 - h0) * groups;  // the item's query heads
  // the scores of P positions from t: each query head's dots with them in P chains of multiply-adds, side by side
  // (one chain a dot waited on each multiply-add's latency); each dot sums its lanes in the same order either way
  auto score = [&](int64_t t, auto positions) {
    constexpr int P = decltype(positions)::value;
    const float* keys[P];
    for (int p = 0; p < P; ++p) keys[p] = slot(k_cache, pages, start + t + p, page_size, n_kv * head_dim);
    for (int64_t hk = h0, j = 0; hk < h1; ++hk) {
      for (int64_t g = 0; g < groups; ++g, ++j) {  // j: the item's query head
        const float* qj = q + (first + j) * head_dim;
        const float* key[P];
        Vec dot[P];
        for (int p = 0; p < P; ++p) {
          key[p] = keys[p] + hk * head_dim;
          dot[p] = Vec::loadu(qj) * Vec::loadu(key[p]);
        }
        for (int64_t d = kLanes; d < head_dim; d += kLanes) {
          const Vec qd = Vec::loadu(qj + d);
          for (int p = 0; p < P; ++p) dot[p] = at::vec::fmadd(qd, Vec::loadu(key[p] + d), dot[p]);
        }
        for (int p = 0; p < P; ++p) scores[j * len + t + p] = sum_lanes(dot[p]) * scale;
      }
    }
  };
  constexpr int kScorePositions = 4;
  int64_t t = 0;
  for (; t + kScorePositions <= len; t += kScorePositions) score(t, std::integral_constant<int, kScorePositions>{});
  for (; t < len; ++t) score(t, std::integral_constant<int, 1>{});
  for (int64_t j = 0; j < heads; ++j) softmax_in_place(scores + j * len, len);
  if (h1 - h0 == n_kv) {
    // a whole sequence: its values position by position, each row read once for all the query heads and summed
    // into their output rows in place (in L1). Each output still adds its positions in order, from zero. (For
    // fewer heads the rows are short, and the register sums below are faster: 0.84x at 4 sequences, AVX2)
    float* rows = os + first * v_dim;
    std::fill(rows, rows + heads * v_dim, 0.f);
    for (int64_t t = 0; t < len; ++t) {
      const float* values = slot(v_cache, pages, start + t, page_size, n_kv * v_dim);
      for (int64_t hk = h0, j = 0; hk < h1; ++hk) {
        const float* value = values + hk * v_dim;
        for (int64_t g = 0; g < groups; ++g, ++j) {
          const Vec weight(scores[j * len + t]);
          float* row = rows + j * v_dim;
          for (int64_t d = 0; d < v_dim; d += kLanes)
            at::vec::fmadd(weight, Vec::loadu(value + d), Vec::loadu(row + d)).store(row + d);
        }
      }
    }
    return;
  }
  constexpr int64_t kMaxChunks = 256 / kLanes;  // value accumulators for up to 256 dims per pass
  for (int64_t j = 0; j < heads; ++j) {
    const float* weights = scores + j * len;
    const int64_t hk = h0 + j / groups;
    for (int64_t c0 = 0; c0 < v_dim; c0 += kMaxChunks * kLanes) {
      const int64_t chunks = std::min(kMaxChunks, (v_dim - c0) / kLanes);
      Vec acc[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) acc[c] = Vec(0.f);
      // a page at a time: without a division per position and query head, one sequence's attention ran 1.10x
      // (AVX2). The scores and the whole-sequence pass keep theirs: without, 16 sequences at 1000 positions ran 0.91x
      for (int64_t t0 = 0; t0 < len;) {
        const PageRun run = page_run(pages, start, t0, len, page_size);
        const float* values = v_cache + run.row * n_kv * v_dim + hk * v_dim + c0;
        for (int64_t i = 0; i < run.n; ++i) {
          const float* value = values + i * n_kv * v_dim;
          const Vec weight(weights[t0 + i]);
          for (int64_t c = 0; c < chunks; ++c) acc[c] = at::vec::fmadd(weight, Vec::loadu(value + c * kLanes), acc[c]);
        }
        t0 += run.n;
      }
      for (int64_t c = 0; c < chunks; ++c) acc[c].store(os + (first + j) * v_dim + c0 + c * kLanes);
    }
  }
}

int decode_attention(const float* q, const float* k_cache, const float* v_cache, const int64_t* input_pos,
                     const int64_t* page_table, float* out, int64_t num_seqs, int64_t n_heads, int64_t n_kv,
                     int64_t head_dim, int64_t v_dim, int64_t num_pages, int64_t page_size, int64_t table_width,
                     float scale, int64_t window) {
  const int64_t groups = n_heads / n_kv;
  // the page table is checked up front: the kernel reads the cache at the pages it names
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t pos = input_pos[s];
    if (pos < 0 || pos / page_size >= table_width) return -1;
    for (int64_t p = 0; p <= pos / page_size; ++p) {
      const int64_t page = page_table[s * table_width + p];
      if (page < 0 || page >= num_pages) return -1;
    }
  }
  // work items: whole sequences where there are enough of them to share among the threads (4 a thread), else
  // (sequence, kv head) pairs. Blocks of 2 kv heads at 4 sequences ran 0.87x single heads (AVX2, Zen 4)
  const bool whole = num_seqs >= 4 * at::get_num_threads();
  const int64_t per_seq = whole ? 1 : n_kv;  // items per sequence
  std::atomic<int> status{0};
  at::parallel_for(0, num_seqs * per_seq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / per_seq, h0 = whole ? 0 : item % n_kv, h1 = whole ? n_kv : h0 + 1;
      const int64_t pos = input_pos[s];
      const int64_t start = window > 0 && pos + 1 > window ? pos + 1 - window : 0, len = pos + 1 - start;
      const Scratch<float> scores = scratch<float>((h1 - h0) * groups * len);
      if (!scores) {
        status = -2;
        continue;
      }
      const float* qs = q + s * n_heads * head_dim;
      const int64_t* pages = page_table + s * table_width;
      float* os = out + s * n_heads * v_dim;
      if (head_dim == 64 && v_dim == 64)
        attend<64, 64>(qs, k_cache, v_cache, pages, os, scores.get(), start, len, groups, h0, h1, n_kv, page_size,
                       scale, 0, 0);
      else if (head_dim == 128 && v_dim == 128)
        attend<128, 128>(qs, k_cache, v_cache, pages, os, scores.get(), start, len, groups, h0, h1, n_kv,
                         page_size, scale, 0, 0);
      else
        attend<0, 0>(qs, k_cache, v_cache, pages, os, scores.get(), start, len, groups, h0, h1, n_kv, page_size,
                     scale, head_dim, v_dim);
    }
  });
  return status;
}

// ---- prompt attention: a fresh sequence over its own keys, causal ----
// Work items are (kv head, block of kAttnRows positions), a kv head's blocks in a row in the order 0, last, 1,
// last - 1, ..., so that at::parallel_for's contiguous ranges hold about as many keys each. A thread transposes a
// kv head's keys once, extending them as its blocks reach further (a query's scores are then kLanes keys a
// multiply-add), and for each block takes the queries of every head of the group: their scores, the softmax over
// the keys up to each position, and the weighted values.
constexpr int64_t kAttnRows = 16;

// scores[i][0:len) = scale * q_i . kt[:, 0:len) for ROWS query rows (len a multiple of kLanes)
template <int ROWS>
inline void attention_scores(const float* const* qs, const float* kt, int64_t ld, int64_t head_dim, int64_t len,
                             float scale, float* scores, int64_t ld_scores) {
  for (int64_t j = 0; j < len; j += 2 * kLanes) {
    const bool pair = j + kLanes < len;
    Vec acc[ROWS][2];
    for (int i = 0; i < ROWS; ++i) acc[i][0] = acc[i][1] = Vec(0.f);
    for (int64_t d = 0; d < head_dim; ++d) {
      const Vec k0 = Vec::loadu(kt + d * ld + j), k1 = pair ? Vec::loadu(kt + d * ld + j + kLanes) : Vec(0.f);
      for (int i = 0; i < ROWS; ++i) {
        const Vec qd(qs[i][d]);
        acc[i][0] = at::vec::fmadd(qd, k0, acc[i][0]);
        acc[i][1] = at::vec::fmadd(qd, k1, acc[i][1]);
      }
    }
    for (int i = 0; i < ROWS; ++i) {
      (acc[i][0] * Vec(scale)).store(scores + i * ld_scores + j);
      if (pair) (acc[i][1] * Vec(scale)).store(scores + i * ld_scores + j + kLanes);
    }
  }
}

// out[i][c0:c0 + CHUNKS * kLanes) = sum_j weights[i][j] v_j[c0:...] over keys j < counts[i], for ROWS rows (the
// later rows' counts at least the first's); v_j at v + j * ld_v
template <int ROWS, int CHUNKS>
inline void weighted_values(const float* const* weights, const int64_t* counts, const float* v, int64_t ld_v,
                            float* const* out) {
  Vec acc[ROWS][CHUNKS];
  for (int i = 0; i < ROWS; ++i)
    for (int c = 0; c < CHUNKS; ++c) acc[i][c] = Vec(0.f);
  for (int64_t j = 0; j < counts[ROWS - 1]; ++j) {
    Vec value[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) value[c] = Vec::loadu(v + j * ld_v + c * kLanes);
    for (int i = 0; i < ROWS; ++i) {
      const Vec weight(j < counts[i] ? weights[i][j] : 0.f);
      for (int c = 0; c < CHUNKS; ++c) acc[i][c] = at::vec::fmadd(weight, value[c], acc[i][c]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int c = 0; c < CHUNKS; ++c) acc[i][c].store(out[i] + c * kLanes);
}

int prefill_attention(const float* q, const float* k, const float* v, float* out, int64_t T, int64_t n_heads,
                      int64_t n_kv, int64_t head_dim, int64_t v_dim, float scale) {
  const int64_t groups = n_heads / n_kv, blocks = (T + kAttnRows - 1) / kAttnRows;
  const int64_t ld = (T + kLanes - 1) / kLanes * kLanes;  // keys per row of the transposed keys and the scores
  // value vectors per pass of weighted_values: 2 rows x 4 accumulators and 4 values fit AVX2's 16 registers
  constexpr int kChunks = 4;
  std::atomic<int> status{0};
  at::parallel_for(0, n_kv * blocks, 1, [&](int64_t begin, int64_t end) {
    const Scratch<float> kt = scratch<float>(head_dim * ld), scores = scratch<float>(kAttnRows * ld);
    if (!kt || !scores) {
      status = -2;
      return;
    }
    int64_t head_transposed = -1, transposed = 0;  // kt holds keys [0, transposed) of kv head head_transposed
    for (int64_t item = begin; item < end; ++item) {
      const int64_t hk = item / blocks, i = item % blocks, b = i % 2 == 0 ? i / 2 : blocks - 1 - i / 2;
      const int64_t t0 = b * kAttnRows, t1 = std::min(T, t0 + kAttnRows);
      if (hk != head_transposed) {
        head_transposed = hk;
        transposed = 0;
      }
      for (int64_t d = 0; d < head_dim && t1 > transposed; ++d) {
        float* column = kt.get() + d * ld;
        for (int64_t j = transposed; j < t1; ++j) column[j] = k[(j * n_kv + hk) * head_dim + d];
        std::fill(column + t1, column + ld, 0.f);
      }
      transposed = std::max(transposed, t1);
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t head = hk * groups + g;
        for (int64_t t = t0; t < t1; t += 4) {
          const int rows = static_cast<int>(std::min<int64_t>(4, t1 - t));
          const float* qs[4];
          for (int r = 0; r < rows; ++r) qs[r] = q + ((t + r) * n_heads + head) * head_dim;
          const int64_t keys = (t + rows + kLanes - 1) / kLanes * kLanes;
          with_rows<4>(rows, [&](auto r) {
            attention_scores<decltype(r)::value>(qs, kt.get(), ld, head_dim, keys, scale,
                                                 scores.get() + (t - t0) * ld, ld);
          });
        }
        for (int64_t t = t0; t < t1; ++t) softmax_in_place(scores.get() + (t - t0) * ld, t + 1);
        for (int64_t t = t0; t < t1; t += 2) {  // two positions a pass share the values' loads
          const int rows = static_cast<int>(std::min<int64_t>(2, t1 - t));
          const float* weights[2] = {scores.get() + (t - t0) * ld, scores.get() + (t + rows - 1 - t0) * ld};
          const int64_t counts[2] = {t + 1, t + rows};
          for (int64_t c0 = 0; c0 < v_dim; c0 += kChunks * kLanes) {
            float* outs[2] = {out + (t * n_heads + head) * v_dim + c0, out + ((t + rows - 1) * n_heads + head) * v_dim + c0};
            const float* values = v + hk * v_dim + c0;
            const int chunks = static_cast<int>(std::min<int64_t>(kChunks, (v_dim - c0) / kLanes));
            with_rows<kChunks>(chunks, [&](auto c) {
              if (rows == 2)
                weighted_values<2, decltype(c)::value>(weights, counts, values, n_kv * v_dim, outs);
              else
                weighted_values<1, decltype(c)::value>(weights, counts, values, n_kv * v_dim, outs);
            });
          }
        }
      }
    }
  });
  return status;
}

#define AUTODEPLOY_STRINGIFY_(name) #name
#define AUTODEPLOY_STRINGIFY(name) AUTODEPLOY_STRINGIFY_(name)

const KernelTable kTable = {AUTODEPLOY_STRINGIFY(CPU_CAPABILITY), kLanes, kF32MaxRows, kGemmMaxRows, integer_vnni(),
                            f32_gemm, half_gemm, int8_gemm, int8_gemv, int8_split_rows, int8_split_rescale, bf16_split,
                            transpose32, int4_gemm, int4_widen, decode_attention, rms_norm, add_rms_norm, silu_mul,
                            rope, prefill_attention, kF32PackWidth, f32_packed_gemm, kHalfPackWidth, half_packed_gemm,
#if defined(AUTODEPLOY_PAIR_PRODUCTS)
                            kPackRows, int4_packed_gemm
#else
                            0, nullptr
#endif
};

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace autodeploy

#define AUTODEPLOY_TABLE_FN_(capability) autodeploy_kernels_##capability
#define AUTODEPLOY_TABLE_FN(capability) AUTODEPLOY_TABLE_FN_(capability)

extern "C" __attribute__((visibility("default"))) const autodeploy::KernelTable* AUTODEPLOY_TABLE_FN(CPU_CAPABILITY)() {
  return &autodeploy::CPU_CAPABILITY::kTable;
}
