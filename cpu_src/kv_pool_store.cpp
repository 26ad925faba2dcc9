// kv_pool_store, CPU entry points (docs/kernel-abi.md): k and v rows into the slot-indexed pools,
// converted to the pools' dtype. Built by `python -m build_tools compile --target cpu`.
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "aot_cpu.h"

#define AOT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using aot_cpu::buffer;
using aot_cpu::scalar;

template <typename A, typename P>
inline void copy_row(const typename A::storage* in, typename P::storage* out, int n) {
  if constexpr (std::is_same_v<A, P>) {
    std::memcpy(out, in, sizeof(*in) * n);   // same dtype: bit for bit
  } else {
    for (int i = 0; i < n; ++i) out[i] = P::store(A::load(in[i]));
  }
}

template <typename A, typename P>
void run(void** args) {
  using TA = typename A::storage;
  using TP = typename P::storage;
  const TA* k = buffer<const TA>(args, 0);
  const TA* v = buffer<const TA>(args, 1);
  TP* k_pool = buffer<TP>(args, 2);
  TP* v_pool = buffer<TP>(args, 3);
  const int32_t* slots = buffer<const int32_t>(args, 4);
  const int n_tokens = scalar<int32_t>(args, 5);
  const int pool_size = scalar<int32_t>(args, 6);
  const int pool_rows = scalar<int32_t>(args, 7);
  const int n_kv_heads = scalar<int32_t>(args, 8);
  const int head_dim = scalar<int32_t>(args, 9);
  const int pool_layout = scalar<int32_t>(args, 10);
  // args[11] (vec_width) shapes CUDA launches only.
  const int seq_len = scalar<int32_t>(args, 12);
  const int act_layout = scalar<int32_t>(args, 13);
  const aot_cpu::View vk = aot_cpu::view(args, 14, act_layout, seq_len), vv = aot_cpu::view(args, 15, act_layout, seq_len);
  std::vector<TA> scratch(head_dim);
  const size_t D = static_cast<size_t>(head_dim);
  for (int t = 0; t < n_tokens; ++t) {
    const int slot = slots[t];
    // < 0: skipped; >= pool_size: never written; head-major with no rows (inconsistent scalars): nothing
    if (slot < 0 || slot >= pool_size || (pool_layout != 0 && pool_rows < 1)) continue;
    // Slot-major [S, H, D]: row (slot, h). Head-major [B, H, S, D]: b = slot / S, s = slot % S.
    const size_t b = static_cast<size_t>(slot / pool_rows), s = static_cast<size_t>(slot % pool_rows);
    for (int h = 0; h < n_kv_heads; ++h) {
      const size_t dst = pool_layout == 0 ? (static_cast<size_t>(slot) * n_kv_heads + h) * D
                                          : ((b * n_kv_heads + h) * pool_rows + s) * D;
      copy_row<A, P>(aot_cpu::row_in(k, vk, t, h, head_dim, scratch.data()), k_pool + dst, head_dim);
      copy_row<A, P>(aot_cpu::row_in(v, vv, t, h, head_dim, scratch.data()), v_pool + dst, head_dim);
    }
  }
}

}  // namespace

#define KV_ENTRY(NAME, A, P) \
  AOT_EXPORT void NAME(void** args) { run<aot_cpu::A, aot_cpu::P>(args); }

KV_ENTRY(kv_pool_store_f16, F16, F16)
KV_ENTRY(kv_pool_store_bf16, BF16, BF16)
KV_ENTRY(kv_pool_store_f32, F32, F32)
KV_ENTRY(kv_pool_store_f16_bf16, F16, BF16)
KV_ENTRY(kv_pool_store_f16_f32, F16, F32)
KV_ENTRY(kv_pool_store_bf16_f16, BF16, F16)
KV_ENTRY(kv_pool_store_bf16_f32, BF16, F32)
KV_ENTRY(kv_pool_store_f32_f16, F32, F16)
KV_ENTRY(kv_pool_store_f32_bf16, F32, BF16)
