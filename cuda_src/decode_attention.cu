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
// All of that is aot_attention.cuh's attend (decode_attention_quantized's too); this file has the
// float rows' policy: raw 16-byte units per lane, unpacked when used.
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
};

}  // namespace

// Scalars the wrapper validates; an inconsistent set launches nothing rather than reading out of bounds.
#define DA_ENTRY(NAME, T)                                                                                 \
  extern "C" __global__ void __launch_bounds__(THREADS, 3) NAME(                                             \
      const T* q, T* out, const T* k_pool, const T* v_pool, const int32_t* kv_len, const int32_t* kv_end,  \
      const int32_t* table, float* workspace, int32_t* locks, int batch, int seq_len, int n_q_heads,       \
      int n_kv_heads, int head_dim, int pool_layout, int pool_rows, int table_cols, int window,             \
      float scale, float softcap, int n_splits, int split_len, Strides q_strides) {                        \
    const Shape p{batch,      seq_len, n_q_heads, n_kv_heads, head_dim, pool_layout, pool_rows,            \
                  table_cols, window,  scale,     softcap,    n_splits, split_len};                        \
    if (!shape_ok(p)) return;                                                                             \
    attend<T>(q, out, FloatRows<T>{k_pool, v_pool, head_dim}, kv_len, kv_end, table, workspace, locks, p,   \
              q_strides);                                                                                 \
  }

DA_ENTRY(decode_attention_f16, __half)
DA_ENTRY(decode_attention_bf16, __nv_bfloat16)
DA_ENTRY(decode_attention_f32, float)
