// kv_quant_pool_store, CPU entry points (docs/kernel-abi.md): k and v rows quantized into mlx-lm's
// quantized pools (packed uint32 words, scales, biases) at their slots, bit for bit mx.quantize on the
// CPU. Built by `python -m build_tools compile --target cpu`.
#include <cstdint>
#include <vector>

#include "aot_quant.h"

namespace {

template <typename A>
void run(void** args) {
  using aot_cpu::buffer;
  using aot_cpu::scalar;
  using TA = typename A::storage;
  const TA* k = buffer<const TA>(args, 0);
  const TA* v = buffer<const TA>(args, 1);
  // The scales and biases have the activations' dtype (mlx-lm keeps them in the keys' dtype).
  const auto kp = aot_cpu::quant_pool<A>(args, 2), vp = aot_cpu::quant_pool<A>(args, 5);
  const int32_t* slots = buffer<const int32_t>(args, 8);
  const int n_tokens = scalar<int32_t>(args, 9);
  const int pool_size = scalar<int32_t>(args, 10);
  const int pool_rows = scalar<int32_t>(args, 11);
  const int n_kv_heads = scalar<int32_t>(args, 12);
  const int head_dim = scalar<int32_t>(args, 13);
  const bool head_major = scalar<int32_t>(args, 14) != 0;
  const int bits = scalar<int32_t>(args, 15);
  const int group_size = scalar<int32_t>(args, 16);
  const int seq_len = scalar<int32_t>(args, 17);
  const int act_layout = scalar<int32_t>(args, 18);
  const aot_cpu::View vk = aot_cpu::view(args, 19, act_layout, seq_len), vv = aot_cpu::view(args, 20, act_layout, seq_len);
  // A format the kernel does not implement writes nothing (the wrapper never passes one).
  if ((bits != 4 && bits != 8) || (group_size != 32 && group_size != 64 && group_size != 128) ||
      head_dim % group_size)
    return;
  std::vector<TA> scratch(head_dim);
  std::vector<float> row(head_dim);
  for (int t = 0; t < n_tokens; ++t) {
    const int slot = slots[t];
    // < 0: skipped; >= pool_size: never written; head-major with no rows (inconsistent scalars): nothing
    if (slot < 0 || slot >= pool_size || (head_major && pool_rows < 1)) continue;
    for (int h = 0; h < n_kv_heads; ++h) {
      aot_cpu::store_quantized<A, A>(aot_cpu::row_in(k, vk, t, h, head_dim, scratch.data()), row.data(), kp, slot, h,
                                     n_kv_heads, pool_rows, head_dim, bits, group_size, head_major);
      aot_cpu::store_quantized<A, A>(aot_cpu::row_in(v, vv, t, h, head_dim, scratch.data()), row.data(), vp, slot, h,
                                     n_kv_heads, pool_rows, head_dim, bits, group_size, head_major);
    }
  }
}

}  // namespace

AOT_EXPORT void kv_quant_pool_store_f16(void** args) { run<aot_cpu::F16>(args); }
AOT_EXPORT void kv_quant_pool_store_bf16(void** args) { run<aot_cpu::BF16>(args); }
AOT_EXPORT void kv_quant_pool_store_f32(void** args) { run<aot_cpu::F32>(args); }
