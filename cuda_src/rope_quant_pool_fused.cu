// rope_quant_pool_fused, CUDA entry points (docs/kernel-abi.md): RoPE on q and k (after their per-head
// RMSNorm when qk_norm), then k (as returned in k_out) and v quantized into mlx-lm's quantized pools,
// bit for bit mx.quantize on CUDA, in one launch.
//
// One warp per row (one head of one token: q rows, then k rows, then v rows, token-major), 8 rows per
// 256-thread block, a 1-D grid. A q or k row: lane l owns the feature pairs p = l, l + 32, ... <
// head_dim / 2 (rotary pairs (p, p + R/2) or (2p, 2p + 1), then pass-through pairs), normalised (fp32,
// one rounding to T, as the model's norm returns T; the sum of squares a warp reduction), rotated in
// fp32 and rounded once to T into q_out / k_out. A k row's rounded values are staged in shared memory
// and quantized by the warp (aot_quant.cuh); a v row is staged from v. q/k/v/q_out/k_out are strided
// (act_layout 0 [T, H, D] or 1 [B, H, L, D], their own Strides): one element per access.
#include <stdint.h>

#include "aot_cuda.cuh"
#include "aot_quant.cuh"

namespace {

using aot_cuda::Cvt;
using aot_cuda::QuantPool;
using aot_cuda::Strides;
using aot_cuda::kQuantRowsPerBlock;

struct Params {
  int n_tokens, pool_size, pool_rows, n_q_heads, n_kv_heads, head_dim, rotary_dims, traditional, pool_layout;
  float pos_scale, mscale;
  int qk_norm;
  float eps, weight_offset;
  int bits, group_size, seq_len, act_layout;
};

struct ActStrides {
  Strides q, k, v, q_out, k_out;
};

template <typename T>
__device__ __forceinline__ float rounded(float x) { return Cvt<T>::load(Cvt<T>::store(x)); }

// q or k row: (norm,) rotate, store to `out`; with `staged`, also its rounded values as fp32.
template <typename T>
__device__ void rope_row(const T* in, long long in_step, T* out, long long out_step, const float* w,
                         const float* inv_freq, float pos, const Params& p, float* staged, int lane) {
  const int D = p.head_dim, half_rot = p.rotary_dims / 2, pairs = D / 2;
  const bool trad = p.traditional != 0;
  float r = 1.0f;
  if (p.qk_norm) {
    float ss = 0.0f;
    for (int d = lane; d < D; d += 32) {
      const float x = Cvt<T>::load(in[d * in_step]);
      ss += x * x;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(aot_cuda::kFullWarp, ss, off);
    r = rsqrtf(ss / static_cast<float>(D) + p.eps);
  }
  for (int i = lane; i < pairs; i += 32) {
    const bool rotary = i < half_rot;
    const int a = rotary ? (trad ? 2 * i : i) : p.rotary_dims + 2 * (i - half_rot);
    const int b = rotary && !trad ? a + half_rot : a + 1;
    float y1 = Cvt<T>::load(in[a * in_step]), y2 = Cvt<T>::load(in[b * in_step]);
    if (p.qk_norm) {
      y1 = rounded<T>(y1 * r * (w[a] + p.weight_offset));
      y2 = rounded<T>(y2 * r * (w[b] + p.weight_offset));
    }
    if (rotary) aot_cuda::rotate_pair(y1, y2, pos * inv_freq[i], p.mscale);
    const T o1 = Cvt<T>::store(y1), o2 = Cvt<T>::store(y2);
    out[a * out_step] = o1;
    out[b * out_step] = o2;
    if (staged != nullptr) {
      staged[a] = Cvt<T>::load(o1);
      staged[b] = Cvt<T>::load(o2);
    }
  }
}

template <typename T>
__device__ void body(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ q_out,
                     T* __restrict__ k_out, const QuantPool<T>& kp, const QuantPool<T>& vp,
                     const int32_t* __restrict__ positions, const int32_t* __restrict__ slots,
                     const float* __restrict__ table, const Params& p, const ActStrides& st) {
  __shared__ float staged_rows[kQuantRowsPerBlock][aot_cuda::kMaxQuantDim];
  const long long row_id = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int heads = p.n_q_heads + 2 * p.n_kv_heads;
  // Whole warps leave together (the shuffles below need every lane of a live row).
  if (row_id >= static_cast<long long>(p.n_tokens) * heads) return;
  const int t = static_cast<int>(row_id / heads);
  const int hh = static_cast<int>(row_id - static_cast<long long>(t) * heads);
  const int kind = hh < p.n_q_heads ? 0 : (hh < p.n_q_heads + p.n_kv_heads ? 1 : 2);   // q, k, v
  const int h = kind == 0 ? hh : (kind == 1 ? hh - p.n_q_heads : hh - p.n_q_heads - p.n_kv_heads);
  const int D = p.head_dim;
  const int slot = kind == 0 ? -1 : slots[t];
  // < 0: rotate only; >= pool_size: never written; head-major with no rows: nothing
  const bool store = kind != 0 && slot >= 0 && slot < p.pool_size && (p.pool_layout == 0 || p.pool_rows > 0);
  float* staged = staged_rows[threadIdx.x / 32];
  if (kind == 2) {
    if (!store) return;
    const T* in = v + aot_cuda::act_row(t, h, st.v, p.act_layout, p.seq_len);
    for (int d = lane; d < D; d += 32) staged[d] = Cvt<T>::load(in[static_cast<long long>(d) * st.v.s[3]]);
  } else {
    const Strides& in_st = kind == 0 ? st.q : st.k;
    const Strides& out_st = kind == 0 ? st.q_out : st.k_out;
    // table: [q_weight (D) | k_weight (D) | inv_freq (rotary_dims / 2)] with qk_norm, else [inv_freq]
    const float* w = table + (kind == 0 ? 0 : D);
    const float* inv_freq = p.qk_norm ? table + 2 * D : table;
    rope_row<T>((kind == 0 ? q : k) + aot_cuda::act_row(t, h, in_st, p.act_layout, p.seq_len), in_st.s[3],
                (kind == 0 ? q_out : k_out) + aot_cuda::act_row(t, h, out_st, p.act_layout, p.seq_len), out_st.s[3],
                w, inv_freq, static_cast<float>(positions[t]) * p.pos_scale, p, store ? staged : nullptr, lane);
    if (!store) return;
  }
  __syncwarp();
  aot_cuda::quantize_row_warp<T>(staged, D, p.bits, p.group_size, kind == 1 ? kp : vp, slot, h, p.n_kv_heads,
                                 p.pool_rows, p.pool_layout != 0, lane);
}

}  // namespace

#define RQ_ENTRY(NAME, T)                                                                                      \
  extern "C" __global__ void __launch_bounds__(256) NAME(                                                      \
      const T* q, const T* k, const T* v, T* q_out, T* k_out, uint32_t* k_pool, T* k_scales, T* k_biases,       \
      uint32_t* v_pool, T* v_scales, T* v_biases, const int32_t* positions, const int32_t* slots,               \
      const float* table, int n_tokens, int pool_size, int pool_rows, int n_q_heads, int n_kv_heads,            \
      int head_dim, int rotary_dims, int traditional, int pool_layout, float pos_scale, float mscale,           \
      int qk_norm, float eps, float weight_offset, int bits, int group_size, int seq_len, int act_layout,       \
      Strides q_strides, Strides k_strides, Strides v_strides, Strides q_out_strides, Strides k_out_strides) {   \
    const Params p{n_tokens, pool_size, pool_rows, n_q_heads, n_kv_heads, head_dim, rotary_dims, traditional,  \
                   pool_layout, pos_scale, mscale, qk_norm, eps, weight_offset, bits, group_size, seq_len,      \
                   act_layout};                                                                                 \
    const ActStrides st{q_strides, k_strides, v_strides, q_out_strides, k_out_strides};                        \
    /* a format, layout or block the kernel does not implement (the wrapper never passes one): nothing */      \
    if (!aot_cuda::quant_format_ok(bits, group_size, head_dim) || head_dim % 2 || rotary_dims > head_dim ||     \
        !aot_cuda::act_layout_ok(act_layout, seq_len) || blockDim.x != 32 * kQuantRowsPerBlock)                     \
      return;                                                                                                  \
    body<T>(q, k, v, q_out, k_out, QuantPool<T>{k_pool, k_scales, k_biases},                                   \
            QuantPool<T>{v_pool, v_scales, v_biases}, positions, slots, table, p, st);                         \
  }

RQ_ENTRY(rope_quant_pool_fused_f16, __half)
RQ_ENTRY(rope_quant_pool_fused_bf16, __nv_bfloat16)
RQ_ENTRY(rope_quant_pool_fused_f32, float)
