// RoPE (and the q/k RMSNorm before it) on one head row, fp32 math with one rounding to the storage
// type: what rope_pool_fused, qk_norm_rope_pool_fused and rope_quant_pool_fused compute per row
// (docs/kernel-abi.md). C is a storage type of aot_cpu.h.
#pragma once
#include <cmath>
#include <cstring>

#include "aot_cpu.h"

namespace aot_cpu {

// cos/sin of one token's angles: float(position) * pos_scale * inv_freq[i], in that order.
inline void token_angles(int position, float pos_scale, const float* inv_freq, int half, float* cs, float* sn) {
  const float p = static_cast<float>(position) * pos_scale;
  for (int i = 0; i < half; ++i) {
    const float angle = p * inv_freq[i];
    cs[i] = std::cos(angle);
    sn[i] = std::sin(angle);
  }
}

// One head's row: the rotary pairs, then the pass-through tail copied bit for bit. Half-split and
// traditional pairing are separate loops so each walks memory linearly.
template <typename C>
void rotate_row(const typename C::storage* __restrict in, typename C::storage* __restrict out,
                const float* __restrict cs, const float* __restrict sn, int head_dim, int rotary_dims,
                bool traditional, float mscale) {
  const int half = rotary_dims / 2;
  if (traditional) {
    for (int i = 0; i < half; ++i) {
      const float x1 = C::load(in[2 * i]) * mscale;
      const float x2 = C::load(in[2 * i + 1]) * mscale;
      out[2 * i] = C::store(x1 * cs[i] - x2 * sn[i]);
      out[2 * i + 1] = C::store(x1 * sn[i] + x2 * cs[i]);
    }
  } else {
    for (int i = 0; i < half; ++i) {
      const float x1 = C::load(in[i]) * mscale;
      const float x2 = C::load(in[i + half]) * mscale;
      out[i] = C::store(x1 * cs[i] - x2 * sn[i]);
      out[i + half] = C::store(x1 * sn[i] + x2 * cs[i]);
    }
  }
  if (rotary_dims < head_dim)  // pass-through features: an exact copy
    std::memcpy(out + rotary_dims, in + rotary_dims, sizeof(*in) * (head_dim - rotary_dims));
}

struct NormRope {
  int head_dim, rotary_dims;
  bool traditional;
  float mscale, eps, weight_offset;
};

// One head's row: RMSNorm in fp32 rounded once to T (as the model's own norm returns T), then the
// rotation of the first rotary_dims features in fp32, rounded once more. `normed` is scratch.
template <typename C>
void norm_rope_row(const typename C::storage* __restrict in, typename C::storage* __restrict out,
                   const float* __restrict weight, const float* cs, const float* sn, const NormRope& p,
                   float* normed) {
  const int D = p.head_dim;
  float ss = 0.0f;
  for (int i = 0; i < D; ++i) {
    const float x = C::load(in[i]);
    ss += x * x;
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + p.eps);
  for (int i = 0; i < D; ++i)
    normed[i] = C::load(C::store(C::load(in[i]) * r * (weight[i] + p.weight_offset)));
  const int half = p.rotary_dims / 2;
  for (int i = 0; i < half; ++i) {
    const int a = p.traditional ? 2 * i : i;
    const int b = p.traditional ? 2 * i + 1 : i + half;
    const float x1 = normed[a] * p.mscale, x2 = normed[b] * p.mscale;
    out[a] = C::store(x1 * cs[i] - x2 * sn[i]);
    out[b] = C::store(x1 * sn[i] + x2 * cs[i]);
  }
  for (int i = p.rotary_dims; i < D; ++i) out[i] = C::store(normed[i]);  // exact: normed[i] is a T value
}

}  // namespace aot_cpu
