// kv_quant_pool_store, Metal entry points (docs/kernel-abi.md): k and v rows quantized into mlx-lm's
// quantized pools (packed uint32 words, scales, biases), bit for bit mx.quantize on Metal.
//
// Grid (32, rows, 1) with rows = n_tokens * 2 * n_kv_heads (row = (t * 2 + side) * H + h, side 0 k,
// 1 v), threadgroups of (32, <= 8, 1): the 32 threads along x stage one row in threadgroup memory
// (fp32) and quantize it (aot_quant.h). k and v are read through their element strides
// (docs/kernel-abi.md, "Strided buffers"): ACT_LAYOUT 0 [n_tokens, H, D], 1 [B, H, L, D] with token
// t = b * L + l.
//
// Checked on Linux by tests/metal_emu (docs/metal.md); compiled with -std=metal3.1 (bfloat).
#include <metal_stdlib>
#include "aot_quant.h"
using namespace metal;

// Function constants: kernels.yaml's specialised scalars in order (int32 -> int).
constant int N_KV_HEADS [[function_constant(0)]];
constant int HEAD_DIM [[function_constant(1)]];
constant int POOL_LAYOUT [[function_constant(2)]];
constant int BITS [[function_constant(3)]];
constant int GROUP_SIZE [[function_constant(4)]];
constant int ACT_LAYOUT [[function_constant(5)]];

// Element offset of (token t, head h, feature 0) of an activation with strides s (64-bit). seq_len < 1
// cannot come from the wrapper; it reads as 1 rather than dividing by zero.
inline long act_row(int4 s, int t, int h, int seq_len) {
  if (ACT_LAYOUT != 0) {
    const int L = max(seq_len, 1);
    return long(t / L) * s.x + long(h) * s.y + long(t % L) * s.z;
  }
  return long(t) * s.y + long(h) * s.z;
}

template <typename T>
[[kernel]] void kv_quant_pool_store(
    const device T* k [[buffer(0)]],
    const device T* v [[buffer(1)]],
    device uint* k_pool [[buffer(2)]],
    device T* k_scales [[buffer(3)]],
    device T* k_biases [[buffer(4)]],
    device uint* v_pool [[buffer(5)]],
    device T* v_scales [[buffer(6)]],
    device T* v_biases [[buffer(7)]],
    const device int* slots [[buffer(8)]],
    constant int& n_tokens [[buffer(9)]],
    constant int& pool_size [[buffer(10)]],
    constant int& pool_rows [[buffer(11)]],
    constant int& seq_len [[buffer(12)]],
    constant int4& k_strides [[buffer(13)]],
    constant int4& v_strides [[buffer(14)]],
    uint3 gid [[thread_position_in_grid]],
    uint3 lid [[thread_position_in_threadgroup]]) {
  threadgroup float staged[8 * 512];
  threadgroup float red_min[8 * 32];
  threadgroup float red_max[8 * 32];
  threadgroup uint red_or[8 * 32];
  const int lane = int(lid.x);
  const int ly = int(lid.y);
  const long row_id = long(gid.y);
  const bool format_ok = quant_format_ok(BITS, GROUP_SIZE, HEAD_DIM);
  // No early return: every thread of the group must reach the barriers.
  bool live = format_ok && lane < 32 && ly < 8 && row_id < long(n_tokens) * 2 * N_KV_HEADS;
  const int t = live ? int(row_id / (2 * N_KV_HEADS)) : 0;
  const int rest = live ? int(row_id - long(t) * 2 * N_KV_HEADS) : 0;
  const bool is_v = rest >= N_KV_HEADS;
  const int h = is_v ? rest - N_KV_HEADS : rest;
  const int slot = live ? slots[t] : -1;
  // < 0: skipped; >= pool_size: never written; head-major with no rows (inconsistent scalars): nothing
  live = live && slot >= 0 && slot < pool_size && (POOL_LAYOUT == 0 || pool_rows > 0);
  threadgroup float* x = staged + (ly % 8) * 512;
  if (live) {
    const int4 st = is_v ? v_strides : k_strides;
    const device T* in = (is_v ? v : k) + act_row(st, t, h, seq_len);
    for (int d = lane; d < HEAD_DIM; d += 32) {
      x[d] = float(in[long(d) * st.w]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const bool head_major = POOL_LAYOUT != 0;
  const long wr = live ? member_row(slot, h, N_KV_HEADS, pool_rows, HEAD_DIM * BITS / 32, head_major) : 0;
  const long gr = live ? member_row(slot, h, N_KV_HEADS, pool_rows, HEAD_DIM / GROUP_SIZE, head_major) : 0;
  const int base = (ly % 8) * 32;
  quantize_row<T>(x, format_ok ? HEAD_DIM : 0, BITS, format_ok ? GROUP_SIZE : 32, (is_v ? v_pool : k_pool) + wr,
                  (is_v ? v_scales : k_scales) + gr, (is_v ? v_biases : k_biases) + gr, red_min + base,
                  red_max + base, red_or + base, lane % 32, live);
}

#define INSTANTIATE(NAME, T)                                                                        \
  template [[host_name(NAME)]] [[kernel]] void kv_quant_pool_store<T>(                              \
      const device T* k [[buffer(0)]], const device T* v [[buffer(1)]],                            \
      device uint* k_pool [[buffer(2)]], device T* k_scales [[buffer(3)]],                         \
      device T* k_biases [[buffer(4)]], device uint* v_pool [[buffer(5)]],                         \
      device T* v_scales [[buffer(6)]], device T* v_biases [[buffer(7)]],                          \
      const device int* slots [[buffer(8)]], constant int& n_tokens [[buffer(9)]],                 \
      constant int& pool_size [[buffer(10)]], constant int& pool_rows [[buffer(11)]],              \
      constant int& seq_len [[buffer(12)]], constant int4& k_strides [[buffer(13)]],               \
      constant int4& v_strides [[buffer(14)]], uint3 gid [[thread_position_in_grid]],              \
      uint3 lid [[thread_position_in_threadgroup]]);

INSTANTIATE("kv_quant_pool_store_f16", half)
INSTANTIATE("kv_quant_pool_store_bf16", bfloat)
INSTANTIATE("kv_quant_pool_store_f32", float)
