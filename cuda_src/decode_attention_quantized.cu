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
// That is the SIMT path (float32, head dims other than 64 and 128); 2-byte types at 64 or 128 take the
// tensor-core path, whose rows policy (QuantMma) dequantizes into the mma's operands.
#include <math.h>
#include <stdint.h>

#include <type_traits>

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

// An 8-bit integer (byte k of w) as a float: the integer in a float's mantissa, less 2^23 (exact).
__device__ __forceinline__ float byte_f(uint32_t w, int k) {
  return __uint_as_float(__byte_perm(w, 0x4b000000u, 0x7440u | k)) - 8388608.f;
}

// Two 4-bit integers (bits 0-3 and 16-19 of x) as a T pair, times s2 plus b2 (T pairs): each integer
// in the mantissa of a T magic number (1024 or 128: exact), less the magic, then one rounding.
template <typename T>
__device__ __forceinline__ uint32_t dequant4_pair(uint32_t x, uint32_t s2, uint32_t b2) {
  if constexpr (std::is_same_v<T, __half>) {
    const uint32_t y = (x & 0x000f000fu) | 0x64006400u, magic = 0x64006400u;
    const __half2 r = __hfma2(__hsub2(*reinterpret_cast<const __half2*>(&y), *reinterpret_cast<const __half2*>(&magic)),
                              *reinterpret_cast<const __half2*>(&s2), *reinterpret_cast<const __half2*>(&b2));
    return *reinterpret_cast<const uint32_t*>(&r);
  } else {
    const uint32_t y = (x & 0x000f000fu) | 0x43004300u, magic = 0x43004300u;
    using B2 = __nv_bfloat162;
    const B2 r = __hfma2(__hsub2(*reinterpret_cast<const B2*>(&y), *reinterpret_cast<const B2*>(&magic)),
                         *reinterpret_cast<const B2*>(&s2), *reinterpret_cast<const B2*>(&b2));
    return *reinterpret_cast<const uint32_t*>(&r);
  }
}

// N consecutive words with one aligned access (N = 1, 2, 4: the row widths make them aligned).
template <int N>
__device__ __forceinline__ void load_words(const uint32_t* p, uint32_t (&w)[N]) {
  if constexpr (N == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *p;
  }
}

// Quantized K/V rows on the tensor-core path (aot_attention.cuh, attend_mma_block): packed words and
// each row's group (scale, bias) pairs in registers, dequantized into the mma's B operands when used
// (one rounding to T, as mx.dequantize's output in T). 8 bits: the integers through fp32; 4 bits: two at
// a time in T pairs, and K's k order within a lane's word pairs nibbles e and e + 4 (the mask that
// extracts both), Q's fragments following it (k_phys).
template <typename T, int BITS, int D>
struct QuantMma {
  static constexpr int KT = BITS == 4 ? 2 : 1;         // about as many bytes in flight per warp as 8 bits
  static constexpr int SW = BITS / 4;                  // words of a lane's 8 features of a span
  static constexpr int VW = D / 8 * BITS / 32;         // words of a lane's D/8 value features
  static constexpr int W = D * BITS / 32;              // words of a row
  struct Chunk {
    uint32_t k[2][D / 32][SW];                         // keys g, 8+g: features 32s + 8t .. +8
    uint32_t ksb[2][D / 32];                           // their group's (scale, bias)
    uint32_t v[4][VW];                                 // the S keys: features g D/8 .. (g+1) D/8
    uint32_t vsb[4];
  };
  const uint32_t* k_words;
  const T* k_scales;
  const T* k_biases;
  const uint32_t* v_words;
  const T* v_scales;
  const T* v_biases;
  int Gn, gs;

  __device__ __forceinline__ void load_k(Chunk& c, int nt, long long row, int t) const {
#pragma unroll
    for (int s = 0; s < D / 32; ++s) {
      if (row >= 0) {
        load_words<SW>(k_words + row * W + (32 * s + 8 * t) * BITS / 32, c.k[nt][s]);
        const long long gi = row * Gn + 32 * s / gs;
        c.ksb[nt][s] = raw_pair<T>(k_scales[gi], k_biases[gi]);
      } else {
#pragma unroll
        for (int i = 0; i < SW; ++i) c.k[nt][s][i] = 0;
        c.ksb[nt][s] = 0;
      }
    }
  }
  __device__ __forceinline__ void load_v(Chunk& c, int j, long long row, int g) const {
    if (row >= 0) {
      load_words<VW>(v_words + row * W + g * VW, c.v[j]);
      const long long gi = row * Gn + g * (D / 8) / gs;
      c.vsb[j] = raw_pair<T>(v_scales[gi], v_biases[gi]);
    } else {
#pragma unroll
      for (int i = 0; i < VW; ++i) c.v[j][i] = 0;
      c.vsb[j] = 0;
    }
  }
  __device__ static constexpr int k_phys(int h, int r, int e) { return BITS == 8 ? 4 * h + 2 * r + e : 2 * h + r + 4 * e; }
  __device__ static __forceinline__ void k_frag(const Chunk& c, int nt, int ks, uint32_t& b0, uint32_t& b1) {
    const int s = ks / 2, h = ks & 1;
    if constexpr (BITS == 8) {
      const float2 sb = unpack_pair<T>(c.ksb[nt][s]);
      const uint32_t w = c.k[nt][s][h];
      b0 = pack_pair<T>(fmaf(byte_f(w, 0), sb.x, sb.y), fmaf(byte_f(w, 1), sb.x, sb.y));
      b1 = pack_pair<T>(fmaf(byte_f(w, 2), sb.x, sb.y), fmaf(byte_f(w, 3), sb.x, sb.y));
    } else {
      const uint32_t sb = c.ksb[nt][s], s2 = __byte_perm(sb, 0, 0x1010), b2 = __byte_perm(sb, 0, 0x3232);
      const uint32_t w = c.k[nt][s][0];
      b0 = dequant4_pair<T>(w >> (4 * (2 * h)), s2, b2);        // nibbles 2h, 2h + 4
      b1 = dequant4_pair<T>(w >> (4 * (2 * h + 1)), s2, b2);    // nibbles 2h + 1, 2h + 5
    }
  }
  __device__ static __forceinline__ void v_frag(const Chunk& c, int n, uint32_t& b0, uint32_t& b1) {
    if constexpr (BITS == 8) {
      const int w = n / 4, k = n % 4;
      const float2 s0 = unpack_pair<T>(c.vsb[0]), s1 = unpack_pair<T>(c.vsb[1]);
      const float2 s2 = unpack_pair<T>(c.vsb[2]), s3 = unpack_pair<T>(c.vsb[3]);
      b0 = pack_pair<T>(fmaf(byte_f(c.v[0][w], k), s0.x, s0.y), fmaf(byte_f(c.v[1][w], k), s1.x, s1.y));
      b1 = pack_pair<T>(fmaf(byte_f(c.v[2][w], k), s2.x, s2.y), fmaf(byte_f(c.v[3][w], k), s3.x, s3.y));
    } else {
      const int w = n / 8, k = (n % 8) / 2, shift = 4 * (n & 1);
      const uint32_t sel = k | k << 4 | (4 + k) << 8 | (4 + k) << 12;   // byte k of both words: bytes 0, 2
      const uint32_t x0 = __byte_perm(c.v[0][w], c.v[1][w], sel) >> shift;
      const uint32_t x1 = __byte_perm(c.v[2][w], c.v[3][w], sel) >> shift;
      b0 = dequant4_pair<T>(x0, __byte_perm(c.vsb[0], c.vsb[1], 0x5410), __byte_perm(c.vsb[0], c.vsb[1], 0x7632));
      b1 = dequant4_pair<T>(x1, __byte_perm(c.vsb[2], c.vsb[3], 0x5410), __byte_perm(c.vsb[2], c.vsb[3], 0x7632));
    }
  }
};

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
  template <int DD>
  __device__ __forceinline__ QuantMma<T, BITS, DD> mma() const {
    return {k_words, k_scales, k_biases, v_words, v_scales, v_biases, Gn, gs};
  }
};

}  // namespace

// Scalars the wrapper validates; an inconsistent set (or a format other than 4/8 bits, group 32, 64
// or 128 dividing head_dim) launches nothing rather than reading out of bounds.
#define DAQ_ENTRY(NAME, T)                                                                                  \
  extern "C" __global__ void __launch_bounds__(aot_attn::THREADS, aot_attn::blocks_per_sm<T>()) NAME(                                   \
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
    __shared__ aot_attn::Shared sh;                   /* one for both formats' instantiations */             \
    if (bits == 8)                                                                                           \
      aot_attn::attend<T>(q, out, QuantRows<T, 8>{k_pool, k_scales, k_biases, v_pool, v_scales, v_biases, W,  \
                                                   Gn, group_size},                                           \
                          kv_len, kv_end, table, workspace, locks, p, q_strides, sh);                        \
    else if (bits == 4)                                                                                      \
      aot_attn::attend<T>(q, out, QuantRows<T, 4>{k_pool, k_scales, k_biases, v_pool, v_scales, v_biases, W,  \
                                                   Gn, group_size},                                           \
                          kv_len, kv_end, table, workspace, locks, p, q_strides, sh);                        \
  }

DAQ_ENTRY(decode_attention_quantized_f16, __half)
DAQ_ENTRY(decode_attention_quantized_bf16, __nv_bfloat16)
DAQ_ENTRY(decode_attention_quantized_f32, float)
