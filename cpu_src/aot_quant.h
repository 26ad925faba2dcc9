// mlx-lm's quantized KV rows on the CPU (docs/kernel-abi.md, "Pool groups"): mx.quantize's affine
// mode with MLX's CPU rules (ties to even, the group's own maximum), so a stored row is bit for bit
// what mx.quantize gives on the CPU; the pool-group addressing every quantized kernel shares.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "aot_cpu.h"

namespace aot_cpu {

// Element offset of row (slot, h) of a pool member `width` wide. Slot-major [S, H, W]: slot is the
// row; head-major [B, H, S, W] (mlx-lm's caches): slot = b * S + s. 64-bit: pools pass 2^31.
inline int64_t member_row(int slot, int h, int n_kv_heads, int pool_rows, int width, bool head_major) {
  if (!head_major) return (static_cast<int64_t>(slot) * n_kv_heads + h) * width;
  const int b = slot / pool_rows, s = slot % pool_rows;
  return ((static_cast<int64_t>(b) * n_kv_heads + h) * pool_rows + s) * width;
}

// One side's quantized pool group: the packed words and the scales/biases of storage S.
template <typename S>
struct QuantPool {
  uint32_t* words;
  typename S::storage* scales;
  typename S::storage* biases;
};

// The pool group whose words are argument i (then its scales and biases, of storage S).
template <typename S>
inline QuantPool<S> quant_pool(void** args, int i) {
  return {buffer<uint32_t>(args, i), buffer<typename S::storage>(args, i + 1), buffer<typename S::storage>(args, i + 2)};
}

// Quantize `dim` fp32 values into a pool row: dim * bits / 32 words, dim / gs scales and biases.
// MLX 0.32.4's CPU quantize (mlx/backend/cpu/quantized.cpp), operation for operation.
template <typename S>
inline void quantize_row(const float* x, int dim, int bits, int gs, uint32_t* words, typename S::storage* scales,
                         typename S::storage* biases) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;
  const int per_word = 32 / bits;
  for (int g = 0; g < dim / gs; ++g) {
    const float* w = x + static_cast<int64_t>(g) * gs;
    float w_min = std::numeric_limits<float>::infinity();
    float w_max = -w_min;
    for (int j = 0; j < gs; ++j) {
      w_max = std::max(w_max, w[j]);
      w_min = std::min(w_min, w[j]);
    }
    const bool side = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = side ? scale : -scale;
    const float edge = side ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0.0f;
    if (q0 != 0.0f) {
      scale = edge / q0;
      bias = edge;
    }
    uint32_t* out = words + static_cast<int64_t>(g) * gs / per_word;
    for (int j = 0; j < gs / per_word; ++j) {
      uint32_t word = 0;
      for (int k = 0; k < per_word; ++k) {
        float q = std::rint((w[j * per_word + k] - bias) / scale);
        q = std::min(std::max(q, 0.0f), n_bins);
        word |= static_cast<uint32_t>(q) << (k * bits);
      }
      out[j] = word;
    }
    scales[g] = S::store(scale);
    biases[g] = S::store(bias);
  }
}

// The fp32 values of a quantized row: q * scale + bias per feature (the stored scale and bias, fp32
// math with no rounding between: mx.dequantize rounds the result to the scales' type once more).
template <typename S>
inline void dequantize_row(const uint32_t* words, const typename S::storage* scales, const typename S::storage* biases,
                           int dim, int bits, int gs, float* out) {
  const int per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  for (int g = 0; g < dim / gs; ++g) {
    const float scale = S::load(scales[g]), bias = S::load(biases[g]);
    for (int d = g * gs; d < (g + 1) * gs; ++d) {
      const uint32_t q = (words[d / per_word] >> ((d % per_word) * bits)) & mask;
      out[d] = static_cast<float>(q) * scale + bias;
    }
  }
}

// A row of storage type A quantized into slot `slot`, head h of a pool group (every member's row).
template <typename A, typename S>
inline void store_quantized(const typename A::storage* row, float* scratch, const QuantPool<S>& pool, int slot, int h,
                            int n_kv_heads, int pool_rows, int head_dim, int bits, int gs, bool head_major) {
  for (int i = 0; i < head_dim; ++i) scratch[i] = A::load(row[i]);
  const int w = head_dim * bits / 32, g = head_dim / gs;
  quantize_row<S>(scratch, head_dim, bits, gs, pool.words + member_row(slot, h, n_kv_heads, pool_rows, w, head_major),
                  pool.scales + member_row(slot, h, n_kv_heads, pool_rows, g, head_major),
                  pool.biases + member_row(slot, h, n_kv_heads, pool_rows, g, head_major));
}

}  // namespace aot_cpu
