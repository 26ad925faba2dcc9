// rope_pool_fused, CPU entry points (docs/kernel-abi.md): RoPE on q and k, k and v stored into the
// slot-indexed pools (slot-major [S, Hkv, D] or head-major [B, Hkv, S, D]), in one pass per token.
// The pools may hold another float type than q/k/v: rows are converted on the store. Built by `python -m build_tools compile --target cpu`
// into a shared library that the MLX extension (csrc/) dlopens; args[i] points at argument i.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "aot_cpu.h"
#include "aot_rope.h"

#define AOT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using aot_cpu::BF16;
using aot_cpu::F16;
using aot_cpu::F32;

// Element offset of pool row (slot, h). Slot-major [S, Hkv, D]: slot is the row. Head-major
// [B, Hkv, S, D] (mlx-lm's KVCache): slot = b * S + s. 64-bit: pools can exceed 2^31 elements.
inline size_t pool_offset(int slot, int h, int n_kv_heads, int pool_rows, int head_dim, bool head_major) {
  if (!head_major) return (static_cast<size_t>(slot) * n_kv_heads + h) * head_dim;
  const int b = slot / pool_rows, s = slot % pool_rows;
  return ((static_cast<size_t>(b) * n_kv_heads + h) * pool_rows + s) * head_dim;
}

// One head row into the pool: a copy when the pool has the activations' type, else each element
// converted (the value k_out/v hold, rounded once more to the pool's type).
template <typename C, typename P>
void store_row(typename P::storage* __restrict dst, const typename C::storage* __restrict src, int n) {
  if constexpr (std::is_same_v<C, P>) {
    std::memcpy(dst, src, sizeof(*src) * n);
  } else {
    for (int i = 0; i < n; ++i) dst[i] = P::store(C::load(src[i]));
  }
}

template <typename C, typename P = C>
void run(void** args) {
  using T = typename C::storage;
  using TP = typename P::storage;
  const T* q = *static_cast<const T**>(args[0]);
  const T* k = *static_cast<const T**>(args[1]);
  const T* v = *static_cast<const T**>(args[2]);
  T* q_out = *static_cast<T**>(args[3]);
  T* k_out = *static_cast<T**>(args[4]);
  TP* k_pool = *static_cast<TP**>(args[5]);
  TP* v_pool = *static_cast<TP**>(args[6]);
  const int32_t* positions = *static_cast<const int32_t**>(args[7]);
  const int32_t* slots = *static_cast<const int32_t**>(args[8]);
  const float* inv_freq = *static_cast<const float**>(args[9]);
  const int n_tokens = *static_cast<const int32_t*>(args[10]);
  const int pool_size = *static_cast<const int32_t*>(args[11]);
  const int pool_rows = *static_cast<const int32_t*>(args[12]);
  const int n_q_heads = *static_cast<const int32_t*>(args[13]);
  const int n_kv_heads = *static_cast<const int32_t*>(args[14]);
  const int head_dim = *static_cast<const int32_t*>(args[15]);
  const int rotary_dims = *static_cast<const int32_t*>(args[16]);
  const bool traditional = *static_cast<const int32_t*>(args[17]) != 0;
  // args[18] (heads_per_thread) shapes GPU launches only.
  const float pos_scale = *static_cast<const float*>(args[19]);
  const float mscale = *static_cast<const float*>(args[20]);
  const bool head_major = *static_cast<const int32_t*>(args[21]) != 0;
  // args[22] (vec_width) shapes CUDA launches only.
  const int seq_len = *static_cast<const int32_t*>(args[23]);
  const int act_layout = *static_cast<const int32_t*>(args[24]);
  // Strided activations; q_out/k_out are the launcher's fresh row-contiguous arrays (unit feature stride).
  const aot_cpu::View vq = aot_cpu::view(args, 25, act_layout, seq_len), vk = aot_cpu::view(args, 26, act_layout, seq_len),
                      vv = aot_cpu::view(args, 27, act_layout, seq_len), vqo = aot_cpu::view(args, 28, act_layout, seq_len),
                      vko = aot_cpu::view(args, 29, act_layout, seq_len);
  std::vector<T> scratch(head_dim);

  const int half = rotary_dims / 2;
  std::vector<float> cs(half), sn(half);
  for (int t = 0; t < n_tokens; ++t) {
    // cos/sin once per (token, pair), shared by every q and k head of the token.
    aot_cpu::token_angles(positions[t], pos_scale, inv_freq, half, cs.data(), sn.data());
    for (int h = 0; h < n_q_heads; ++h) {
      aot_cpu::rotate_row<C>(aot_cpu::row_in(q, vq, t, h, head_dim, scratch.data()), q_out + vqo.row(t, h),
                             cs.data(), sn.data(), head_dim, rotary_dims, traditional, mscale);
    }
    const int slot = slots[t];
    // slot < 0: rotate only; >= pool_size: never written (nor with no rows to divide by).
    const bool write = slot >= 0 && slot < pool_size && (!head_major || pool_rows > 0);
    for (int h = 0; h < n_kv_heads; ++h) {
      T* ko = k_out + vko.row(t, h);
      aot_cpu::rotate_row<C>(aot_cpu::row_in(k, vk, t, h, head_dim, scratch.data()), ko, cs.data(), sn.data(), head_dim,
                    rotary_dims, traditional, mscale);
      if (write) {
        const size_t dst = pool_offset(slot, h, n_kv_heads, pool_rows, head_dim, head_major);
        store_row<C, P>(k_pool + dst, ko, head_dim);
        store_row<C, P>(v_pool + dst, aot_cpu::row_in(v, vv, t, h, head_dim, scratch.data()), head_dim);
      }
    }
  }
}

}  // namespace

// Entries: rope_pool_fused_<act> (pools of the same type) and rope_pool_fused_<act>_<pool>.
AOT_EXPORT void rope_pool_fused_f16(void** args) { run<F16>(args); }
AOT_EXPORT void rope_pool_fused_bf16(void** args) { run<BF16>(args); }
AOT_EXPORT void rope_pool_fused_f32(void** args) { run<F32>(args); }
AOT_EXPORT void rope_pool_fused_f16_bf16(void** args) { run<F16, BF16>(args); }
AOT_EXPORT void rope_pool_fused_f16_f32(void** args) { run<F16, F32>(args); }
AOT_EXPORT void rope_pool_fused_bf16_f16(void** args) { run<BF16, F16>(args); }
AOT_EXPORT void rope_pool_fused_bf16_f32(void** args) { run<BF16, F32>(args); }
AOT_EXPORT void rope_pool_fused_f32_f16(void** args) { run<F32, F16>(args); }
AOT_EXPORT void rope_pool_fused_f32_bf16(void** args) { run<F32, BF16>(args); }
