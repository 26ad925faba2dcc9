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
// accesses coalesce; adjacent pairs (traditional, pass-through, v) are stored into the pools, and
// into q_out/k_out, as one 2-element vector.
//
// q, k, v, q_out and k_out are read and written through their element strides (docs/kernel-abi.md,
// "Strided buffers"): ACT_LAYOUT 0 [n_tokens, H, D], 1 [B, H, L, D] with token t = b * L + l.
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

// Elements from one head to the next.
inline long act_head(int4 s) { return ACT_LAYOUT != 0 ? long(s.y) : long(s.z); }

// A fresh output starts at its allocation, so unit feature stride and even other strides make its
// adjacent pairs aligned 2-vectors. An input may be a view starting at any element, and the kernel
// is not told its alignment: inputs are read element by element.
inline bool pairs_aligned(int4 s) { return s.w == 1 && ((s.x | s.y | s.z) & 1) == 0; }

// Features a and b of a row. Adjacent pairs start on an even feature of a row of even length, so
// the 2-element vector access is aligned (the emulator's UBSan checks it).
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
    constant int& seq_len [[buffer(13)]],
    constant int4& q_strides [[buffer(14)]],
    constant int4& k_strides [[buffer(15)]],
    constant int4& v_strides [[buffer(16)]],
    constant int4& q_out_strides [[buffer(17)]],
    constant int4& k_out_strides [[buffer(18)]],
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
  const long head_stride = head_major ? long(pool_rows) * HEAD_DIM : long(HEAD_DIM);
  long pool_row = 0;
  if (store) {
    pool_row = head_major ? ((long(slot / pool_rows) * N_KV_HEADS + h0) * pool_rows + slot % pool_rows) * HEAD_DIM
                          : (long(slot) * N_KV_HEADS + h0) * HEAD_DIM;
  }
  // Activation offsets through the strides (the feature stride is si.w / so.w; see act_row).
  const int4 si = is_q ? q_strides : k_strides;
  const int4 so = is_q ? q_out_strides : k_out_strides;
  const device T* src = is_q ? q : k;
  device T* dst = is_q ? q_out : k_out;
  const long src_row = act_row(si, t, h0, seq_len), dst_row = act_row(so, t, h0, seq_len);
  const long src_a = long(a) * si.w, src_b = long(b) * si.w;
  const long dst_a = long(a) * so.w, dst_b = long(b) * so.w;
  const bool dst_vector = adjacent && pairs_aligned(so);
  for (int i = 0; i < nh; ++i) {
    const long row_in = src_row + long(i) * act_head(si);
    vec<T, 2> x(src[row_in + src_a], src[row_in + src_b]);
    if (rotary) {
      const float x1 = float(x.x) * MSCALE;
      const float x2 = float(x.y) * MSCALE;
      x = vec<T, 2>(T(x1 * c - x2 * s), T(x1 * s + x2 * c));  // fp32 math, one rounding to T
    }
    const long row_out = dst_row + long(i) * act_head(so);
    if (dst_vector) {
      store_pair(dst + row_out, a, b, true, x);
    } else {
      dst[row_out + dst_a] = x.x;
      dst[row_out + dst_b] = x.y;
    }
    if (store) {
      const long pool_off = pool_row + long(i) * head_stride;
      store_pair(k_pool + pool_off, a, b, adjacent, to_pool<P, T>(x));
      // v is copied, not rotated: features 2p, 2p+1 (one vector in the pool) cover the row across
      // the threads.
      const long vi = act_row(v_strides, t, h0 + i, seq_len);
      const vec<T, 2> vp(v[vi + long(2 * p) * v_strides.w], v[vi + long(2 * p + 1) * v_strides.w]);
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
      constant int& pool_rows [[buffer(12)]], constant int& seq_len [[buffer(13)]],       \
      constant int4& q_strides [[buffer(14)]], constant int4& k_strides [[buffer(15)]],   \
      constant int4& v_strides [[buffer(16)]], constant int4& q_out_strides [[buffer(17)]], \
      constant int4& k_out_strides [[buffer(18)]], uint3 gid [[thread_position_in_grid]]);

INSTANTIATE("rope_pool_fused_f16", half, half)
INSTANTIATE("rope_pool_fused_bf16", bfloat, bfloat)
INSTANTIATE("rope_pool_fused_f32", float, float)
INSTANTIATE("rope_pool_fused_f16_bf16", half, bfloat)
INSTANTIATE("rope_pool_fused_f16_f32", half, float)
INSTANTIATE("rope_pool_fused_bf16_f16", bfloat, half)
INSTANTIATE("rope_pool_fused_bf16_f32", bfloat, float)
INSTANTIATE("rope_pool_fused_f32_f16", float, half)
INSTANTIATE("rope_pool_fused_f32_bf16", float, bfloat)
