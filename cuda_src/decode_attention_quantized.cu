// decode_attention_quantized, CUDA entry points (docs/kernel-abi.md): decode_attention over mlx-lm's
// quantized K/V (packed uint32 words, scales, biases) read in place, with no dequantized copy.
//
// decode_attention's blocks, warps, lanes per key and softmax (cuda_src/aot_attention.cuh): block
// (split, kv head, batch row) reads each packed key/value row of its part of the row's valid range
// once for all the query rows of its kv head. A lane holds EPL = 8 features of a key: 8 bytes of
// words at 8 bits, one word at 4 bits, and its group's scale and bias (a group of 32, 64 or 128 holds
// whole lanes). Scores need no dequantized key: with the lane's q features q_e (pre-scaled), key
// features w_e * s + b give sum_e q_e (w_e s + b) = s * sum_e q_e w_e + b * sum_e q_e, the second sum
// once per pass. Values are dequantized per lane (w_e * s + b, fp32), once for all the query rows.
#include <math.h>
#include <stdint.h>

#include "aot_attention.cuh"
#include "aot_cuda.cuh"

namespace {

using aot_cuda::Cvt;
using aot_cuda::Strides;
using namespace aot_attn;

// A lane's EPL packed features of a row: two words at 8 bits, one at 4.
template <int BITS>
struct Packed {
  static constexpr int N = BITS * EPL / 32;
  uint32_t w[N];
};

template <int BITS>
__device__ __forceinline__ void load_packed(const uint32_t* p, Packed<BITS>& x) {
  if constexpr (BITS == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);      // 8-byte aligned: D % 8 == 0
    x.w[0] = v.x;
    x.w[1] = v.y;
  } else {
    x.w[0] = *p;
  }
}

// The EPL integers of a lane as floats: the integer in a float's mantissa, less 2^23 (exact).
template <int BITS>
__device__ __forceinline__ void unpack(const Packed<BITS>& x, float (&f)[EPL]) {
  constexpr uint32_t mask = (1u << BITS) - 1u;
  constexpr int per_word = 32 / BITS;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const uint32_t q = (x.w[e / per_word] >> (BITS * (e % per_word))) & mask;
    f[e] = __uint_as_float(0x4b000000u | q) - 8388608.f;
  }
}

// Quantized K/V rows: a lane's packed EPL features of a key and a value row, with their group's scale
// and bias.
template <typename T, int BITS>
struct QuantRows {
  struct Lane {
    Packed<BITS> q;
    T s, b;            // the group's scale and bias as stored: half the registers of floats
  };
  const uint32_t* k_words;
  const T* k_scales;
  const T* k_biases;
  const uint32_t* v_words;
  const T* v_scales;
  const T* v_biases;
  int W, Gn, gs;

  __device__ __forceinline__ void load_side(const uint32_t* words, const T* scales, const T* biases, long long row,
                                            int d0, Lane& x) const {
    load_packed<BITS>(words + row * W + d0 * BITS / 32, x.q);
    const long long g = row * Gn + d0 / gs;
    x.s = scales[g];
    x.b = biases[g];
  }
  __device__ __forceinline__ void load(long long row, int d0, Lane& kl, Lane& vl) const {
    load_side(k_words, k_scales, k_biases, row, d0, kl);
    load_side(v_words, v_scales, v_biases, row, d0, vl);
  }
  __device__ static __forceinline__ void zero(Lane& kl, Lane& vl) {
#pragma unroll
    for (int i = 0; i < Packed<BITS>::N; ++i) kl.q.w[i] = vl.q.w[i] = 0;
    kl.s = kl.b = vl.s = vl.b = Cvt<T>::store(0.f);
  }
  __device__ static __forceinline__ void keys(const Lane& kl, float (&kf)[EPL]) { unpack<BITS>(kl.q, kf); }
  // sum_e q_e (w_e s + b) = s * sum_e q_e w_e + b * sum_e q_e: no dequantized key
  __device__ static __forceinline__ float dot(const Lane& kl, const float (&kf)[EPL], const float (&qv)[EPL],
                                              float qsum) {
    float d = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) d = fmaf(qv[e], kf[e], d);
    return fmaf(Cvt<T>::load(kl.s), d, Cvt<T>::load(kl.b) * qsum);
  }
  __device__ static __forceinline__ void values(const Lane& vl, float (&vf)[EPL]) {
    unpack<BITS>(vl.q, vf);
    const float scale = Cvt<T>::load(vl.s), bias = Cvt<T>::load(vl.b);
#pragma unroll
    for (int e = 0; e < EPL; ++e) vf[e] = fmaf(vf[e], scale, bias);
  }
};

}  // namespace

// Scalars the wrapper validates; an inconsistent set (or a format other than 4/8 bits, group 32, 64
// or 128 dividing head_dim) launches nothing rather than reading out of bounds.
#define DAQ_ENTRY(NAME, T)                                                                                  \
  extern "C" __global__ void __launch_bounds__(aot_attn::THREADS, 3) NAME(                                   \
      const T* q, T* out, const uint32_t* k_pool, const T* k_scales, const T* k_biases, const uint32_t* v_pool, \
      const T* v_scales, const T* v_biases, const int32_t* kv_len, const int32_t* kv_end, const int32_t* table, \
      float* workspace, int32_t* locks, int batch, int seq_len, int n_q_heads, int n_kv_heads, int head_dim,  \
      int pool_layout, int bits, int group_size, int pool_rows, int table_cols, int window, float scale,     \
      float softcap, int n_splits, int split_len, Strides q_strides) {                                       \
    const aot_attn::Shape p{batch,      seq_len, n_q_heads, n_kv_heads, head_dim, pool_layout, pool_rows,     \
                            table_cols, window,  scale,     softcap,    n_splits, split_len};                 \
    if (!aot_attn::shape_ok(p) || (group_size != 32 && group_size != 64 && group_size != 128) ||             \
        head_dim % group_size)                                                                               \
      return;                                                                                                \
    /* bits as a compile-time choice too: the unpacking has no runtime shift or mask */                   \
    const int W = head_dim * bits / 32, Gn = head_dim / group_size;                                          \
    if (bits == 8)                                                                                           \
      aot_attn::attend<T>(q, out, QuantRows<T, 8>{k_pool, k_scales, k_biases, v_pool, v_scales, v_biases, W,  \
                                                   Gn, group_size},                                           \
                          kv_len, kv_end, table, workspace, locks, p, q_strides);                            \
    else if (bits == 4)                                                                                      \
      aot_attn::attend<T>(q, out, QuantRows<T, 4>{k_pool, k_scales, k_biases, v_pool, v_scales, v_biases, W,  \
                                                   Gn, group_size},                                           \
                          kv_len, kv_end, table, workspace, locks, p, q_strides);                            \
  }

DAQ_ENTRY(decode_attention_quantized_f16, __half)
DAQ_ENTRY(decode_attention_quantized_bf16, __nv_bfloat16)
DAQ_ENTRY(decode_attention_quantized_f32, float)
