// mlx-lm's quantized KV rows on CUDA (docs/kernel-abi.md, "Pool groups"): mx.quantize's affine mode
// with MLX's CUDA rules (mlx/backend/cuda/quantized/affine_quantize.cu: round() ties away from zero,
// the running maximum started at 0), so a stored row is bit for bit what mx.quantize gives on CUDA;
// the pool-group addressing the quantized kernels share.
#pragma once
#include <float.h>
#include <stdint.h>

#include "aot_cuda.cuh"

namespace aot_cuda {

constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kMaxQuantDim = 512;   // a row staged in shared memory per warp (the manifest's requires)
constexpr int kQuantRowsPerBlock = 8;   // warps (rows) per 256-thread block: the wrappers' ROWS_PER_GROUP

// The formats the quantized kernels implement; any other launches write nothing.
__host__ __device__ __forceinline__ bool quant_format_ok(int bits, int group_size, int head_dim) {
  return (bits == 4 || bits == 8) && (group_size == 32 || group_size == 64 || group_size == 128) &&
         head_dim > 0 && head_dim <= kMaxQuantDim && head_dim % group_size == 0;
}

// Element offset of row (slot, h) of a pool member `width` wide: slot-major [S, H, W] (slot is the
// row), head-major [B, H, S, W] (slot = b * S + s). 64-bit: pools pass 2^31 elements.
__device__ __forceinline__ long long member_row(int slot, int h, int n_kv_heads, int pool_rows, int width,
                                                bool head_major) {
  if (!head_major) return (static_cast<long long>(slot) * n_kv_heads + h) * width;
  const long long b = slot / pool_rows, s = slot % pool_rows;
  return ((b * n_kv_heads + h) * pool_rows + s) * width;
}

// One side's quantized pool group: packed words, scales and biases of type S.
template <typename S>
struct QuantPool {
  uint32_t* words;
  S* scales;
  S* biases;
};

// One warp quantizes the row x[0, dim) (fp32, memory the whole warp reads: staged by it) into row
// (slot, h) of `pool`: lane l owns features l * gs / 32 .. of each group (1, 2 or 4 of them), the
// group's minimum and maximum are warp reductions, and the lanes of one word OR their bits together.
// Every lane of the warp must call it (shuffles).
template <typename S>
__device__ void quantize_row_warp(const float* x, int dim, int bits, int gs, const QuantPool<S>& pool, int slot,
                                  int h, int n_kv_heads, int pool_rows, bool head_major, int lane) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;
  const int per_lane = gs / 32;
  const int per_word = 32 / bits;
  const int lanes_per_word = per_word / per_lane;   // 1..8: the group's lanes tile its words exactly
  uint32_t* words = pool.words + member_row(slot, h, n_kv_heads, pool_rows, dim * bits / 32, head_major);
  const long long sb = member_row(slot, h, n_kv_heads, pool_rows, dim / gs, head_major);
  for (int g = 0; g < dim / gs; ++g) {
    const int first = g * gs + lane * per_lane;
    float v[4];
    float w_min = FLT_MAX, w_max = 0.0f;   // as MLX's CUDA kernel: the maximum starts at 0
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < per_lane) {
        v[j] = x[first + j];
        w_min = fminf(w_min, v[j]);
        w_max = fmaxf(w_max, v[j]);
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) {
      w_min = fminf(w_min, __shfl_xor_sync(kFullWarp, w_min, off));
      w_max = fmaxf(w_max, __shfl_xor_sync(kFullWarp, w_max, off));
    }
    float scale = fmaxf((w_max - w_min) / n_bins, eps);
    const bool side = fabsf(w_min) > fabsf(w_max);
    scale = side ? scale : -scale;
    const float edge = side ? w_min : w_max;
    const float q0 = roundf(edge / scale);
    const bool at_zero = q0 == 0.0f;
    scale = at_zero ? scale : edge / q0;
    const float bias = at_zero ? 0.0f : edge;
    if (lane == 0) {
      pool.scales[sb + g] = Cvt<S>::store(scale);
      pool.biases[sb + g] = Cvt<S>::store(bias);
    }
    uint32_t part = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j < per_lane) {
        // (x - bias) / scale >= 0 up to rounding; MLX's uint8 conversion leaves negatives undefined
        const float q = fmaxf(fminf(roundf((v[j] - bias) / scale), n_bins), 0.0f);
        part |= static_cast<uint32_t>(q) << (bits * ((first + j) % per_word));
      }
    }
    for (int off = 1; off < lanes_per_word; off *= 2) part |= __shfl_xor_sync(kFullWarp, part, off);
    if (lane % lanes_per_word == 0) words[first / per_word] = part;
  }
}

}  // namespace aot_cuda
