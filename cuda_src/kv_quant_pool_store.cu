// kv_quant_pool_store, CUDA entry points (docs/kernel-abi.md): k and v rows quantized into mlx-lm's
// quantized pools (packed uint32 words, scales, biases), bit for bit mx.quantize on CUDA.
//
// One warp per row (one head of one token, k or v: row = (t * 2 + side) * n_kv_heads + h), 8 rows per
// 256-thread block, a 1-D grid (prefill sizes never meet the 65535-block limit of the other axes).
// The warp stages the row in shared memory as fp32 (k and v are strided: act_layout 0 [T, H, D] or 1
// [B, H, L, D], their own Strides; aot_cuda::act_row), then quantizes it (aot_quant.cuh).
#include <stdint.h>

#include "aot_cuda.cuh"
#include "aot_quant.cuh"

namespace {

using aot_cuda::QuantPool;
using aot_cuda::Strides;
using aot_cuda::kQuantRowsPerBlock;

struct Params {
  int n_tokens, pool_size, pool_rows, n_kv_heads, head_dim, pool_layout, bits, group_size, seq_len, act_layout;
};

template <typename T>
__device__ void body(const T* __restrict__ k, const T* __restrict__ v, const QuantPool<T>& kp, const QuantPool<T>& vp,
                     const int32_t* __restrict__ slots, const Params& p, const Strides& k_st, const Strides& v_st) {
  __shared__ float staged[kQuantRowsPerBlock][aot_cuda::kMaxQuantDim];
  const long long row_id = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  // Whole warps leave together (the quantization's shuffles need every lane of a live row).
  if (row_id >= 2LL * p.n_tokens * p.n_kv_heads) return;
  const int t = static_cast<int>(row_id / (2 * p.n_kv_heads));
  const int rest = static_cast<int>(row_id - 2LL * t * p.n_kv_heads);
  const bool is_v = rest >= p.n_kv_heads;
  const int h = is_v ? rest - p.n_kv_heads : rest;
  const int slot = slots[t];
  // < 0: skipped; >= pool_size: never written; head-major with no rows (inconsistent scalars): nothing
  if (slot < 0 || slot >= p.pool_size || (p.pool_layout != 0 && p.pool_rows < 1)) return;
  const Strides& st = is_v ? v_st : k_st;
  const T* in = (is_v ? v : k) + aot_cuda::act_row(t, h, st, p.act_layout, p.seq_len);
  float* x = staged[threadIdx.x / 32];
  for (int d = lane; d < p.head_dim; d += 32) x[d] = aot_cuda::Cvt<T>::load(in[static_cast<long long>(d) * st.s[3]]);
  __syncwarp();
  aot_cuda::quantize_row_warp<T>(x, p.head_dim, p.bits, p.group_size, is_v ? vp : kp, slot, h, p.n_kv_heads,
                                 p.pool_rows, p.pool_layout != 0, lane);
}

}  // namespace

#define KVQ_ENTRY(NAME, T)                                                                                    \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                                     \
      const T* k, const T* v, uint32_t* k_pool, T* k_scales, T* k_biases, uint32_t* v_pool, T* v_scales,       \
      T* v_biases, const int32_t* slots, int n_tokens, int pool_size, int pool_rows, int n_kv_heads,          \
      int head_dim, int pool_layout, int bits, int group_size, int seq_len, int act_layout, Strides k_strides, \
      Strides v_strides) {                                                                                    \
    const Params p{n_tokens, pool_size, pool_rows, n_kv_heads, head_dim, pool_layout, bits, group_size,       \
                   seq_len, act_layout};                                                                      \
    /* a format, layout or block the kernel does not implement (the wrapper never passes one): nothing */     \
    if (!aot_cuda::quant_format_ok(bits, group_size, head_dim) || !aot_cuda::act_layout_ok(act_layout, seq_len) \
        || blockDim.x != 32 * kQuantRowsPerBlock)                                                                  \
      return;                                                                                                 \
    body<T>(k, v, QuantPool<T>{k_pool, k_scales, k_biases}, QuantPool<T>{v_pool, v_scales, v_biases}, slots, p, \
            k_strides, v_strides);                                                                            \
  }

KVQ_ENTRY(kv_quant_pool_store_f16, __half)
KVQ_ENTRY(kv_quant_pool_store_bf16, __nv_bfloat16)
KVQ_ENTRY(kv_quant_pool_store_f32, float)
