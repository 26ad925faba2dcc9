// rope_quant_pool_fused, Metal entry points (docs/kernel-abi.md): RoPE on q and k (after their per-head
// RMSNorm when QK_NORM), then k (as returned in k_out) and v quantized into mlx-lm's quantized pools,
// bit for bit mx.quantize on Metal, in one dispatch.
//
// Grid (32, rows, 1) with rows = n_tokens * (n_q_heads + 2 * n_kv_heads) (q rows, then k rows, then
// v rows, token-major), threadgroups of (32, <= 8, 1): the 32 threads along x share one row and own
// its feature pairs p = x, x + 32, ... < head_dim / 2 (rotary pairs, then pass-through pairs, as
// rope_pool_fused). A q or k row is normalised (QK_NORM: fp32, one rounding to T, the sum of squares
// reduced in threadgroup memory), rotated in fp32 and rounded once to T into q_out / k_out; a k row's
// rounded values, or a v row, are staged in threadgroup memory and quantized (aot_quant.h).
// Activations are read and written through their element strides: ACT_LAYOUT 0 [n_tokens, H, D],
// 1 [B, H, L, D] with token t = b * L + l.
//
// Checked on Linux by tests/metal_emu (docs/metal.md); compiled with -std=metal3.1 (bfloat).
#include <metal_stdlib>
#include "aot_quant.h"
using namespace metal;

// Function constants: kernels.yaml's specialised scalars in order (int32 -> int, float32 -> float).
constant int N_Q_HEADS [[function_constant(0)]];
constant int N_KV_HEADS [[function_constant(1)]];
constant int HEAD_DIM [[function_constant(2)]];
constant int ROTARY_DIMS [[function_constant(3)]];
constant int TRADITIONAL [[function_constant(4)]];
constant int POOL_LAYOUT [[function_constant(5)]];
constant float POS_SCALE [[function_constant(6)]];
constant float MSCALE [[function_constant(7)]];
constant int QK_NORM [[function_constant(8)]];
constant float EPS [[function_constant(9)]];
constant float WEIGHT_OFFSET [[function_constant(10)]];
constant int BITS [[function_constant(11)]];
constant int GROUP_SIZE [[function_constant(12)]];
constant int ACT_LAYOUT [[function_constant(13)]];

inline long act_row(int4 s, int t, int h, int seq_len) {
  if (ACT_LAYOUT != 0) {
    const int L = max(seq_len, 1);
    return long(t / L) * s.x + long(h) * s.y + long(t % L) * s.z;
  }
  return long(t) * s.y + long(h) * s.z;
}

template <typename T>
[[kernel]] void rope_quant_pool_fused(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    device T* q_out [[buffer(3)]],
    device T* k_out [[buffer(4)]],
    device uint* k_pool [[buffer(5)]],
    device T* k_scales [[buffer(6)]],
    device T* k_biases [[buffer(7)]],
    device uint* v_pool [[buffer(8)]],
    device T* v_scales [[buffer(9)]],
    device T* v_biases [[buffer(10)]],
    const device int* positions [[buffer(11)]],
    const device int* slots [[buffer(12)]],
    const device float* table [[buffer(13)]],
    constant int& n_tokens [[buffer(14)]],
    constant int& pool_size [[buffer(15)]],
    constant int& pool_rows [[buffer(16)]],
    constant int& seq_len [[buffer(17)]],
    constant int4& q_strides [[buffer(18)]],
    constant int4& k_strides [[buffer(19)]],
    constant int4& v_strides [[buffer(20)]],
    constant int4& q_out_strides [[buffer(21)]],
    constant int4& k_out_strides [[buffer(22)]],
    uint3 gid [[thread_position_in_grid]],
    uint3 lid [[thread_position_in_threadgroup]]) {
  threadgroup float staged[8 * 512];
  threadgroup float red_min[8 * 32];
  threadgroup float red_max[8 * 32];
  threadgroup uint red_or[8 * 32];
  const int lane = int(lid.x) % 32;
  const int base = (int(lid.y) % 8) * 32;
  const int heads = N_Q_HEADS + 2 * N_KV_HEADS;
  const long row_id = long(gid.y);
  const bool format_ok = quant_format_ok(BITS, GROUP_SIZE, HEAD_DIM) && HEAD_DIM % 2 == 0 && ROTARY_DIMS <= HEAD_DIM;
  // No early return: every thread of the group must reach the barriers.
  const bool row_live = format_ok && int(lid.x) < 32 && row_id < long(n_tokens) * heads;
  const int t = row_live ? int(row_id / heads) : 0;
  const int hh = row_live ? int(row_id - long(t) * heads) : 0;
  const int kind = hh < N_Q_HEADS ? 0 : (hh < N_Q_HEADS + N_KV_HEADS ? 1 : 2);  // q, k, v
  const int h = kind == 0 ? hh : (kind == 1 ? hh - N_Q_HEADS : hh - N_Q_HEADS - N_KV_HEADS);
  const int slot = row_live && kind != 0 ? slots[t] : -1;
  // < 0: rotate only; >= pool_size: never written; head-major without rows: nothing
  const bool store = row_live && slot >= 0 && slot < pool_size && (POOL_LAYOUT == 0 || pool_rows > 0);
  threadgroup float* x = staged + (int(lid.y) % 8) * 512;
  const bool roped = row_live && kind != 2;
  const int4 si = kind == 0 ? q_strides : k_strides;
  const int4 so = kind == 0 ? q_out_strides : k_out_strides;
  const device T* in = (kind == 0 ? q : (kind == 1 ? k : v)) + (row_live ? act_row(kind == 2 ? v_strides : si, t, h,
                                                                                         seq_len) : 0);
  const long fi = kind == 2 ? v_strides.w : si.w;

  // The q/k norm's sum of squares, reduced in red_min (free until the quantization).
  float ss = 0.0f;
  for (int d = lane; d < HEAD_DIM && roped && QK_NORM != 0; d += 32) {
    const float xd = float(in[long(d) * fi]);
    ss += xd * xd;
  }
  red_min[base + lane] = ss;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int stride = 16; stride > 0; stride /= 2) {
    if (lane < stride) {
      red_min[base + lane] += red_min[base + lane + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float r = QK_NORM != 0 ? rsqrt(red_min[base] / float(HEAD_DIM) + EPS) : 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);  // red_min is the quantization's next

  if (roped) {
    device T* out = (kind == 0 ? q_out : k_out) + act_row(so, t, h, seq_len);
    const long fo = so.w;
    // table: [q_weight (HEAD_DIM) | k_weight (HEAD_DIM) | inv_freq (ROTARY_DIMS / 2)] with QK_NORM, else [inv_freq]
    const device float* w = table + (kind == 0 ? 0 : HEAD_DIM);
    const device float* inv_freq = QK_NORM != 0 ? table + 2 * HEAD_DIM : table;
    const float pos = float(positions[t]) * POS_SCALE;
    const int half_rot = ROTARY_DIMS / 2;
    const bool trad = TRADITIONAL != 0;
    for (int i = lane; i < HEAD_DIM / 2; i += 32) {
      const bool rotary = i < half_rot;
      const int a = rotary ? (trad ? 2 * i : i) : ROTARY_DIMS + 2 * (i - half_rot);
      const int b = rotary && !trad ? a + half_rot : a + 1;
      float y1 = float(in[a * fi]);
      float y2 = float(in[b * fi]);
      if (QK_NORM != 0) {
        y1 = float(T(y1 * r * (w[a] + WEIGHT_OFFSET)));
        y2 = float(T(y2 * r * (w[b] + WEIGHT_OFFSET)));
      }
      if (rotary) {
        // precise::, not fast:: (Metal's default for plain sin/cos): angles reach ~1e5 rad.
        float c;
        const float s = precise::sincos(pos * inv_freq[i], c);
        const float x1 = y1 * MSCALE;
        const float x2 = y2 * MSCALE;
        y1 = x1 * c - x2 * s;
        y2 = x1 * s + x2 * c;
      }
      const T o1 = T(y1);
      const T o2 = T(y2);
      out[a * fo] = o1;
      out[b * fo] = o2;
      if (kind == 1) {
        x[a] = float(o1);
        x[b] = float(o2);
      }
    }
  } else if (store) {
    for (int d = lane; d < HEAD_DIM; d += 32) {
      x[d] = float(in[long(d) * fi]);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const bool head_major = POOL_LAYOUT != 0;
  const long wr = store ? member_row(slot, h, N_KV_HEADS, pool_rows, HEAD_DIM * BITS / 32, head_major) : 0;
  const long gr = store ? member_row(slot, h, N_KV_HEADS, pool_rows, HEAD_DIM / GROUP_SIZE, head_major) : 0;
  quantize_row<T>(x, format_ok ? HEAD_DIM : 0, BITS, format_ok ? GROUP_SIZE : 32, (kind == 2 ? v_pool : k_pool) + wr,
                  (kind == 2 ? v_scales : k_scales) + gr, (kind == 2 ? v_biases : k_biases) + gr, red_min + base,
                  red_max + base, red_or + base, lane, store);
}

#define INSTANTIATE(NAME, T)                                                                          \
  template [[host_name(NAME)]] [[kernel]] void rope_quant_pool_fused<T>(                              \
      const device T* q [[buffer(0)]], const device T* k [[buffer(1)]],                              \
      const device T* v [[buffer(2)]], device T* q_out [[buffer(3)]],                                \
      device T* k_out [[buffer(4)]], device uint* k_pool [[buffer(5)]],                              \
      device T* k_scales [[buffer(6)]], device T* k_biases [[buffer(7)]],                            \
      device uint* v_pool [[buffer(8)]], device T* v_scales [[buffer(9)]],                           \
      device T* v_biases [[buffer(10)]], const device int* positions [[buffer(11)]],                 \
      const device int* slots [[buffer(12)]], const device float* table [[buffer(13)]],              \
      constant int& n_tokens [[buffer(14)]], constant int& pool_size [[buffer(15)]],                 \
      constant int& pool_rows [[buffer(16)]], constant int& seq_len [[buffer(17)]],                  \
      constant int4& q_strides [[buffer(18)]], constant int4& k_strides [[buffer(19)]],              \
      constant int4& v_strides [[buffer(20)]], constant int4& q_out_strides [[buffer(21)]],          \
      constant int4& k_out_strides [[buffer(22)]], uint3 gid [[thread_position_in_grid]],            \
      uint3 lid [[thread_position_in_threadgroup]]);

INSTANTIATE("rope_quant_pool_fused_f16", half)
INSTANTIATE("rope_quant_pool_fused_bf16", bfloat)
INSTANTIATE("rope_quant_pool_fused_f32", float)
