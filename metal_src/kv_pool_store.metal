// kv_pool_store, Metal entry points (docs/kernel-abi.md): k and v rows into the slot-indexed pools,
// converted to the pools' dtype. Thread (d, h, t) of grid (head_dim, n_kv_heads, n_tokens) copies
// feature d of head h of token t; consecutive threads along x touch consecutive features of a row.
// k and v are read through their element strides (docs/kernel-abi.md, "Strided buffers"): ACT_LAYOUT
// 0 [n_tokens, H, D], 1 [B, H, L, D] with token t = b * L + l.
//
// Checked on Linux by tests/metal_emu (docs/metal.md); compiled with -std=metal3.1 (bfloat).
#include <metal_stdlib>
using namespace metal;

// Function constants: kernels.yaml's specialised scalars in order (int32 -> int, as the launcher
// passes them). VEC_WIDTH shapes CUDA launches only; declared so the indices match the ABI.
constant int N_KV_HEADS [[function_constant(0)]];
constant int HEAD_DIM [[function_constant(1)]];
constant int POOL_LAYOUT [[function_constant(2)]];
constant int VEC_WIDTH [[function_constant(3)]];
constant int ACT_LAYOUT [[function_constant(4)]];

// Element offset of (token t, head h, feature d) of an activation with strides s (64-bit: an index
// times a stride can pass 2^31). seq_len < 1 cannot come from the wrapper; it reads as 1 rather than
// dividing by zero.
inline long act_offset(int4 s, int t, int h, int d, int seq_len) {
  if (ACT_LAYOUT != 0) {
    const int L = max(seq_len, 1);
    return long(t / L) * s.x + long(h) * s.y + long(t % L) * s.z + long(d) * s.w;
  }
  return long(t) * s.y + long(h) * s.z + long(d) * s.w;
}

template <typename A, typename P>
[[kernel]] void kv_pool_store(
    const device A* k [[buffer(0)]],
    const device A* v [[buffer(1)]],
    device P* k_pool [[buffer(2)]],
    device P* v_pool [[buffer(3)]],
    const device int* slots [[buffer(4)]],
    constant int& n_tokens [[buffer(5)]],
    constant int& pool_size [[buffer(6)]],
    constant int& pool_rows [[buffer(7)]],
    constant int& seq_len [[buffer(8)]],
    constant int4& k_strides [[buffer(9)]],
    constant int4& v_strides [[buffer(10)]],
    uint3 gid [[thread_position_in_grid]]) {
  const int d = int(gid.x);
  const int h = int(gid.y);
  const int t = int(gid.z);
  if (d >= HEAD_DIM || h >= N_KV_HEADS || t >= n_tokens) {
    return;  // non-uniform grids: edge threadgroups run past the data
  }
  const int slot = slots[t];
  if (slot < 0 || slot >= pool_size || (POOL_LAYOUT != 0 && pool_rows < 1)) {
    return;  // < 0: skipped; >= pool_size: never written; head-major without rows: nothing
  }
  // 64-bit offsets. Slot-major [S, H, D]: row (slot, h); head-major [B, H, S, D]: b = slot / S, s = slot % S.
  const long rows = long(pool_rows);
  const long b = long(slot) / rows;
  const long s = long(slot) % rows;
  const long dst = (POOL_LAYOUT == 0 ? (long(slot) * N_KV_HEADS + h) : ((b * N_KV_HEADS + h) * rows + s)) * HEAD_DIM + d;
  k_pool[dst] = P(float(k[act_offset(k_strides, t, h, d, seq_len)]));
  v_pool[dst] = P(float(v[act_offset(v_strides, t, h, d, seq_len)]));
}

#define INSTANTIATE(NAME, A, P)                                                              \
  template [[host_name(NAME)]] [[kernel]] void kv_pool_store<A, P>(                          \
      const device A* k [[buffer(0)]], const device A* v [[buffer(1)]],                      \
      device P* k_pool [[buffer(2)]], device P* v_pool [[buffer(3)]],                        \
      const device int* slots [[buffer(4)]], constant int& n_tokens [[buffer(5)]],           \
      constant int& pool_size [[buffer(6)]], constant int& pool_rows [[buffer(7)]],          \
      constant int& seq_len [[buffer(8)]], constant int4& k_strides [[buffer(9)]],           \
      constant int4& v_strides [[buffer(10)]], uint3 gid [[thread_position_in_grid]]);

INSTANTIATE("kv_pool_store_f16", half, half)
INSTANTIATE("kv_pool_store_bf16", bfloat, bfloat)
INSTANTIATE("kv_pool_store_f32", float, float)
INSTANTIATE("kv_pool_store_f16_bf16", half, bfloat)
INSTANTIATE("kv_pool_store_f16_f32", half, float)
INSTANTIATE("kv_pool_store_bf16_f16", bfloat, half)
INSTANTIATE("kv_pool_store_bf16_f32", bfloat, float)
INSTANTIATE("kv_pool_store_f32_f16", float, half)
INSTANTIATE("kv_pool_store_f32_bf16", float, bfloat)
