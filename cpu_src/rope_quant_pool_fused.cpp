// rope_quant_pool_fused, CPU entry points (docs/kernel-abi.md): RoPE on q and k (after the per-head
// q/k RMSNorm when QK_NORM), then k (as returned in k_out) and v quantized into mlx-lm's quantized
// pools at their slots, bit for bit mx.quantize on the CPU, in one pass per token.
#include <cstdint>
#include <vector>

#include "aot_quant.h"
#include "aot_rope.h"

namespace {

template <typename A>
void run(void** args) {
  using aot_cpu::buffer;
  using aot_cpu::scalar;
  using T = typename A::storage;
  const T* q = buffer<const T>(args, 0);
  const T* k = buffer<const T>(args, 1);
  const T* v = buffer<const T>(args, 2);
  T* q_out = buffer<T>(args, 3);
  T* k_out = buffer<T>(args, 4);
  const auto kp = aot_cpu::quant_pool<A>(args, 5), vp = aot_cpu::quant_pool<A>(args, 8);
  const int32_t* positions = buffer<const int32_t>(args, 11);
  const int32_t* slots = buffer<const int32_t>(args, 12);
  const float* table = buffer<const float>(args, 13);
  const int n_tokens = scalar<int32_t>(args, 14);
  const int pool_size = scalar<int32_t>(args, 15);
  const int pool_rows = scalar<int32_t>(args, 16);
  const int n_q_heads = scalar<int32_t>(args, 17);
  const int n_kv_heads = scalar<int32_t>(args, 18);
  aot_cpu::NormRope p;
  p.head_dim = scalar<int32_t>(args, 19);
  p.rotary_dims = scalar<int32_t>(args, 20);
  p.traditional = scalar<int32_t>(args, 21) != 0;
  const bool head_major = scalar<int32_t>(args, 22) != 0;
  const float pos_scale = scalar<float>(args, 23);
  p.mscale = scalar<float>(args, 24);
  const bool qk_norm = scalar<int32_t>(args, 25) != 0;
  p.eps = scalar<float>(args, 26);
  p.weight_offset = scalar<float>(args, 27);
  const int bits = scalar<int32_t>(args, 28);
  const int group_size = scalar<int32_t>(args, 29);
  const int seq_len = scalar<int32_t>(args, 30);
  const int act_layout = scalar<int32_t>(args, 31);
  const int D = p.head_dim;
  // table: [q_weight (D) | k_weight (D) | inv_freq (rotary_dims / 2)] with QK_NORM, else [inv_freq]
  const float* q_weight = table;
  const float* k_weight = table + D;
  const float* inv_freq = qk_norm ? table + 2 * D : table;
  const aot_cpu::View vq = aot_cpu::view(args, 32, act_layout, seq_len), vk = aot_cpu::view(args, 33, act_layout, seq_len),
                      vv = aot_cpu::view(args, 34, act_layout, seq_len), vqo = aot_cpu::view(args, 35, act_layout, seq_len),
                      vko = aot_cpu::view(args, 36, act_layout, seq_len);
  const bool format_ok = (bits == 4 || bits == 8) && (group_size == 32 || group_size == 64 || group_size == 128) &&
                         D % group_size == 0;
  std::vector<T> scratch(D);
  std::vector<float> cs(p.rotary_dims / 2), sn(p.rotary_dims / 2), normed(D), row(D);
  // One head row of q or k into `out`: normalised first with QK_NORM, then rotated.
  auto rope = [&](const T* in, T* out, const float* weight) {
    if (qk_norm)
      aot_cpu::norm_rope_row<A>(in, out, weight, cs.data(), sn.data(), p, normed.data());
    else
      aot_cpu::rotate_row<A>(in, out, cs.data(), sn.data(), D, p.rotary_dims, p.traditional, p.mscale);
  };
  for (int t = 0; t < n_tokens; ++t) {
    aot_cpu::token_angles(positions[t], pos_scale, inv_freq, p.rotary_dims / 2, cs.data(), sn.data());
    for (int h = 0; h < n_q_heads; ++h) rope(aot_cpu::row_in(q, vq, t, h, D, scratch.data()), q_out + vqo.row(t, h), q_weight);
    const int slot = slots[t];
    // < 0: rotate only; >= pool_size: never written; head-major with no rows, or a format the kernel
    // does not implement (the wrapper never passes one): nothing
    const bool write = format_ok && slot >= 0 && slot < pool_size && (!head_major || pool_rows > 0);
    for (int h = 0; h < n_kv_heads; ++h) {
      T* ko = k_out + vko.row(t, h);
      rope(aot_cpu::row_in(k, vk, t, h, D, scratch.data()), ko, k_weight);
      if (!write) continue;
      aot_cpu::store_quantized<A, A>(ko, row.data(), kp, slot, h, n_kv_heads, pool_rows, D, bits, group_size, head_major);
      aot_cpu::store_quantized<A, A>(aot_cpu::row_in(v, vv, t, h, D, scratch.data()), row.data(), vp, slot, h, n_kv_heads,
                                     pool_rows, D, bits, group_size, head_major);
    }
  }
}

}  // namespace

AOT_EXPORT void rope_quant_pool_fused_f16(void** args) { run<aot_cpu::F16>(args); }
AOT_EXPORT void rope_quant_pool_fused_bf16(void** args) { run<aot_cpu::BF16>(args); }
AOT_EXPORT void rope_quant_pool_fused_f32(void** args) { run<aot_cpu::F32>(args); }
