// kv_pool_store, CUDA entry points (docs/kernel-abi.md): k and v rows into the slot-indexed pools,
// converted to the pools' dtype.
//
// Thread x of a 1-D grid owns vector u of row (t, h): x = (t * n_kv_heads + h) * units + u, with
// units = head_dim / vec_width. vec_width comes from the wrapper (registry/kernels/kv_pool_store.py
// cuda_vector_width, its one source); only the widths switched on below exist, any other launches
// nothing (tests/test_kv_pool_store.py checks the wrapper only picks these). k and v are strided
// (act_layout 0 [T, H, D] or 1 [B, H, L, D], their own Strides; aot_cuda::act_row): each is read with
// W-vectors when its strides and address allow (aot_cuda::vec_ok, one decision per buffer and
// launch), else element by element; t follows the token order (b*L + l) of slots.
#include <stdint.h>

#include "aot_cuda.cuh"

namespace {

using aot_cuda::Cvt;
using aot_cuda::Strides;
using aot_cuda::Vec;

struct Params {
  int n_tokens, pool_size, pool_rows, n_kv_heads, head_dim, pool_layout, seq_len, act_layout;
};

// One unit of W activation elements (step apart; one vector access when vec) into the pool.
template <typename A, typename P, int W>
__device__ __forceinline__ void copy_vec(const A* in, int step, bool vec, P* out) {
  const Vec<A, W> x = aot_cuda::load_unit<A, W>(in, step, vec);
  Vec<P, W> y;
#pragma unroll
  for (int j = 0; j < W; ++j) y.v[j] = Cvt<P>::store(Cvt<A>::load(x.v[j]));
  *reinterpret_cast<Vec<P, W>*>(out) = y;
}

template <typename A, typename P, int W>
__device__ void body(const A* __restrict__ k, const A* __restrict__ v, P* k_pool, P* v_pool,
                     const int32_t* __restrict__ slots, const Params& p, const Strides& k_st,
                     const Strides& v_st) {
  const int units = p.head_dim / W;
  const long long idx = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (units == 0 || idx >= static_cast<long long>(p.n_tokens) * p.n_kv_heads * units) return;
  const long long row = idx / units;            // t * n_kv_heads + h
  const int u = static_cast<int>(idx - row * units);
  const int t = static_cast<int>(row / p.n_kv_heads);
  const int h = static_cast<int>(row - static_cast<long long>(t) * p.n_kv_heads);
  const int slot = slots[t];
  // < 0: skipped; >= pool_size: never written; head-major with no rows (inconsistent scalars): nothing
  if (slot < 0 || slot >= p.pool_size || (p.pool_layout != 0 && p.pool_rows < 1)) return;
  const long long b = slot / p.pool_rows, s = slot % p.pool_rows;
  const long long dst = p.pool_layout == 0 ? (static_cast<long long>(slot) * p.n_kv_heads + h) * p.head_dim
                                           : ((b * p.n_kv_heads + h) * p.pool_rows + s) * p.head_dim;
  const long long d = static_cast<long long>(u) * W;  // the unit's first feature
  const A* ks = k + aot_cuda::act_row(t, h, k_st, p.act_layout, p.seq_len) + d * k_st.s[3];
  const A* vs = v + aot_cuda::act_row(t, h, v_st, p.act_layout, p.seq_len) + d * v_st.s[3];
  copy_vec<A, P, W>(ks, k_st.s[3], aot_cuda::vec_ok<A, W>(k, k_st), k_pool + dst + u * W);
  copy_vec<A, P, W>(vs, v_st.s[3], aot_cuda::vec_ok<A, W>(v, v_st), v_pool + dst + u * W);
}

template <typename A, typename P>
__device__ void dispatch(const A* k, const A* v, P* k_pool, P* v_pool, const int32_t* slots, int vec_width,
                         const Params& p, const Strides& k_st, const Strides& v_st) {
  // 16-byte vectors of the wider type at most: W = 8 only for two 2-byte types.
  switch (vec_width) {
    case 8:
      if constexpr (sizeof(A) == 2 && sizeof(P) == 2)
        body<A, P, 8>(k, v, k_pool, v_pool, slots, p, k_st, v_st);
      break;
    case 4: body<A, P, 4>(k, v, k_pool, v_pool, slots, p, k_st, v_st); break;
    case 2: body<A, P, 2>(k, v, k_pool, v_pool, slots, p, k_st, v_st); break;
    case 1: body<A, P, 1>(k, v, k_pool, v_pool, slots, p, k_st, v_st); break;
    default: break;
  }
}

}  // namespace

#define KV_ENTRY(NAME, A, P)                                                                            \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                               \
      const A* k, const A* v, P* k_pool, P* v_pool, const int32_t* slots, int n_tokens, int pool_size,   \
      int pool_rows, int n_kv_heads, int head_dim, int pool_layout, int vec_width, int seq_len,          \
      int act_layout, Strides k_strides, Strides v_strides) {                                           \
    const Params p{n_tokens, pool_size, pool_rows, n_kv_heads, head_dim, pool_layout, seq_len,          \
                   act_layout};                                                                          \
    if (head_dim % (vec_width < 1 ? 1 : vec_width)) return;  /* a width the row cannot hold */          \
    if (!aot_cuda::act_layout_ok(act_layout, seq_len)) return;  /* an unknown layout: nothing */        \
    dispatch<A, P>(k, v, k_pool, v_pool, slots, vec_width, p, k_strides, v_strides);                     \
  }

KV_ENTRY(kv_pool_store_f16, __half, __half)
KV_ENTRY(kv_pool_store_bf16, __nv_bfloat16, __nv_bfloat16)
KV_ENTRY(kv_pool_store_f32, float, float)
KV_ENTRY(kv_pool_store_f16_bf16, __half, __nv_bfloat16)
KV_ENTRY(kv_pool_store_f16_f32, __half, float)
KV_ENTRY(kv_pool_store_bf16_f16, __nv_bfloat16, __half)
KV_ENTRY(kv_pool_store_bf16_f32, __nv_bfloat16, float)
KV_ENTRY(kv_pool_store_f32_f16, float, __half)
KV_ENTRY(kv_pool_store_f32_bf16, float, __nv_bfloat16)
