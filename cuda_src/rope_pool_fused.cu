// rope_pool_fused, CUDA entry points (docs/kernel-abi.md): one launch rotates q and k, stores the
// rotated k and the unchanged v into the slot-indexed pools (slot-major [S, Hkv, D] or head-major
// [B, Hkv, S, D]; pool_offset, as in the CPU kernel). The pools may hold another float type P than
// q/k/v (T): the k_out / v values are converted on the store (store_pool).
//
// q/k/v/q_out/k_out are strided (act_layout 0 [T, H, D] or 1 [B, H, L, D], their own Strides; see
// aot_cuda::act_row): only the address of an activation element depends on them.
//
// Work decomposition. A row (one head of one token) is split into units of W-element vectors
// (W = vec_width, from the wrapper: 16 bytes / element size when the row layout allows it, else
// smaller, down to 1); an activation buffer whose strides or address cannot hold W-vectors
// (aot_cuda::vec_ok, one decision per buffer and launch) moves the same units element by element:
//   - rotary units: W pairs held in two W-vectors a and b; half-split: a = x[uW..], b = x[R/2 + uW..];
//     traditional: a = x[2uW..], b = x[2uW + W..] (pairs adjacent inside each vector);
//   - pass-through units: one W-vector of features [R, D), copied.
// Thread (t, u, g): token t, unit u, head group g (HPT heads: q groups first, then kv groups).
// cos/sin of the unit's W pairs are computed once and reused for the group's heads.
// grid.x covers n_tokens * units, grid.y the head groups; every index is bounds-checked.
#include <stdint.h>

#include "aot_cuda.cuh"

#include <type_traits>

namespace {

using aot_cuda::Cvt;
using aot_cuda::Strides;
using aot_cuda::Vec;

struct Params {
  int n_tokens, pool_size, pool_rows, n_q_heads, n_kv_heads, head_dim, rotary_dims, traditional, hpt;
  float pos_scale, mscale;
  int pool_layout, seq_len, act_layout;
};

// The activations' strides, in buffer order.
struct ActStrides {
  Strides q, k, v, q_out, k_out;
};

// Element offset of pool row (slot, h). Slot-major [S, Hkv, D]: slot is the row. Head-major
// [B, Hkv, S, D] (mlx-lm's KVCache): slot = b * S + s. 64-bit: pools can exceed 2^31 elements.
__device__ __forceinline__ long long pool_offset(int slot, int h, const Params& p) {
  if (p.pool_layout == 0) return (static_cast<long long>(slot) * p.n_kv_heads + h) * p.head_dim;
  const int b = slot / p.pool_rows, s = slot % p.pool_rows;
  return ((static_cast<long long>(b) * p.n_kv_heads + h) * p.pool_rows + s) * p.head_dim;
}

template <typename T, int W>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, W>& x) { *reinterpret_cast<Vec<T, W>*>(p) = x; }

// A T-vector into the pool as P: the same bits when P is T, else each element converted, in
// accesses of at most 16 bytes (a P wider than T splits the unit; each part stays aligned).
template <typename P, typename T, int W>
__device__ __forceinline__ void store_pool(P* dst, const Vec<T, W>& x) {
  if constexpr (std::is_same<P, T>::value) {
    store_vec<T, W>(dst, x);
  } else {
    constexpr int C = sizeof(P) * W > 16 ? 16 / static_cast<int>(sizeof(P)) : W;  // elements per access
#pragma unroll
    for (int c = 0; c < W; c += C) {
      Vec<P, C> y;
#pragma unroll
      for (int j = 0; j < C; ++j) y.v[j] = Cvt<P>::store(Cvt<T>::load(x.v[c + j]));
      store_vec<P, C>(dst + c, y);
    }
  }
}

// Rotate the W pairs of one unit. Half-split (and W == 1, where a and b are the two members of one
// traditional pair): pair j = (a[j], b[j]). Traditional with W >= 2: a holds pairs 0..W/2-1 and b
// pairs W/2..W-1, each as adjacent elements.
template <typename T, int W>
__device__ __forceinline__ void rotate_unit(Vec<T, W>& a, Vec<T, W>& b, const float* c, const float* s,
                                            bool adjacent, float m) {
  if (W >= 2 && adjacent) {
#pragma unroll
    for (int j = 0; j < W / 2; ++j) {
      float x1 = Cvt<T>::load(a.v[2 * j]) * m, x2 = Cvt<T>::load(a.v[2 * j + 1]) * m;
      a.v[2 * j] = Cvt<T>::store(x1 * c[j] - x2 * s[j]);
      a.v[2 * j + 1] = Cvt<T>::store(x1 * s[j] + x2 * c[j]);
      x1 = Cvt<T>::load(b.v[2 * j]) * m;
      x2 = Cvt<T>::load(b.v[2 * j + 1]) * m;
      b.v[2 * j] = Cvt<T>::store(x1 * c[W / 2 + j] - x2 * s[W / 2 + j]);
      b.v[2 * j + 1] = Cvt<T>::store(x1 * s[W / 2 + j] + x2 * c[W / 2 + j]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const float x1 = Cvt<T>::load(a.v[j]) * m, x2 = Cvt<T>::load(b.v[j]) * m;
      a.v[j] = Cvt<T>::store(x1 * c[j] - x2 * s[j]);
      b.v[j] = Cvt<T>::store(x1 * s[j] + x2 * c[j]);
    }
  }
}

template <typename T, typename P, int W>
__device__ void body(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     T* __restrict__ q_out, T* __restrict__ k_out, P* k_pool, P* v_pool,
                     const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
                     const float* __restrict__ inv_freq, const Params& p, const ActStrides& st) {
  using V = Vec<T, W>;
  using aot_cuda::act_row;
  using aot_cuda::load_unit;
  using aot_cuda::store_unit;
  const int half = p.rotary_dims / 2;
  const int rot_units = half / W;
  const int units = rot_units + (p.head_dim - p.rotary_dims) / W;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (units == 0 || idx >= static_cast<long long>(p.n_tokens) * units) return;
  const int t = static_cast<int>(idx / units);
  const int u = static_cast<int>(idx - static_cast<long long>(t) * units);
  const int gq = (p.n_q_heads + p.hpt - 1) / p.hpt;
  const int gk = (p.n_kv_heads + p.hpt - 1) / p.hpt;
  const int g = blockIdx.y;
  if (g >= gq + gk) return;
  const bool is_q = g < gq;
  const int n_heads = is_q ? p.n_q_heads : p.n_kv_heads;
  const int h0 = (is_q ? g : g - gq) * p.hpt;
  const int h1 = min(h0 + p.hpt, n_heads);
  const bool trad = p.traditional != 0;

  const int slot = is_q ? -1 : slots[t];
  const bool rotary = u < rot_units;
  int off_a, off_b = 0;
  if (rotary) {
    if (trad) {
      off_a = 2 * u * W;
      off_b = W == 1 ? off_a + 1 : off_a + W;
    } else {
      off_a = u * W;
      off_b = half + u * W;
    }
  } else {
    off_a = p.rotary_dims + (u - rot_units) * W;
  }

  const T* in_base = is_q ? q : k;
  T* out_base = is_q ? q_out : k_out;
  const Strides in_st = is_q ? st.q : st.k, out_st = is_q ? st.q_out : st.k_out;
  const bool in_vec = aot_cuda::vec_ok<T, W>(in_base, in_st);
  const bool out_vec = aot_cuda::vec_ok<T, W>(out_base, out_st);
  const bool v_vec = aot_cuda::vec_ok<T, W>(v, st.v);
  const int in_step = in_st.s[3], out_step = out_st.s[3], v_step = st.v.s[3];
  // Feature d of a row is d * step elements from the row's feature 0 (64-bit).
  const long long fa = off_a, fb = off_b;
  const long long in_a = fa * in_step, in_b = fb * in_step;
  const long long out_a = fa * out_step, out_b = fb * out_step;
  const long long v_a = fa * v_step, v_b = fb * v_step;

  // The first head's units (and its v, for a k thread: any v row of the launch is in bounds) are
  // loaded before the position is used, so their latency overlaps the index loads and the cos/sin
  // instead of following them: at decode sizes (one head per thread) that is the kernel's time.
  const T* in0 = in_base + act_row(t, h0, in_st, p.act_layout, p.seq_len);
  const T* v0 = v + (is_q ? 0 : act_row(t, h0, st.v, p.act_layout, p.seq_len));
  V a0 = load_unit<T, W>(in0 + in_a, in_step, in_vec), b0{}, va0{}, vb0{};
  if (rotary) b0 = load_unit<T, W>(in0 + in_b, in_step, in_vec);
  if (!is_q) {
    va0 = load_unit<T, W>(v0 + v_a, v_step, v_vec);
    if (rotary) vb0 = load_unit<T, W>(v0 + v_b, v_step, v_vec);
  }

  // Never out of bounds (nor a division by zero rows).
  const bool write = !is_q && slot >= 0 && slot < p.pool_size && (p.pool_layout == 0 || p.pool_rows > 0);
  float c[W], s[W];
  if (rotary) {
    const float pos = static_cast<float>(positions[t]) * p.pos_scale;
#pragma unroll
    for (int j = 0; j < W; ++j) sincosf(pos * inv_freq[u * W + j], &s[j], &c[j]);
  }

  for (int h = h0; h < h1; ++h) {
    const bool first = h == h0;
    const T* in = first ? in0 : in_base + act_row(t, h, in_st, p.act_layout, p.seq_len);
    T* out = out_base + act_row(t, h, out_st, p.act_layout, p.seq_len);
    const T* vr = first || !write ? v0 : v + act_row(t, h, st.v, p.act_layout, p.seq_len);
    const long long dst = write ? pool_offset(slot, h, p) : 0;
    V a = first ? a0 : load_unit<T, W>(in + in_a, in_step, in_vec);
    if (rotary) {
      V b = first ? b0 : load_unit<T, W>(in + in_b, in_step, in_vec);
      rotate_unit<T, W>(a, b, c, s, trad, p.mscale);
      store_unit<T, W>(out + out_b, out_step, out_vec, b);
      if (write) {
        store_pool<P>(k_pool + dst + off_b, b);
        store_pool<P>(v_pool + dst + off_b, first ? vb0 : load_unit<T, W>(vr + v_b, v_step, v_vec));
      }
    }
    store_unit<T, W>(out + out_a, out_step, out_vec, a);
    if (write) {
      store_pool<P>(k_pool + dst + off_a, a);
      store_pool<P>(v_pool + dst + off_a, first ? va0 : load_unit<T, W>(vr + v_a, v_step, v_vec));
    }
  }
}

// W = vec_width comes from the wrapper (registry/kernels/rope_pool_fused.py cuda_vector_width, its one
// source): the widest vector of the activations' type T (16-byte q/k/v accesses) such that rotary
// units span 2W elements and the pass-through tail W-element vectors, all starting on multiples of W
// (W == 1 covers every even rotary_dims). Only the widths switched on below exist; any other width,
// or one the row layout cannot hold, launches nothing (tests/test_rope_pool_fused_geometry.py checks
// the wrapper picks only these); so does an unknown act_layout (or seq_len < 1 with act_layout 1).
// The pool's accesses are W * sizeof(P) bytes, at most 16 (store_pool), aligned likewise: every row
// starts on a multiple of head_dim, which W divides.
template <typename T, typename P>
__device__ void dispatch(const T* q, const T* k, const T* v, T* q_out, T* k_out, P* k_pool, P* v_pool,
                         const int32_t* positions, const int32_t* slots, const float* inv_freq, int vec_width,
                         const Params& p, const ActStrides& st) {
  if (vec_width < 1 || p.rotary_dims % (2 * vec_width) || (p.head_dim - p.rotary_dims) % vec_width) return;
  if (!aot_cuda::act_layout_ok(p.act_layout, p.seq_len)) return;
  switch (vec_width) {
    case 8:
      if constexpr (sizeof(T) == 2)
        body<T, P, 8>(q, k, v, q_out, k_out, k_pool, v_pool, positions, slots, inv_freq, p, st);
      break;
    case 4: body<T, P, 4>(q, k, v, q_out, k_out, k_pool, v_pool, positions, slots, inv_freq, p, st); break;
    case 2: body<T, P, 2>(q, k, v, q_out, k_out, k_pool, v_pool, positions, slots, inv_freq, p, st); break;
    case 1: body<T, P, 1>(q, k, v, q_out, k_out, k_pool, v_pool, positions, slots, inv_freq, p, st); break;
    default: break;
  }
}

}  // namespace

// Entries: rope_pool_fused_<act> (pools of the same type) and rope_pool_fused_<act>_<pool>.
#define ROPE_POOL_ENTRY(NAME, T, P)                                                                     \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                               \
      const T* q, const T* k, const T* v, T* q_out, T* k_out, P* k_pool, P* v_pool,                      \
      const int32_t* positions, const int32_t* slots, const float* inv_freq, int n_tokens, int pool_size, \
      int pool_rows, int n_q_heads, int n_kv_heads, int head_dim, int rotary_dims, int traditional,      \
      int heads_per_thread, float pos_scale, float mscale, int pool_layout, int vec_width, int seq_len,   \
      int act_layout, Strides q_strides, Strides k_strides, Strides v_strides, Strides q_out_strides,     \
      Strides k_out_strides) {                                                                           \
    const Params p{n_tokens, pool_size, pool_rows, n_q_heads, n_kv_heads, head_dim, rotary_dims,         \
                   traditional, heads_per_thread < 1 ? 1 : heads_per_thread, pos_scale, mscale,           \
                   pool_layout, seq_len, act_layout};                                                    \
    const ActStrides st{q_strides, k_strides, v_strides, q_out_strides, k_out_strides};                  \
    dispatch<T, P>(q, k, v, q_out, k_out, k_pool, v_pool, positions, slots, inv_freq, vec_width, p, st); \
  }

ROPE_POOL_ENTRY(rope_pool_fused_f16, __half, __half)
ROPE_POOL_ENTRY(rope_pool_fused_bf16, __nv_bfloat16, __nv_bfloat16)
ROPE_POOL_ENTRY(rope_pool_fused_f32, float, float)
ROPE_POOL_ENTRY(rope_pool_fused_f16_bf16, __half, __nv_bfloat16)
ROPE_POOL_ENTRY(rope_pool_fused_f16_f32, __half, float)
ROPE_POOL_ENTRY(rope_pool_fused_bf16_f16, __nv_bfloat16, __half)
ROPE_POOL_ENTRY(rope_pool_fused_bf16_f32, __nv_bfloat16, float)
ROPE_POOL_ENTRY(rope_pool_fused_f32_f16, float, __half)
ROPE_POOL_ENTRY(rope_pool_fused_f32_bf16, float, __nv_bfloat16)
