// qk_norm_rope_pool_fused, Metal entry points (docs/kernel-abi.md): per-head RMSNorm of q and k with
// their weights, RoPE, and k and v stored into the slot-indexed pools, in one dispatch.
//
// Grid (32, rows, 1) with rows = n_tokens * (n_q_heads + n_kv_heads) (q rows first, then kv rows,
// token-major), threadgroups of (32, <= 8, 1): the 32 threads along x share one row (one head of
// one token) and own its feature pairs p = x, x + 32, ... < head_dim / 2 (rotary pairs, then
// pass-through pairs, as rope_pool_fused). Pass 1 sums the squares, reduced across the 32 threads in
// threadgroup memory; pass 2 normalises (fp32, one rounding to T, as the model's norm returns T),
// rotates in fp32 and stores. q, k, v, q_out and k_out are read and written through their element
// strides (docs/kernel-abi.md, "Strided buffers"): ACT_LAYOUT 0 [n_tokens, H, D], 1 [B, H, L, D]
// with token t = b * L + l.
//
// Checked on Linux by tests/metal_emu (docs/metal.md); compiled with -std=metal3.1 (bfloat).
#include <metal_stdlib>
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
constant float EPS [[function_constant(8)]];
constant float WEIGHT_OFFSET [[function_constant(9)]];
constant int ACT_LAYOUT [[function_constant(10)]];

// Element offset of (token t, head h, feature 0) of an activation with strides s (64-bit: an index
// times a stride can pass 2^31). seq_len < 1 cannot come from the wrapper; it reads as 1 rather than
// dividing by zero.
inline long act_row(int4 s, int t, int h, int seq_len) {
  if (ACT_LAYOUT != 0) {
    const int L = max(seq_len, 1);
    return long(t / L) * s.x + long(h) * s.y + long(t % L) * s.z;
  }
  return long(t) * s.y + long(h) * s.z;
}

template <typename T, typename P>
[[kernel]] void qk_norm_rope_pool_fused(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    device T* q_out [[buffer(3)]],
    device T* k_out [[buffer(4)]],
    device P* k_pool [[buffer(5)]],
    device P* v_pool [[buffer(6)]],
    const device int* positions [[buffer(7)]],
    const device int* slots [[buffer(8)]],
    const device float* norm_rope_table [[buffer(9)]],
    constant int& n_tokens [[buffer(10)]],
    constant int& pool_size [[buffer(11)]],
    constant int& pool_rows [[buffer(12)]],
    constant int& seq_len [[buffer(13)]],
    constant int4& q_strides [[buffer(14)]],
    constant int4& k_strides [[buffer(15)]],
    constant int4& v_strides [[buffer(16)]],
    constant int4& q_out_strides [[buffer(17)]],
    constant int4& k_out_strides [[buffer(18)]],
    uint3 gid [[thread_position_in_grid]],
    uint3 lid [[thread_position_in_threadgroup]]) {
  threadgroup float partial[256];
  const int lane = int(lid.x);
  const int heads = N_Q_HEADS + N_KV_HEADS;
  const long row_id = long(gid.y);
  // No early return: every thread of the group must reach the barriers.
  const bool live = lane < 32 && row_id < long(n_tokens) * heads;
  const int t = live ? int(row_id / heads) : 0;
  const int hh = live ? int(row_id - long(t) * heads) : 0;
  const bool is_q = hh < N_Q_HEADS;
  const int h = is_q ? hh : hh - N_Q_HEADS;
  // Activations through their strides: feature d of this row at in[d * fi], out[d * fo], v[d * fv].
  const int4 si = is_q ? q_strides : k_strides;
  const int4 so = is_q ? q_out_strides : k_out_strides;
  const device T* in = (is_q ? q : k) + act_row(si, t, h, seq_len);
  device T* out = (is_q ? q_out : k_out) + act_row(so, t, h, seq_len);
  const long fi = si.w, fo = so.w, fv = v_strides.w;
  // norm_rope_table: [q_weight (HEAD_DIM) | k_weight (HEAD_DIM) | inv_freq (ROTARY_DIMS / 2)], fp32
  const device float* w = norm_rope_table + (is_q ? 0 : HEAD_DIM);
  const device float* inv_freq = norm_rope_table + 2 * HEAD_DIM;
  const int half_rot = ROTARY_DIMS / 2;
  const int pairs = live ? HEAD_DIM / 2 : 0;
  const bool trad = TRADITIONAL != 0;

  float ss = 0.0f;
  for (int i = lane; i < pairs; i += 32) {
    const int a = i < half_rot ? (trad ? 2 * i : i) : ROTARY_DIMS + 2 * (i - half_rot);
    const int b = i < half_rot && !trad ? a + half_rot : a + 1;
    const float x1 = float(in[a * fi]);
    const float x2 = float(in[b * fi]);
    ss += x1 * x1 + x2 * x2;
  }
  const int base = int(lid.y) * 32;
  partial[base + lane] = ss;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int stride = 16; stride > 0; stride /= 2) {
    if (lane < stride) {
      partial[base + lane] += partial[base + lane + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (!live) {
    return;  // after the last barrier
  }
  const float r = rsqrt(partial[base] / float(HEAD_DIM) + EPS);

  const int slot = is_q ? -1 : slots[t];
  // q rows and slot < 0: no store; >= pool_size: never written; head-major without rows: nothing
  const bool store = slot >= 0 && slot < pool_size && (POOL_LAYOUT == 0 || pool_rows > 0);
  long dst = 0;
  if (store) {
    const long rows = long(pool_rows);
    const long b = long(slot) / rows;
    const long s = long(slot) % rows;
    dst = (POOL_LAYOUT == 0 ? long(slot) * N_KV_HEADS + h : (b * N_KV_HEADS + h) * rows + s) * HEAD_DIM;
  }
  const float pos = float(positions[t]) * POS_SCALE;
  for (int i = lane; i < pairs; i += 32) {
    const bool rotary = i < half_rot;
    const int a = rotary ? (trad ? 2 * i : i) : ROTARY_DIMS + 2 * (i - half_rot);
    const int b = rotary && !trad ? a + half_rot : a + 1;
    float y1 = float(T(float(in[a * fi]) * r * (w[a] + WEIGHT_OFFSET)));
    float y2 = float(T(float(in[b * fi]) * r * (w[b] + WEIGHT_OFFSET)));
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
    if (store) {
      k_pool[dst + a] = P(float(o1));
      k_pool[dst + b] = P(float(o2));
      const device T* vr = v + act_row(v_strides, t, h, seq_len);
      v_pool[dst + a] = P(float(vr[a * fv]));
      v_pool[dst + b] = P(float(vr[b * fv]));
    }
  }
}

#define INSTANTIATE(NAME, T, P)                                                                   \
  template [[host_name(NAME)]] [[kernel]] void qk_norm_rope_pool_fused<T, P>(                     \
      const device T* q [[buffer(0)]], const device T* k [[buffer(1)]],                           \
      const device T* v [[buffer(2)]], device T* q_out [[buffer(3)]],                             \
      device T* k_out [[buffer(4)]], device P* k_pool [[buffer(5)]],                              \
      device P* v_pool [[buffer(6)]], const device int* positions [[buffer(7)]],                  \
      const device int* slots [[buffer(8)]], const device float* norm_rope_table [[buffer(9)]],   \
      constant int& n_tokens [[buffer(10)]], constant int& pool_size [[buffer(11)]],              \
      constant int& pool_rows [[buffer(12)]], constant int& seq_len [[buffer(13)]],               \
      constant int4& q_strides [[buffer(14)]], constant int4& k_strides [[buffer(15)]],           \
      constant int4& v_strides [[buffer(16)]], constant int4& q_out_strides [[buffer(17)]],       \
      constant int4& k_out_strides [[buffer(18)]], uint3 gid [[thread_position_in_grid]],         \
      uint3 lid [[thread_position_in_threadgroup]]);

INSTANTIATE("qk_norm_rope_pool_fused_f16", half, half)
INSTANTIATE("qk_norm_rope_pool_fused_bf16", bfloat, bfloat)
INSTANTIATE("qk_norm_rope_pool_fused_f32", float, float)
INSTANTIATE("qk_norm_rope_pool_fused_f16_f32", half, float)
INSTANTIATE("qk_norm_rope_pool_fused_bf16_f16", bfloat, half)
INSTANTIATE("qk_norm_rope_pool_fused_bf16_f32", bfloat, float)
INSTANTIATE("qk_norm_rope_pool_fused_f32_f16", float, half)
INSTANTIATE("qk_norm_rope_pool_fused_f32_bf16", float, bfloat)
INSTANTIATE("qk_norm_rope_pool_fused_f16_bf16", half, bfloat)
