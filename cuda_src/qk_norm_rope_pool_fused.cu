// qk_norm_rope_pool_fused, CUDA entry points (docs/kernel-abi.md): per-head RMSNorm of q and k with
// their weights, RoPE, and k and v stored into the slot-indexed pools, in one launch.
//
// One warp per row (one head of one token: q rows first, then kv rows, token-major): lane l owns the
// feature pairs p = l, l + 32, ... < head_dim / 2 (rotary pairs (p, p + R/2) or (2p, 2p + 1), then
// pass-through pairs (R + 2j, R + 2j + 1)). Everything a lane needs (its inputs, weights, inverse
// frequencies, v, the token's slot and position) is loaded before the first use, and held in
// registers up to head_dim 256. Pass 1 sums the squares (warp shuffle reduction), pass 2 normalises
// (fp32, one rounding to T, as the model's norm returns T), rotates in fp32 and stores.
// The grid is 1-D (n_tokens * (n_q_heads + n_kv_heads) * 32 threads), so prefill sizes never meet
// the 65535-block limit of the other axes. q/k/v/q_out/k_out are strided (act_layout 0 [T, H, D] or
// 1 [B, H, L, D], their own Strides; aot_cuda::act_row): feature d of a row is d * s[3] elements from
// its feature 0. Every access is one element, so any strides and alignment work alike.
#include <stdint.h>

#include "aot_cuda.cuh"

namespace {

using aot_cuda::Cvt;
using aot_cuda::Strides;

struct Params {
  int n_tokens, pool_size, pool_rows, n_q_heads, n_kv_heads, head_dim, rotary_dims, traditional, pool_layout;
  float pos_scale, mscale, eps, weight_offset;
  int seq_len, act_layout;
};

// The activations' strides, in buffer order.
struct ActStrides {
  Strides q, k, v, q_out, k_out;
};

template <typename T>
__device__ __forceinline__ float rounded(float x) { return Cvt<T>::load(Cvt<T>::store(x)); }

// Pairs per lane held in registers: a row of head_dim <= 2 * 32 * NP = 256 is one chunk, loaded once.
constexpr int NP = 4;

// One lane's share of a chunk of a row: pairs i = c0 + lane + 32 j (j < NP), each with its feature
// indices, inputs, norm weights, inverse frequency (rotary pairs) and, for kv rows, v.
struct Chunk {
  int a[NP], b[NP];
  float x1[NP], x2[NP], w1[NP], w2[NP], f[NP], v1[NP], v2[NP];
};

// Every load of a chunk issued together, before anything waits on one: the kernel's time at decode
// sizes is memory latency, so one round trip instead of one per dependent step.
template <typename T>
__device__ __forceinline__ void load_chunk(Chunk& c, int c0, int lane, int pairs, int half_rot, int rotary_dims,
                                           bool trad, const T* in, long long in_step, const float* w,
                                           const float* inv_freq, const T* vr, long long v_step, bool is_q) {
#pragma unroll
  for (int j = 0; j < NP; ++j) {
    const int i = c0 + lane + 32 * j;
    if (i >= pairs) continue;
    const bool rotary = i < half_rot;
    const int a = rotary ? (trad ? 2 * i : i) : rotary_dims + 2 * (i - half_rot);
    const int b = rotary && !trad ? a + half_rot : a + 1;
    c.a[j] = a;
    c.b[j] = b;
    c.x1[j] = Cvt<T>::load(in[a * in_step]);
    c.x2[j] = Cvt<T>::load(in[b * in_step]);
    c.w1[j] = w[a];
    c.w2[j] = w[b];
    c.f[j] = rotary ? inv_freq[i] : 0.0f;
    if (!is_q) {
      c.v1[j] = Cvt<T>::load(vr[a * v_step]);
      c.v2[j] = Cvt<T>::load(vr[b * v_step]);
    }
  }
}

template <typename T, typename P>
__device__ void body(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                     T* __restrict__ q_out, T* __restrict__ k_out, P* k_pool, P* v_pool,
                     const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
                     const float* __restrict__ table, const Params& p, const ActStrides& st) {
  const long long gid = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  const long long row_id = gid / 32;
  const int lane = static_cast<int>(gid % 32);
  const int heads = p.n_q_heads + p.n_kv_heads;
  // Whole warps leave together (the shuffles below need every lane of a live row).
  if (row_id >= static_cast<long long>(p.n_tokens) * heads) return;
  const int t = static_cast<int>(row_id / heads);
  const int hh = static_cast<int>(row_id - static_cast<long long>(t) * heads);
  const bool is_q = hh < p.n_q_heads;
  const int h = is_q ? hh : hh - p.n_q_heads;
  const int D = p.head_dim;
  const Strides in_st = is_q ? st.q : st.k, out_st = is_q ? st.q_out : st.k_out;
  const T* in = (is_q ? q : k) + aot_cuda::act_row(t, h, in_st, p.act_layout, p.seq_len);
  T* out = (is_q ? q_out : k_out) + aot_cuda::act_row(t, h, out_st, p.act_layout, p.seq_len);
  const long long in_step = in_st.s[3], out_step = out_st.s[3];
  // norm_rope_table: [q_weight (D) | k_weight (D) | inv_freq (rotary_dims / 2)], fp32
  const float* w = table + (is_q ? 0 : D);
  const float* inv_freq = table + 2 * D;
  const T* vr = is_q ? v : v + aot_cuda::act_row(t, h, st.v, p.act_layout, p.seq_len);
  const long long v_step = st.v.s[3];
  const int half_rot = p.rotary_dims / 2;
  const int pairs = D / 2;
  const bool trad = p.traditional != 0;
  const int slot = is_q ? -1 : slots[t];
  const float pos = static_cast<float>(positions[t]) * p.pos_scale;
  const int chunk = 32 * NP;

  // Pass 1: the sum of squares. A row of one chunk stays in registers for pass 2.
  Chunk c;
  float ss = 0.0f;
  for (int c0 = 0; c0 < pairs; c0 += chunk) {
    load_chunk<T>(c, c0, lane, pairs, half_rot, p.rotary_dims, trad, in, in_step, w, inv_freq, vr, v_step, is_q);
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      if (c0 + lane + 32 * j < pairs) ss += c.x1[j] * c.x1[j] + c.x2[j] * c.x2[j];
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  const float r = rsqrtf(ss / static_cast<float>(D) + p.eps);

  // Never out of bounds (nor a division by zero rows of inconsistent head-major scalars).
  const bool store = !is_q && slot >= 0 && slot < p.pool_size && (p.pool_layout == 0 || p.pool_rows > 0);
  long long dst = 0;
  if (store) {
    const long long b = slot / p.pool_rows, s = slot % p.pool_rows;
    dst = p.pool_layout == 0 ? (static_cast<long long>(slot) * p.n_kv_heads + h) * D
                             : ((b * p.n_kv_heads + h) * p.pool_rows + s) * D;
  }
  // Pass 2: normalise (fp32, one rounding to T, as the model's norm returns T), rotate, store.
  for (int c0 = 0; c0 < pairs; c0 += chunk) {
    if (pairs > chunk) {  // rows of several chunks (head_dim > 256) load each one again
      load_chunk<T>(c, c0, lane, pairs, half_rot, p.rotary_dims, trad, in, in_step, w, inv_freq, vr, v_step, is_q);
    }
#pragma unroll
    for (int j = 0; j < NP; ++j) {
      const int i = c0 + lane + 32 * j;
      if (i >= pairs) continue;
      const int a = c.a[j], b = c.b[j];
      float y1 = rounded<T>(c.x1[j] * r * (c.w1[j] + p.weight_offset));
      float y2 = rounded<T>(c.x2[j] * r * (c.w2[j] + p.weight_offset));
      if (i < half_rot) aot_cuda::rotate_pair(y1, y2, pos * c.f[j], p.mscale);
      const T o1 = Cvt<T>::store(y1), o2 = Cvt<T>::store(y2);
      out[a * out_step] = o1;
      out[b * out_step] = o2;
      if (store) {
        k_pool[dst + a] = Cvt<P>::store(Cvt<T>::load(o1));
        k_pool[dst + b] = Cvt<P>::store(Cvt<T>::load(o2));
        v_pool[dst + a] = Cvt<P>::store(c.v1[j]);
        v_pool[dst + b] = Cvt<P>::store(c.v2[j]);
      }
    }
  }
}

}  // namespace

#define QKN_ENTRY(NAME, T, P)                                                                             \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                                 \
      const T* q, const T* k, const T* v, T* q_out, T* k_out, P* k_pool, P* v_pool,                        \
      const int32_t* positions, const int32_t* slots, const float* norm_rope_table, int n_tokens,         \
      int pool_size, int pool_rows, int n_q_heads, int n_kv_heads, int head_dim, int rotary_dims,          \
      int traditional, int pool_layout, float pos_scale, float mscale, float eps, float weight_offset,     \
      int seq_len, int act_layout, Strides q_strides, Strides k_strides, Strides v_strides,                \
      Strides q_out_strides, Strides k_out_strides) {                                                     \
    const Params p{n_tokens, pool_size, pool_rows, n_q_heads, n_kv_heads, head_dim, rotary_dims,          \
                   traditional, pool_layout, pos_scale, mscale, eps, weight_offset, seq_len, act_layout};  \
    const ActStrides st{q_strides, k_strides, v_strides, q_out_strides, k_out_strides};                   \
    if (!aot_cuda::act_layout_ok(act_layout, seq_len)) return; /* an unknown layout: nothing */            \
    body<T, P>(q, k, v, q_out, k_out, k_pool, v_pool, positions, slots, norm_rope_table, p, st);          \
  }

QKN_ENTRY(qk_norm_rope_pool_fused_f16, __half, __half)
QKN_ENTRY(qk_norm_rope_pool_fused_bf16, __nv_bfloat16, __nv_bfloat16)
QKN_ENTRY(qk_norm_rope_pool_fused_f32, float, float)
QKN_ENTRY(qk_norm_rope_pool_fused_f16_f32, __half, float)
QKN_ENTRY(qk_norm_rope_pool_fused_bf16_f16, __nv_bfloat16, __half)
QKN_ENTRY(qk_norm_rope_pool_fused_bf16_f32, __nv_bfloat16, float)
QKN_ENTRY(qk_norm_rope_pool_fused_f32_f16, float, __half)
QKN_ENTRY(qk_norm_rope_pool_fused_f32_bf16, float, __nv_bfloat16)
QKN_ENTRY(qk_norm_rope_pool_fused_f16_bf16, __half, __nv_bfloat16)
