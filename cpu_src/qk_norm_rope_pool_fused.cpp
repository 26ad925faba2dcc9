// qk_norm_rope_pool_fused, CPU entry points (docs/kernel-abi.md): per-head RMSNorm of q and k with
// their weights, RoPE, and k and v stored into the slot-indexed pools, in one pass per token.
#include <cmath>
#include <cstdint>
#include <vector>

#include "aot_cpu.h"
#include "aot_rope.h"

#define AOT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using aot_cpu::buffer;
using aot_cpu::scalar;

template <typename A, typename P>
void run(void** args) {
  using T = typename A::storage;
  using TP = typename P::storage;
  const T* q = buffer<const T>(args, 0);
  const T* k = buffer<const T>(args, 1);
  const T* v = buffer<const T>(args, 2);
  T* q_out = buffer<T>(args, 3);
  T* k_out = buffer<T>(args, 4);
  TP* k_pool = buffer<TP>(args, 5);
  TP* v_pool = buffer<TP>(args, 6);
  const int32_t* positions = buffer<const int32_t>(args, 7);
  const int32_t* slots = buffer<const int32_t>(args, 8);
  const float* table = buffer<const float>(args, 9);
  const int n_tokens = scalar<int32_t>(args, 10);
  const int pool_size = scalar<int32_t>(args, 11);
  const int pool_rows = scalar<int32_t>(args, 12);
  const int n_q_heads = scalar<int32_t>(args, 13);
  const int n_kv_heads = scalar<int32_t>(args, 14);
  aot_cpu::NormRope p;
  p.head_dim = scalar<int32_t>(args, 15);
  p.rotary_dims = scalar<int32_t>(args, 16);
  p.traditional = scalar<int32_t>(args, 17) != 0;
  const int pool_layout = scalar<int32_t>(args, 18);
  const float pos_scale = scalar<float>(args, 19);
  p.mscale = scalar<float>(args, 20);
  p.eps = scalar<float>(args, 21);
  p.weight_offset = scalar<float>(args, 22);
  const int seq_len = scalar<int32_t>(args, 23);
  const int act_layout = scalar<int32_t>(args, 24);
  // norm_rope_table: [q_weight (head_dim) | k_weight (head_dim) | inv_freq (rotary_dims / 2)], fp32
  const float* q_weight = table;
  const float* k_weight = table + p.head_dim;
  const float* inv_freq = table + 2 * p.head_dim;
  // Strided activations; q_out/k_out are the launcher's fresh row-contiguous arrays (unit feature stride).
  const aot_cpu::View vq = aot_cpu::view(args, 25, act_layout, seq_len), vk = aot_cpu::view(args, 26, act_layout, seq_len),
                      vv = aot_cpu::view(args, 27, act_layout, seq_len), vqo = aot_cpu::view(args, 28, act_layout, seq_len),
                      vko = aot_cpu::view(args, 29, act_layout, seq_len);
  std::vector<T> scratch(p.head_dim);

  const int half = p.rotary_dims / 2;
  std::vector<float> cs(half), sn(half), normed(p.head_dim);
  const size_t D = static_cast<size_t>(p.head_dim);
  for (int t = 0; t < n_tokens; ++t) {
    aot_cpu::token_angles(positions[t], pos_scale, inv_freq, half, cs.data(), sn.data());
    for (int h = 0; h < n_q_heads; ++h) {
      aot_cpu::norm_rope_row<A>(aot_cpu::row_in(q, vq, t, h, p.head_dim, scratch.data()), q_out + vqo.row(t, h), q_weight,
                       cs.data(), sn.data(), p, normed.data());
    }
    const int slot = slots[t];
    // < 0: no store; >= pool_size: never written; head-major with no rows (inconsistent scalars): nothing
    const bool write = slot >= 0 && slot < pool_size && (pool_layout == 0 || pool_rows > 0);
    const size_t b = write ? static_cast<size_t>(slot / pool_rows) : 0, s = write ? static_cast<size_t>(slot % pool_rows) : 0;
    for (int h = 0; h < n_kv_heads; ++h) {
      T* ko = k_out + vko.row(t, h);
      aot_cpu::norm_rope_row<A>(aot_cpu::row_in(k, vk, t, h, p.head_dim, scratch.data()), ko, k_weight, cs.data(), sn.data(),
                       p, normed.data());
      if (write) {
        const T* vr = aot_cpu::row_in(v, vv, t, h, p.head_dim, scratch.data());
        const size_t dst = pool_layout == 0 ? (static_cast<size_t>(slot) * n_kv_heads + h) * D
                                            : ((b * n_kv_heads + h) * pool_rows + s) * D;
        for (size_t i = 0; i < D; ++i) {
          k_pool[dst + i] = P::store(A::load(ko[i]));
          v_pool[dst + i] = P::store(A::load(vr[i]));
        }
      }
    }
  }
}

}  // namespace

#define QKN_ENTRY(NAME, A, P) \
  AOT_EXPORT void NAME(void** args) { run<aot_cpu::A, aot_cpu::P>(args); }

QKN_ENTRY(qk_norm_rope_pool_fused_f16, F16, F16)
QKN_ENTRY(qk_norm_rope_pool_fused_bf16, BF16, BF16)
QKN_ENTRY(qk_norm_rope_pool_fused_f32, F32, F32)
QKN_ENTRY(qk_norm_rope_pool_fused_f16_f32, F16, F32)
QKN_ENTRY(qk_norm_rope_pool_fused_bf16_f16, BF16, F16)
QKN_ENTRY(qk_norm_rope_pool_fused_bf16_f32, BF16, F32)
QKN_ENTRY(qk_norm_rope_pool_fused_f32_f16, F32, F16)
QKN_ENTRY(qk_norm_rope_pool_fused_f32_bf16, F32, BF16)
QKN_ENTRY(qk_norm_rope_pool_fused_f16_bf16, F16, BF16)
