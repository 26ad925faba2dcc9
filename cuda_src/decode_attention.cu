// decode_attention, CUDA entry points (docs/kernel-abi.md): attention of a few query tokens per
// sequence over K/V read in place from a head-major cache [B, Hkv, S, D] or a slot-major pool
// [P, Hkv, D] through a slot table, with each row's valid range as data (kv_len, kv_end).
//
// Block (split, kv head, batch row) of 128 threads (4 warps) reads each key/value row of its part of
// the sequence once for all the query rows of its kv head (grouped-query heads x L tokens), so the
// cache is read once per step whatever the head ratio. Within a warp, LPK = D / 8 lanes (rounded up
// to a power of two) hold one key's row, 8 elements each (16-byte loads for 2-byte types), so loads
// are coalesced and a dot product is LPK-lane shuffles. Softmax is online (base 2), per lane group,
// then merged across lane groups, warps and, with n_splits > 1, across the blocks of a row
// (flash-decoding): each block writes (max, sum, unnormalised output) to the workspace and the last
// block to arrive (a counter per (row, kv head) in `locks`, reset by that block) combines them.
// float16 and bfloat16 at head_dim 64 or 128 take the tensor-core path instead (mma.m16n8k16 for Q K^T
// and P V, a warp per 16 keys). All of that is aot_attention.cuh's attend (decode_attention_quantized's
// too); this file has the float rows' policies: raw 16-byte units, unpacked (SIMT) or handed to the mma
// as they are.
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "aot_attention.cuh"
#include "aot_cuda.cuh"

namespace {

using aot_cuda::Cvt;
using aot_cuda::Strides;
using namespace aot_attn;

// EPL elements of a row kept as raw 16-byte units until used (registers: 4 per unit, not 8 floats),
// so more rows can be in flight per thread.
template <typename T>
struct Raw {
  static constexpr int N = sizeof(T) * EPL / 16;      // 16-byte units per lane
  uint4 u[N];
};
template <typename T>
__device__ __forceinline__ void load_raw(const T* p, Raw<T>& r) {
#pragma unroll
  for (int i = 0; i < Raw<T>::N; ++i) r.u[i] = *reinterpret_cast<const uint4*>(p + i * (16 / sizeof(T)));
}
template <typename T>
__device__ __forceinline__ void zero_raw(Raw<T>& r) {
#pragma unroll
  for (int i = 0; i < Raw<T>::N; ++i) r.u[i] = make_uint4(0, 0, 0, 0);
}
template <typename T>
__device__ __forceinline__ void unpack(const Raw<T>& r, float (&x)[EPL]) {
  if constexpr (sizeof(T) == 2 && std::is_same_v<T, __nv_bfloat16>) {   // bf16: the top half of an fp32
    const uint32_t* w = reinterpret_cast<const uint32_t*>(r.u);
#pragma unroll
    for (int j = 0; j < EPL / 2; ++j) {
      x[2 * j] = __uint_as_float(w[j] << 16);
      x[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
  } else {
    const T* e = reinterpret_cast<const T*>(r.u);
#pragma unroll
    for (int j = 0; j < EPL; ++j) x[j] = Cvt<T>::load(e[j]);
  }
}

// 32-bit word i of a 16-byte unit (i known at compile time once unrolled).
__device__ __forceinline__ uint32_t word(const uint4& u, int i) { return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w; }

// Float K/V rows on the tensor-core path (aot_attention.cuh, attend_mma_block): raw 16-byte units, the
// mma's B operands taken from them as they are (K: a span's 8 features are k-steps 2s and 2s+1 in
// order) or paired across two keys (V: one PRMT per pair).
template <typename T, int D>
struct FloatMma {
  static constexpr int KT = D == 64 ? 2 : 1;            // keys in flight per warp: 16 at D = 128
  struct Chunk {
    uint4 k[2][D / 32];                                  // keys g, 8+g: features 32s + 8t .. +8
    uint4 v[4][D / 64];                                  // the S keys: features g D/8 .. (g+1) D/8
  };
  const T* k_pool;
  const T* v_pool;

  __device__ __forceinline__ void load_k(Chunk& c, int nt, long long row, int t) const {
#pragma unroll
    for (int s = 0; s < D / 32; ++s)
      c.k[nt][s] = row >= 0 ? *reinterpret_cast<const uint4*>(k_pool + row * D + 32 * s + 8 * t) : make_uint4(0, 0, 0, 0);
  }
  __device__ __forceinline__ void load_v(Chunk& c, int j, long long row, int g) const {
#pragma unroll
    for (int u = 0; u < D / 64; ++u)
      c.v[j][u] = row >= 0 ? *reinterpret_cast<const uint4*>(v_pool + row * D + g * (D / 8) + 8 * u) : make_uint4(0, 0, 0, 0);
  }
  __device__ static constexpr int k_phys(int h, int r, int e) { return 4 * h + 2 * r + e; }
  __device__ static __forceinline__ void k_frag(const Chunk& c, int nt, int ks, uint32_t& b0, uint32_t& b1) {
    b0 = word(c.k[nt][ks / 2], 2 * (ks & 1));
    b1 = word(c.k[nt][ks / 2], 2 * (ks & 1) + 1);
  }
  __device__ static __forceinline__ void v_frag(const Chunk& c, int n, uint32_t& b0, uint32_t& b1) {
    const int u = n / 8, w = (n % 8) / 2;
    const uint32_t sel = n & 1 ? 0x7632u : 0x5410u;      // the high or low halves of two words
    b0 = __byte_perm(word(c.v[0][u], w), word(c.v[1][u], w), sel);
    b1 = __byte_perm(word(c.v[2][u], w), word(c.v[3][u], w), sel);
  }
};

// Float K/V rows: a lane's EPL elements of a key and a value row as raw 16-byte units.
template <typename T>
struct FloatRows {
  struct Lane {
    Raw<T> r;
  };
  const T* k_pool;
  const T* v_pool;
  int D;

  __device__ __forceinline__ void load(long long row, int d0, Lane& kl, Lane& vl) const {
    load_raw<T>(k_pool + row * D + d0, kl.r);
    load_raw<T>(v_pool + row * D + d0, vl.r);
  }
  __device__ static __forceinline__ void zero(Lane& kl, Lane& vl) {
    zero_raw<T>(kl.r);
    zero_raw<T>(vl.r);
  }
  __device__ static __forceinline__ void keys(const Lane& kl, float (&kf)[EPL]) { unpack<T>(kl.r, kf); }
  __device__ static __forceinline__ float dot(const Lane&, const float (&kf)[EPL], const float (&qv)[EPL], float) {
    float d = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) d = fmaf(qv[e], kf[e], d);
    return d;
  }
  __device__ static __forceinline__ void values(const Lane& vl, float (&vf)[EPL]) { unpack<T>(vl.r, vf); }
  template <int DD>
  __device__ __forceinline__ FloatMma<T, DD> mma() const { return {k_pool, v_pool}; }
};

}  // namespace

// Scalars the wrapper validates; an inconsistent set launches nothing rather than reading out of bounds.
#define DA_ENTRY(NAME, T)                                                                                 \
  extern "C" __global__ void __launch_bounds__(THREADS, blocks_per_sm<T>()) NAME(                                             \
      const T* q, T* out, const T* k_pool, const T* v_pool, const int32_t* kv_len, const int32_t* kv_end,  \
      const int32_t* table, float* workspace, int32_t* locks, int batch, int seq_len, int n_q_heads,       \
      int n_kv_heads, int head_dim, int pool_layout, int pool_rows, int table_cols, int window,             \
      float scale, float softcap, int n_splits, int split_len, Strides q_strides) {                        \
    const Shape p{batch,      seq_len, n_q_heads, n_kv_heads, head_dim, pool_layout, pool_rows,            \
                  table_cols, window,  scale,     softcap,    n_splits, split_len};                        \
    if (!shape_ok(p)) return;                                                                             \
    __shared__ Shared sh;                                                                                 \
    attend<T>(q, out, FloatRows<T>{k_pool, v_pool, head_dim}, kv_len, kv_end, table, workspace, locks, p,   \
              q_strides, sh);                                                                             \
  }

DA_ENTRY(decode_attention_f16, __half)
DA_ENTRY(decode_attention_bf16, __nv_bfloat16)
DA_ENTRY(decode_attention_f32, float)
