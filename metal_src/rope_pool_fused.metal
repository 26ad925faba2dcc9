// rope_pool_fused, Metal entry points (docs/kernel-abi.md): one dispatch rotates q and k and stores
// the rotated k and the unchanged v into the slot-indexed pools: slot-major [S, Hkv, D] (POOL_LAYOUT
// 0) or head-major [B, Hkv, S, D] (1, mlx-lm's KVCache; slot = b * S + s, S = pool_rows). The pools
// may hold another float type P than q/k/v (T): the k_out / v values are converted on the store.
//
// Thread (p, t, g) of grid (head_dim/2, n_tokens, gq + gk) owns feature pair p of token t for the
// heads of group g: q heads for g < gq, else kv heads (k rotated into k_out and, when the slot is
// valid, k_pool; v features 2p, 2p+1 into v_pool). Pairs p < rotary_dims/2 rotate; cos/sin are
// computed once and reused for every head of the group. The other pairs copy two pass-through
// features. Consecutive threads along x touch consecutive features of one row, so a SIMD-group's
// accesses coalesce; adjacent pairs (traditional, pass-through, v) move as one 2-element vector.
//
// Checked on Linux by tests/metal_emu (docs/metal.md); compiled with -std=metal3.1 (bfloat).
#include <metal_stdlib>
using namespace metal;

// Function constants: indices count kernels.yaml's specialised scalars in order. Their types must be
// the launcher's (csrc/aot_launch_metal.cpp passes int32 scalars as MTLDataTypeInt, float32 as
// MTLDataTypeFloat; Metal refuses a pipeline whose constant types differ), so TRADITIONAL is an int
// (0 or 1), not a bool. The compiler specialises the index arithmetic per model.
constant int N_Q_HEADS [[function_constant(0)]];
constant int N_KV_HEADS [[function_constant(1)]];
constant int HEAD_DIM [[function_constant(2)]];
constant int ROTARY_DIMS [[function_constant(3)]];
constant int TRADITIONAL [[function_constant(4)]];
constant int HEADS_PER_THREAD [[function_constant(5)]];
constant float POS_SCALE [[function_constant(6)]];
constant float MSCALE [[function_constant(7)]];
constant int POOL_LAYOUT [[function_constant(8)]];
// VEC_WIDTH shapes CUDA launches only (its vector width); declared so the indices match the ABI.
constant int VEC_WIDTH [[function_constant(9)]];

// Features a and b of a row. Adjacent pairs start on an even feature of a row of even length, so
// the 2-element vector access is aligned (the emulator's UBSan checks it).
template <typename T>
inline vec<T, 2> load_pair(const device T* row, int a, int b, bool adjacent) {
  if (adjacent) {
    return *reinterpret_cast<const device vec<T, 2>*>(row + a);
  }
  return vec<T, 2>(row[a], row[b]);
}

template <typename T>
inline void store_pair(device T* row, int a, int b, bool adjacent, vec<T, 2> x) {
  if (adjacent) {
    *reinterpret_cast<device vec<T, 2>*>(row + a) = x;
  } else {
    row[a] = x.x;
    row[b] = x.y;
  }
}

// A pair as the pool's type: through float, which holds every half and bfloat exactly.
template <typename P, typename T>
inline vec<P, 2> to_pool(vec<T, 2> x) {
  return vec<P, 2>(P(float(x.x)), P(float(x.y)));
}

template <typename T, typename P>
[[kernel]] void rope_pool_fused(
    const device T* q [[buffer(0)]],
    const device T* k [[buffer(1)]],
    const device T* v [[buffer(2)]],
    device T* q_out [[buffer(3)]],
    device T* k_out [[buffer(4)]],
    device P* k_pool [[buffer(5)]],
    device P* v_pool [[buffer(6)]],
    const device int* positions [[buffer(7)]],
    const device int* slots [[buffer(8)]],
    const device float* inv_freq [[buffer(9)]],
    constant int& n_tokens [[buffer(10)]],
    constant int& pool_size [[buffer(11)]],
    constant int& pool_rows [[buffer(12)]],
    uint3 gid [[thread_position_in_grid]]) {
  const int p = int(gid.x);
  const int t = int(gid.y);
  const int g = int(gid.z);
  const int hpt = max(HEADS_PER_THREAD, 1);
  const int gq = (N_Q_HEADS + hpt - 1) / hpt;
  const int gk = (N_KV_HEADS + hpt - 1) / hpt;
  if (p >= HEAD_DIM / 2 || t >= n_tokens || g >= gq + gk) {
    return;  // non-uniform grids: edge threadgroups run past the data
  }
  const bool is_q = g < gq;
  const int n_heads = is_q ? N_Q_HEADS : N_KV_HEADS;
  const int h0 = (is_q ? g : g - gq) * hpt;
  const int nh = min(hpt, n_heads - h0);  // the last group of a head count hpt does not divide is partial
  const int half_rot = ROTARY_DIMS / 2;
  const bool rotary = p < half_rot;
  const bool adjacent = TRADITIONAL != 0 || !rotary;
  const int a = rotary ? (TRADITIONAL != 0 ? 2 * p : p) : ROTARY_DIMS + 2 * (p - half_rot);
  const int b = adjacent ? a + 1 : a + half_rot;

  float c = 1.0f;
  float s = 0.0f;
  if (rotary) {
    // precise::, not fast:: (which Metal's default -ffast-math picks for plain cos/sin): angles reach
    // position * inv_freq ~ 1e5 rad at long contexts, where fast:: range reduction loses accuracy.
    const float angle = float(positions[t]) * POS_SCALE * inv_freq[p];
    s = precise::sincos(angle, c);
  }

  const int slot = is_q ? -1 : slots[t];
  // slot < 0: rotate only; >= pool_size: never written (nor with no rows to divide by).
  const bool head_major = POOL_LAYOUT != 0;
  const bool store = slot >= 0 && slot < pool_size && (!head_major || pool_rows > 0);
  // 64-bit element offsets: a pool of millions of slots can exceed 2^31 elements. Head-major pools
  // put the heads of one slot pool_rows rows apart.
  const long row = (long(t) * n_heads + h0) * HEAD_DIM;
  const long head_stride = head_major ? long(pool_rows) * HEAD_DIM : long(HEAD_DIM);
  long pool_row = 0;
  if (store) {
    pool_row = head_major ? ((long(slot / pool_rows) * N_KV_HEADS + h0) * pool_rows + slot % pool_rows) * HEAD_DIM
                          : (long(slot) * N_KV_HEADS + h0) * HEAD_DIM;
  }
  const device T* src = (is_q ? q : k) + row;
  device T* dst = (is_q ? q_out : k_out) + row;
  for (int i = 0; i < nh; ++i) {
    const long off = long(i) * HEAD_DIM;
    vec<T, 2> x = load_pair(src + off, a, b, adjacent);
    if (rotary) {
      const float x1 = float(x.x) * MSCALE;
      const float x2 = float(x.y) * MSCALE;
      x = vec<T, 2>(T(x1 * c - x2 * s), T(x1 * s + x2 * c));  // fp32 math, one rounding to T
    }
    store_pair(dst + off, a, b, adjacent, x);
    if (store) {
      const long pool_off = pool_row + long(i) * head_stride;
      store_pair(k_pool + pool_off, a, b, adjacent, to_pool<P, T>(x));
      // v is copied, not rotated: features 2p, 2p+1 (one vector) cover the row across the threads.
      const vec<T, 2> vp = load_pair(v + row + off, 2 * p, 2 * p + 1, true);
      store_pair(v_pool + pool_off, 2 * p, 2 * p + 1, true, to_pool<P, T>(vp));
    }
  }
}

// Entries: rope_pool_fused_<act> (pools of the same type) and rope_pool_fused_<act>_<pool>.
#define INSTANTIATE(NAME, T, P)                                                          \
  template [[host_name(NAME)]] [[kernel]] void rope_pool_fused<T, P>(                    \
      const device T* q [[buffer(0)]], const device T* k [[buffer(1)]],                  \
      const device T* v [[buffer(2)]], device T* q_out [[buffer(3)]],                    \
      device T* k_out [[buffer(4)]], device P* k_pool [[buffer(5)]],                     \
      device P* v_pool [[buffer(6)]], const device int* positions [[buffer(7)]],         \
      const device int* slots [[buffer(8)]], const device float* inv_freq [[buffer(9)]], \
      constant int& n_tokens [[buffer(10)]], constant int& pool_size [[buffer(11)]],     \
      constant int& pool_rows [[buffer(12)]], uint3 gid [[thread_position_in_grid]]);

INSTANTIATE("rope_pool_fused_f16", half, half)
INSTANTIATE("rope_pool_fused_bf16", bfloat, bfloat)
INSTANTIATE("rope_pool_fused_f32", float, float)
INSTANTIATE("rope_pool_fused_f16_bf16", half, bfloat)
INSTANTIATE("rope_pool_fused_f16_f32", half, float)
INSTANTIATE("rope_pool_fused_bf16_f16", bfloat, half)
INSTANTIATE("rope_pool_fused_bf16_f32", bfloat, float)
INSTANTIATE("rope_pool_fused_f32_f16", float, half)
INSTANTIATE("rope_pool_fused_f32_bf16", float, bfloat)
