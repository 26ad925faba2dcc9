// rope_pool_fused, Metal entry points (docs/kernel-abi.md): one dispatch rotates q and k and stores
// the rotated k and the unchanged v into the slot-indexed pools.
//
// Thread (p, t, g) of grid (head_dim/2, n_tokens, gq + gk): p < rotary_dims/2 is rotary pair p
// (cos/sin computed once, applied to the group's heads), p >= rotary_dims/2 copies two pass-through
// features; group g < gq covers q heads, the rest kv heads (k rotation, k and v pool stores).
// Shapes are function constants so the compiler specialises the index arithmetic per model.
// precise:: trigonometry: angles reach position * inv_freq ~ 1e5 rad at long contexts, where
// fast:: loses accuracy.
#include <metal_stdlib>
using namespace metal;

constant int N_Q_HEADS [[function_constant(0)]];
constant int N_KV_HEADS [[function_constant(1)]];
constant int HEAD_DIM [[function_constant(2)]];
constant int ROTARY_DIMS [[function_constant(3)]];
constant int TRADITIONAL [[function_constant(4)]];
constant int HEADS_PER_THREAD [[function_constant(5)]];
constant float POS_SCALE [[function_constant(6)]];
constant float MSCALE [[function_constant(7)]];

template <typename T>
[[kernel]] void rope_pool_fused(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    device T* q_out [[buffer(3)]],
    device T* k_out [[buffer(4)]],
    device T* k_pool [[buffer(5)]],
    device T* v_pool [[buffer(6)]],
    const device int* positions [[buffer(7)]],
    const device int* slots [[buffer(8)]],
    const device float* inv_freq [[buffer(9)]],
    constant int& n_tokens [[buffer(10)]],
    constant int& pool_size [[buffer(11)]],
    uint3 gid [[thread_position_in_grid]]) {
  const int p = int(gid.x);
  const int t = int(gid.y);
  const int g = int(gid.z);
  const int hpt = HEADS_PER_THREAD < 1 ? 1 : HEADS_PER_THREAD;
  const int gq = (N_Q_HEADS + hpt - 1) / hpt;
  const int gk = (N_KV_HEADS + hpt - 1) / hpt;
  if (p >= HEAD_DIM / 2 || t >= n_tokens || g >= gq + gk) {
    return;  // non-uniform grids: edge threadgroups run past the data
  }
  const bool is_q = g < gq;
  const int n_heads = is_q ? N_Q_HEADS : N_KV_HEADS;
  const int h0 = (is_q ? g : g - gq) * hpt;
  const int h1 = min(h0 + hpt, n_heads);
  const int half = ROTARY_DIMS / 2;
  const bool rotary = p < half;

  int a, b;
  float c = 1.0f, s = 0.0f;
  if (rotary) {
    a = TRADITIONAL ? 2 * p : p;
    b = TRADITIONAL ? 2 * p + 1 : p + half;
    const float angle = float(positions[t]) * POS_SCALE * inv_freq[p];
    c = precise::cos(angle);
    s = precise::sin(angle);
  } else {
    a = ROTARY_DIMS + 2 * (p - half);
    b = a + 1;
  }

  const int slot = is_q ? -1 : slots[t];
  const bool write = !is_q && slot >= 0 && slot < pool_size;  // never out of bounds
  const device T* in = is_q ? q : k;
  device T* out = is_q ? q_out : k_out;
  for (int h = h0; h < h1; ++h) {
    const int row = (t * n_heads + h) * HEAD_DIM;
    T ra, rb;
    if (rotary) {
      const float x1 = float(in[row + a]) * MSCALE;
      const float x2 = float(in[row + b]) * MSCALE;
      ra = T(x1 * c - x2 * s);
      rb = T(x1 * s + x2 * c);
    } else {
      ra = in[row + a];
      rb = in[row + b];
    }
    out[row + a] = ra;
    out[row + b] = rb;
    if (write) {
      const int dst = (slot * N_KV_HEADS + h) * HEAD_DIM;
      k_pool[dst + a] = ra;
      k_pool[dst + b] = rb;
      v_pool[dst + a] = v[row + a];
      v_pool[dst + b] = v[row + b];
    }
  }
}

#define INSTANTIATE(NAME, T)                                                            \
  template [[host_name(NAME)]] [[kernel]] void rope_pool_fused<T>(                      \
      const device T* q [[buffer(0)]], const device T* k [[buffer(1)]],                 \
      const device T* v [[buffer(2)]], device T* q_out [[buffer(3)]],                   \
      device T* k_out [[buffer(4)]], device T* k_pool [[buffer(5)]],                    \
      device T* v_pool [[buffer(6)]], const device int* positions [[buffer(7)]],        \
      const device int* slots [[buffer(8)]], const device float* inv_freq [[buffer(9)]],\
      constant int& n_tokens [[buffer(10)]], constant int& pool_size [[buffer(11)]],    \
      uint3 gid [[thread_position_in_grid]]);

INSTANTIATE("rope_pool_fused_f16", half)
INSTANTIATE("rope_pool_fused_bf16", bfloat)
INSTANTIATE("rope_pool_fused_f32", float)
