// mlx-lm's quantized KV rows on Metal (docs/kernel-abi.md, "Pool groups"): mx.quantize's affine mode
// with MLX's Metal rules (mlx/backend/metal/kernels/quantized.h affine_quantize: round() ties away from
// zero, the running maximum started at 0, IEEE division), so a stored row is bit for bit what
// mx.quantize gives on Metal. Reductions go through threadgroup memory, not SIMD-group functions, so
// tests/metal_emu runs them.
#pragma once
#include <metal_stdlib>
using namespace metal;

// Element offset of row (slot, h) of a pool member `width` wide: slot-major [S, H, W] (slot is the
// row), head-major [B, H, S, W] (slot = b * S + s). 64-bit: pools pass 2^31 elements.
inline long member_row(int slot, int h, int n_kv_heads, int pool_rows, int width, bool head_major) {
  if (!head_major) {
    return (long(slot) * n_kv_heads + h) * width;
  }
  const long b = long(slot) / pool_rows;
  const long s = long(slot) % pool_rows;
  return ((b * n_kv_heads + h) * pool_rows + s) * width;
}

// The formats the quantized kernels implement; any other launch writes nothing.
inline bool quant_format_ok(int bits, int group_size, int head_dim) {
  return (bits == 4 || bits == 8) && (group_size == 32 || group_size == 64 || group_size == 128) && head_dim > 0 &&
         head_dim <= 512 && head_dim % group_size == 0;
}

// One row (x[0, dim), fp32 in threadgroup memory) quantized by its 32 threads (`lane`) into
// words/scales/biases (the row's own, offsets applied): lane l owns features l * gs / 32 .. of each
// group (1, 2 or 4), the group's minimum and maximum reduce through red_min/red_max, the lanes of one
// word OR their bits through red_or (this row's 32 entries each). Every thread of the threadgroup
// calls it with the same dim and gs (barriers inside); only `live` rows compute and write.
template <typename S>
inline void quantize_row(threadgroup const float* x, int dim, int bits, int gs, device uint* words,
                         device S* scales, device S* biases, threadgroup float* red_min,
                         threadgroup float* red_max, threadgroup uint* red_or, int lane, bool live) {
  const float n_bins = float((1 << bits) - 1);
  const int per_lane = gs / 32;
  const int per_word = 32 / bits;
  const int lanes_per_word = per_word / per_lane;
  for (int g = 0; g < dim / gs; ++g) {
    const int first = g * gs + lane * per_lane;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float w_min = 3.40282347e+38f;  // as MLX's Metal kernel: the maximum starts at 0
    float w_max = 0.0f;
    for (int j = 0; j < per_lane && live; ++j) {
      v[j] = x[first + j];
      w_min = min(w_min, v[j]);
      w_max = max(w_max, v[j]);
    }
    red_min[lane] = w_min;
    red_max[lane] = w_max;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int stride = 16; stride > 0; stride /= 2) {
      if (lane < stride) {
        red_min[lane] = min(red_min[lane], red_min[lane + stride]);
        red_max[lane] = max(red_max[lane], red_max[lane + stride]);
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    w_min = red_min[0];
    w_max = red_max[0];
    uint part = 0;
    float scale = 0.0f;
    float bias = 0.0f;
    if (live) {
      scale = max(precise::divide(w_max - w_min, n_bins), 1e-7f);
      const bool side = abs(w_min) > abs(w_max);
      scale = side ? scale : -scale;
      const float edge = side ? w_min : w_max;
      const float q0 = round(precise::divide(edge, scale));
      const bool at_zero = q0 == 0.0f;
      scale = at_zero ? scale : precise::divide(edge, q0);
      bias = at_zero ? 0.0f : edge;
      for (int j = 0; j < per_lane; ++j) {
        // (x - bias) / scale >= 0 up to rounding; MLX's uint8 conversion leaves negatives undefined
        const float q = max(min(round(precise::divide(v[j] - bias, scale)), n_bins), 0.0f);
        part |= uint(q) << (bits * ((first + j) % per_word));
      }
    }
    red_or[lane] = part;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (live && lane % lanes_per_word == 0) {
      uint word = 0;
      for (int i = 0; i < lanes_per_word; ++i) {
        word |= red_or[lane + i];
      }
      words[first / per_word] = word;
    }
    if (live && lane == 0) {
      scales[g] = S(scale);
      biases[g] = S(bias);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the scratch is the next group's
  }
}
