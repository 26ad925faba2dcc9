// What the CUDA decode attention kernels share (docs/kernel-abi.md, decode_attention and
// decode_attention_quantized): a block (split, kv head, batch row) of 4 warps reads each key/value row
// of its part of a row's valid range once for every query row of its kv head (grouped heads x L
// tokens, RC at a time), LPK lanes per key, EPL features per lane; an online softmax in base 2 per
// lane group, merged across lane groups and warps, then, with n_splits > 1, across the blocks of a row
// (flash-decoding: each block's (max, sum, unnormalised output) in the workspace, the last block to
// arrive combines them, a counter per (row, kv head) in `locks`, reset by that block). How a key's
// row is loaded and turned into features is the kernel's own: a Rows policy (attend_block).
#pragma once
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "aot_cuda.cuh"

namespace aot_attn {

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int EPL = 8;         // features of a row per lane
constexpr int RC = 4;          // query rows per pass over the keys (accumulators live in registers)
constexpr int TILE = 4;        // key steps loaded before any is used (latency)
constexpr int MAX_DIM = 256;   // EPL * 32 lanes
constexpr int MAX_SPLITS = 128;
constexpr float LOG2E = 1.4426950408889634f;

// Sum over the LPK lanes of a key's row (lanes xor-adjacent within the group).
template <int LPK>
__device__ __forceinline__ float group_sum(float x) {
#pragma unroll
  for (int o = LPK / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// 2^x with the hardware's approximation (relative error about 2^-22): exp2f's exact path costs
// several instructions per score, and a decode step computes one per key and query row.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tanh from exp2, to about 1e-7 absolute (an exact formula, not tanh.approx).
__device__ __forceinline__ float tanh_precise(float x) {
  const float t = 1.f - 2.f / (exp2f(2.f * LOG2E * fabsf(x)) + 1.f);
  return copysignf(t, x);
}

// Combine (m, l, acc) with another partial of the same rows (base-2 log-sum-exp).
__device__ __forceinline__ void merge(float& m, float& l, float* acc, float mo, float lo, const float* acco) {
  const float mn = fmaxf(m, mo);
  const float a = m == -INFINITY ? 0.f : fast_exp2(m - mn);
  const float b = mo == -INFINITY ? 0.f : fast_exp2(mo - mn);
  l = l * a + lo * b;
#pragma unroll
  for (int e = 0; e < EPL; ++e) acc[e] = acc[e] * a + acco[e] * b;
  m = mn;
}

constexpr int MMA_ROWS = 8;    // tensor-core path: query rows per pass (the mma tile's rows 0..7)
constexpr int MMA_DIM = 128;   // tensor-core path: the largest head_dim

// Shared memory of a block, declared once per kernel (every instantiation of attend_block shares it).
struct Shared {
  union {                                      // per warp: (output, max, sum) of the pass's rows
    float part[WARPS][RC][MAX_DIM + 2];        // the SIMT path
    float mma_part[WARPS][MMA_ROWS][MMA_DIM + 2];   // the tensor-core path
  };
  uint2 q_frag[MMA_DIM / 16][32];        // tensor-core path: Q's A operands per k-step and lane
  float weight[WARPS][MAX_SPLITS];       // the split merge: each split's weight for a warp's row
  int last_block;
};

// The scalars every decode attention kernel takes, in its own order.
struct Shape {
  int batch, seq_len, n_q_heads, n_kv_heads, head_dim, pool_layout, pool_rows, table_cols, window;
  float scale, softcap;
  int n_splits, split_len;
};

// Whether the launch's scalars and geometry are ones the kernels implement (else they write nothing).
__device__ __forceinline__ bool shape_ok(const Shape& p) {
  return p.head_dim >= 8 && p.head_dim <= MAX_DIM && p.head_dim % 8 == 0 && p.n_kv_heads >= 1 &&
         p.n_q_heads % p.n_kv_heads == 0 && p.seq_len >= 1 && p.n_splits >= 1 && p.n_splits <= MAX_SPLITS &&
         p.split_len >= 1 && blockDim.x == THREADS && static_cast<int>(gridDim.x) == p.n_splits &&
         static_cast<int>(gridDim.y) == p.n_kv_heads && static_cast<int>(gridDim.z) == p.batch &&
         (p.pool_layout == 0 ? p.table_cols >= 0 : p.pool_rows >= 1) &&
         static_cast<long long>(p.n_splits) * p.split_len >= (p.pool_layout == 0 ? p.table_cols : p.pool_rows);
}

// This block's part of row b's keys, and where they lie.
struct Keys {
  int n, first, k_lo, k_hi;
  long long head_rows;       // head-major: row index of buffer row 0 of (b, kv head)
};

__device__ __forceinline__ Keys block_keys(const Shape& p, const int32_t* kv_len, const int32_t* kv_end, int b, int hk,
                                          int split) {
  Keys k;
  const int rows = p.pool_layout == 0 ? p.table_cols : p.pool_rows;
  k.n = min(max(kv_len[b], 0), rows);                  // valid keys of this row
  k.first = 0;                                         // head-major: buffer row of logical key 0
  if (p.pool_layout != 0) {
    k.first = static_cast<int>((static_cast<long long>(kv_end[b]) - k.n) % rows);   // 64-bit: any int32 kv_end
    if (k.first < 0) k.first += rows;
  }
  const int lo_win = p.window > 0 ? max(0, k.n - p.seq_len - p.window + 1) : 0;
  k.k_lo = max(split * p.split_len, lo_win);
  k.k_hi = min((split + 1) * p.split_len, k.n);
  k.head_rows = (static_cast<long long>(b) * p.n_kv_heads + hk) * rows;
  return k;
}

// The pool row index of logical key i (the pool seen as [rows, width]: head-major (b * Hkv + hk) * S +
// buffer row, slot-major slot * Hkv + hk), or -1: past the block's keys, a slot outside the pool.
__device__ __forceinline__ long long key_row(const Shape& p, const Keys& k, const int32_t* table, int b, int hk, int i) {
  if (i >= k.k_hi) return -1;
  if (p.pool_layout == 0) {
    const int slot = table[static_cast<long long>(b) * p.table_cols + i];
    return slot >= 0 && slot < p.pool_rows ? static_cast<long long>(slot) * p.n_kv_heads + hk : -1;
  }
  const int rows = p.pool_rows;
  return k.head_rows + (k.first + i < rows ? k.first + i : k.first + i - rows);   // ring order
}

// Tile step j of a warp's key loop (step0: the loop's step): the pool row of this lane group's key
// (-1: none) and, in `key`, its logical index (past every query row's last key when none).
__device__ __forceinline__ long long tile_key(const Shape& p, const Keys& k, const int32_t* table, int b, int hk,
                                              int step0, int j, int kpi, int grp, int& key) {
  const int i = k.k_lo + (step0 + j * WARPS) * kpi + grp;
  const long long row = key_row(p, k, table, b, hk, i);
  key = row >= 0 ? i : 0x7fffffff;
  return row;
}

// A pass's query rows: q [B, Hq, L, D] (strided) pre-scaled into base 2 (or by scale alone when
// soft-capping comes first), and the keys each sees, [lo_r, hi_r].
template <typename T, bool CAP>
__device__ __forceinline__ void load_queries(const T* q, const aot_cuda::Strides& qs, const Shape& p, const Keys& k, int b,
                                             int hk, int r0, int d0, bool dims, float (&qv)[RC][EPL],
                                             float (&acc)[RC][EPL], float (&m)[RC], float (&l)[RC], int (&hi_r)[RC],
                                             int (&lo_r)[RC]) {
  const int L = p.seq_len, G = p.n_q_heads / p.n_kv_heads, R = G * L;
  const float qscale = CAP ? p.scale : p.scale * LOG2E;
#pragma unroll
  for (int r = 0; r < RC; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    const int row = r0 + r, g = row / L, t = row % L, hq = hk * G + g;
    hi_r[r] = row < R ? k.n - L + t : -1;
    lo_r[r] = p.window > 0 ? hi_r[r] - p.window + 1 : 0;
    const long long base = static_cast<long long>(b) * qs.s[0] + static_cast<long long>(hq) * qs.s[1] +
                           static_cast<long long>(t) * qs.s[2];
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      acc[r][e] = 0.f;
      const bool ok = row < R && dims;
      qv[r][e] = ok ? aot_cuda::Cvt<T>::load(q[base + static_cast<long long>(d0 + e) * qs.s[3]]) * qscale : 0.f;
    }
  }
}

// A score of a lane group's dot product: soft-capped when CAP (inv_cap = 1 / softcap), base 2.
template <bool CAP>
__device__ __forceinline__ float score(float dot, const Shape& p, float inv_cap) {
  if constexpr (CAP) return p.softcap * LOG2E * tanh_precise(dot * inv_cap);
  return dot;
}

// Score of key `key` for a query row that sees [lo, hi]: -INFINITY where it sees it not. Not MASKED
// (L = 1, no window): every key in range is visible to every row (invalid keys: INT_MAX, past hi).
template <bool CAP, bool MASKED>
__device__ __forceinline__ float seen_score(float dot, int key, int lo, int hi, const Shape& p, float inv_cap) {
  const bool see = MASKED ? key <= hi && key >= lo : key <= hi;
  return see ? score<CAP>(dot, p, inv_cap) : -INFINITY;
}

// acc[r] += s[r][j] * v (a lane's EPL value features; s: the tile's probabilities) for every query
// row of the pass.
__device__ __forceinline__ void accumulate(float (&acc)[RC][EPL], const float (&s)[RC][TILE], int j,
                                           const float (&vf)[EPL]) {
#pragma unroll
  for (int r = 0; r < RC; ++r) {
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[r][e] = fmaf(s[r][j], vf[e], acc[r][e]);
  }
}

// The online softmax over a tile of scores s[r][j] (-INFINITY: not seen), in place: s becomes the
// probabilities (base 2), what came before is rescaled.
__device__ __forceinline__ void softmax_tile(float (&s)[RC][TILE], float (&m)[RC], float (&l)[RC],
                                             float (&acc)[RC][EPL]) {
#pragma unroll
  for (int r = 0; r < RC; ++r) {
    float mt = -INFINITY;
#pragma unroll
    for (int j = 0; j < TILE; ++j) mt = fmaxf(mt, s[r][j]);
    const float mn = fmaxf(m[r], mt);
    const float base = mn == -INFINITY ? 0.f : mn;   // nothing seen yet: every 2^(-inf - 0) is 0
    const float a = fast_exp2(m[r] - base);           // rescale what came before (2^-inf = 0)
    l[r] *= a;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[r][e] *= a;
#pragma unroll
    for (int j = 0; j < TILE; ++j) {
      s[r][j] = fast_exp2(s[r][j] - base);
      l[r] += s[r][j];
    }
    m[r] = mn;
  }
}

// A pass's rows from every warp's partial (part: [WARPS][nrows][cap + 2], output features then max
// and sum), merged: each row's output stored (one split) or its partial written to the workspace.
// Called after a __syncthreads that publishes part; returns after one that frees it.
template <typename T>
__device__ void store_pass(T* out, float* workspace, const Shape& p, const float* part, int nrows, int cap, int b,
                           int hk, int split, int r0) {
  const int D = p.head_dim, L = p.seq_len, G = p.n_q_heads / p.n_kv_heads, R = G * L;
  const int rows_here = min(nrows, R - r0);
  for (int idx = threadIdx.x; idx < rows_here * D; idx += THREADS) {
    const int r = idx / D, d = idx % D, row = r0 + r;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, part[(w * nrows + r) * (cap + 2) + cap]);
    float sum = 0.f, val = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float* pw = part + (w * nrows + r) * (cap + 2);
        const float mw = pw[cap];
        const float f = mw == -INFINITY ? 0.f : fast_exp2(mw - mx);
        sum += pw[cap + 1] * f;
        val += pw[d] * f;
      }
    }
    const int g = row / L, t = row % L, hq = hk * G + g;
    if (p.n_splits == 1) {
      const long long o = ((static_cast<long long>(b) * p.n_q_heads + hq) * L + t) * D + d;
      out[o] = aot_cuda::Cvt<T>::store(sum > 0.f ? val / sum : 0.f);
    } else {
      float* w = workspace + ((static_cast<long long>(b * p.n_kv_heads + hk) * p.n_splits + split) * R + row) * (D + 2);
      w[d] = val;
      if (d == 0) {
        w[D] = mx;
        w[D + 1] = sum;
      }
    }
  }
  __syncthreads();
}

// The end of a pass: lane groups, then warps merged; each row's output stored (one split) or its
// partial written to the workspace.
template <typename T, int LPK>
__device__ void finish_pass(T* out, float* workspace, const Shape& p, Shared& sh, int b, int hk,
                                            int split, int r0, int d0, bool dims, float (&m)[RC], float (&l)[RC],
                                            float (&acc)[RC][EPL]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / LPK;
  // Lane groups of a warp hold the same features of different keys: merge them.
#pragma unroll
  for (int r = 0; r < RC; ++r) {
    for (int o = LPK; o < 32; o *= 2) {
      float acco[EPL];
      const float mo = __shfl_xor_sync(0xffffffffu, m[r], o);
      const float lo = __shfl_xor_sync(0xffffffffu, l[r], o);
#pragma unroll
      for (int e = 0; e < EPL; ++e) acco[e] = __shfl_xor_sync(0xffffffffu, acc[r][e], o);
      merge(m[r], l[r], acc[r], mo, lo, acco);
    }
    if (grp == 0 && dims) {
#pragma unroll
      for (int e = 0; e < EPL; ++e) sh.part[warp][r][d0 + e] = acc[r][e];
    }
    if (lane == 0) {
      sh.part[warp][r][MAX_DIM] = m[r];
      sh.part[warp][r][MAX_DIM + 1] = l[r];
    }
  }
  __syncthreads();
  store_pass<T>(out, workspace, p, &sh.part[0][0][0], RC, MAX_DIM, b, hk, split, r0);
}

// Flash-decoding (n_splits > 1): the last block of this (row, kv head) to finish combines every split.
template <typename T>
__device__ void combine_splits(T* out, float* workspace, int32_t* locks, const Shape& p, Shared& sh, int b, int hk) {
  const int D = p.head_dim, L = p.seq_len, G = p.n_q_heads / p.n_kv_heads, R = G * L;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __threadfence();
  __syncthreads();
  int32_t* lock = locks + b * p.n_kv_heads + hk;
  if (threadIdx.x == 0) sh.last_block = atomicAdd(lock, 1) == p.n_splits - 1;
  __syncthreads();
  if (!sh.last_block) return;
  __threadfence();
  const float* ws = workspace + static_cast<long long>(b * p.n_kv_heads + hk) * p.n_splits * R * (D + 2);
  const int S = p.n_splits;
  for (int row = warp; row < R; row += WARPS) {        // a warp per query row
    float mx = -INFINITY;
    for (int s = lane; s < S; s += 32) mx = fmaxf(mx, __ldcg(ws + (static_cast<long long>(s) * R + row) * (D + 2) + D));
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float sum = 0.f;
    for (int s = lane; s < S; s += 32) {
      const float* w = ws + (static_cast<long long>(s) * R + row) * (D + 2);
      const float ms = __ldcg(w + D);
      const float f = ms == -INFINITY ? 0.f : fast_exp2(ms - mx);
      sh.weight[warp][s] = f;
      sum += f * __ldcg(w + D + 1);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    __syncwarp();
    const int g = row / L, t = row % L, hq = hk * G + g;
    T* o = out + ((static_cast<long long>(b) * p.n_q_heads + hq) * L + t) * D;
    for (int d = lane; d < D; d += 32) {
      float val = 0.f;
#pragma unroll 8
      for (int s = 0; s < S; ++s) val = fmaf(__ldcg(ws + (static_cast<long long>(s) * R + row) * (D + 2) + d), sh.weight[warp][s], val);
      o[d] = aot_cuda::Cvt<T>::store(sum > 0.f ? val / sum : 0.f);
    }
    __syncwarp();
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicExch(lock, 0);   // zero at rest, for the next launch
}

// One block's attention (module comment); MASKED: rows see different keys (L > 1 or a window).
// `Rows` is the kernel's policy for its K/V rows:
//   Rows::Lane                   a lane's share of one key's and one value's row (registers);
//   rows.load(row, d0, kl, vl)   loads it (row: the pool row index, key_row's), zero(kl, vl) a nothing;
//   Rows::keys(kl, kf)           the lane's EPL key features;
//   Rows::dot(kl, kf, qv, qsum)  a query row's partial score from them (qsum: the sum of its qv);
//   Rows::values(vl, vf)         the lane's EPL value features.
template <typename T, int LPK, bool CAP, bool MASKED, typename Rows>
__device__ __forceinline__ void attend_block(const T* __restrict__ q, T* __restrict__ out, const Rows rows,
                                             const int32_t* __restrict__ kv_len, const int32_t* __restrict__ kv_end,
                                             const int32_t* __restrict__ table, float* workspace, int32_t* locks,
                                             const Shape& p, const aot_cuda::Strides& qs, Shared& sh) {
  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int D = p.head_dim, R = (p.n_q_heads / p.n_kv_heads) * p.seq_len;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int kpi = 32 / LPK;                         // keys per warp step: LPK * EPL >= D
  const int grp = lane / LPK, sub = lane % LPK;
  const int d0 = sub * EPL;                             // this lane's first feature
  const bool dims = d0 < D;                             // D % 8 == 0: all EPL features or none
  const Keys keys = block_keys(p, kv_len, kv_end, b, hk, split);
  const float inv_cap = CAP ? 1.f / p.softcap : 0.f;
  for (int r0 = 0; r0 < R; r0 += RC) {
    float qv[RC][EPL], acc[RC][EPL], m[RC], l[RC], qsum[RC];
    int hi_r[RC], lo_r[RC];                             // the keys query row r sees: [lo_r, hi_r]
    load_queries<T, CAP>(q, qs, p, keys, b, hk, r0, d0, dims, qv, acc, m, l, hi_r, lo_r);
#pragma unroll
    for (int r = 0; r < RC; ++r) {
      qsum[r] = 0.f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) qsum[r] += qv[r][e];
    }
    for (int step0 = warp; keys.k_lo + step0 * kpi < keys.k_hi; step0 += WARPS * TILE) {
      typename Rows::Lane kl[TILE], vl[TILE];
      int key[TILE];
#pragma unroll
      for (int j = 0; j < TILE; ++j) {                  // every load of the tile first: latency overlaps
        const long long row = tile_key(p, keys, table, b, hk, step0, j, kpi, grp, key[j]);
        if (row >= 0 && dims) {
          rows.load(row, d0, kl[j], vl[j]);
        } else {
          Rows::zero(kl[j], vl[j]);
        }
      }
      float s[RC][TILE];
#pragma unroll
      for (int j = 0; j < TILE; ++j) {
        float kf[EPL];
        Rows::keys(kl[j], kf);
#pragma unroll
        for (int r = 0; r < RC; ++r) {
          const float dot = group_sum<LPK>(Rows::dot(kl[j], kf, qv[r], qsum[r]));
          s[r][j] = seen_score<CAP, MASKED>(dot, key[j], lo_r[r], hi_r[r], p, inv_cap);
        }
      }
      softmax_tile(s, m, l, acc);
#pragma unroll
      for (int j = 0; j < TILE; ++j) {
        float vf[EPL];
        Rows::values(vl[j], vf);
        accumulate(acc, s, j, vf);
      }
    }
    finish_pass<T, LPK>(out, workspace, p, sh, b, hk, split, r0, d0, dims, m, l, acc);
  }
  if (p.n_splits > 1) combine_splits<T>(out, workspace, locks, p, sh, b, hk);
}

// attend_block with soft-capping and MASKED as compile-time choices (the per-key loop then has no
// branch for either); Rows carries everything else.
template <typename T, int LPK, typename Rows>
__device__ __forceinline__ void attend_block_of(const T* q, T* out, const Rows rows, const int32_t* kv_len,
                                                const int32_t* kv_end, const int32_t* table, float* workspace,
                                                int32_t* locks, const Shape& p, const aot_cuda::Strides& qs,
                                                Shared& sh) {
  const bool masked = p.seq_len > 1 || p.window > 0;
  if (p.softcap > 0.f) {
    masked ? attend_block<T, LPK, true, true>(q, out, rows, kv_len, kv_end, table, workspace, locks, p, qs, sh)
           : attend_block<T, LPK, true, false>(q, out, rows, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  } else {
    masked ? attend_block<T, LPK, false, true>(q, out, rows, kv_len, kv_end, table, workspace, locks, p, qs, sh)
           : attend_block<T, LPK, false, false>(q, out, rows, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  }
}

// ---- The tensor-core path: 2-byte types at head_dim 64 or 128 --------------------------------------
// A warp takes chunks of KC = 16 keys; per chunk, S = Q K^T is two mma.m16n8k16 n-tiles of 8 keys
// (Q: the tile's rows 0..7 are the pass's query rows, 8..15 zero) and O += P V is D / 8 n-tiles of 8
// features, with P straight from S's accumulators (the layout of the next mma's A operand). With
// g = lane / 4 and t = lane % 4 (the mma's group and thread-in-group), a thread:
//   - holds query row g of the pass, and S for keys 2t, 2t+1 (n-tile 0) and 8+2t, 9+2t (n-tile 1);
//   - loads K for keys g and 8+g, features [32s + 8t, 32s + 8t + 8) of each 32-feature span s: the
//     mma's k order within a span is permuted (Mma::k_phys), Q's fragments follow the same order;
//   - loads V for its four S keys, features [g D/8, (g+1) D/8): n-tile n's column g is feature
//     g D/8 + n, so its output holds features [2t D/8, (2t+2) D/8) of row g.
// The K/V rows policy (Mma) turns its registers into the mma's B operands: raw pairs for float caches,
// dequantized pairs for quantized ones. One online softmax per query row, its max shared by the 4
// threads of the row (so P and O use one scale), then the warps and splits merge as on the SIMT path.
constexpr int KC = 16;

// Resident blocks per SM the kernels are built for (__launch_bounds__): the tensor-core path's
// registers (220 a thread at sm_90: the chunk's K and V, the output's accumulators) allow 2; the SIMT
// path alone fits 3 (168). registry/kernels/decode_attention.py's split plan counts the same.
template <typename T>
constexpr int blocks_per_sm() { return sizeof(T) == 2 ? 2 : 3; }

// Two T values as the 32-bit pair the mma takes (lo in the low half).
template <typename T>
__device__ __forceinline__ uint32_t raw_pair(T lo, T hi) {
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&lo)) |
         static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hi)) << 16;
}
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
template <typename T>
__device__ __forceinline__ float2 unpack_pair(uint32_t x);
template <>
__device__ __forceinline__ float2 unpack_pair<__half>(uint32_t x) {
  return __half22float2(*reinterpret_cast<const __half2*>(&x));
}
template <>
__device__ __forceinline__ float2 unpack_pair<__nv_bfloat16>(uint32_t x) {
  return make_float2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
}

// c += A B for the tile's rows 0..7 (a0: columns 2t, 2t+1 of row g; a2: 8+2t, 9+2t; rows 8..15 zero,
// their results dropped), f32 accumulation.
template <typename T>
__device__ __forceinline__ void mma_rows8(float& c0, float& c1, uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  float d2, d3;
  if constexpr (std::is_same_v<T, __half>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%10,%10};"
        : "+f"(c0), "+f"(c1), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%10,%10};"
        : "+f"(c0), "+f"(c1), "=f"(d2), "=f"(d3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.f));
  }
}

// One block on the tensor-core path (see above); MASKED as in attend_block. Mma, the rows policy:
//   Mma::KT                          chunks loaded before any is used (latency);
//   Mma::Chunk                       a thread's share of a chunk's K and V rows (registers);
//   mma.load_k(c, nt, row, t)        K of key nt*8 + g (row: key_row's index, -1 for none: zeros);
//   mma.load_v(c, j, row, g)         V of the thread's S key j (2t, 2t+1, 8+2t, 9+2t);
//   Mma::k_phys(h, r, e)             the feature (within the thread's 8 of a span) of element e of
//                                    B register r at k-step 2s + h;
//   Mma::k_frag(c, nt, ks, b0, b1)   the B operand of S's k-step ks, n-tile nt;
//   Mma::v_frag(c, n, b0, b1)        the B operand of O's n-tile n.
template <typename T, int D, bool CAP, bool MASKED, typename Mma>
__device__ __forceinline__ void attend_mma_block(const T* __restrict__ q, T* __restrict__ out, const Mma mma,
                                                 const int32_t* __restrict__ kv_len, const int32_t* __restrict__ kv_end,
                                                 const int32_t* __restrict__ table, float* workspace, int32_t* locks,
                                                 const Shape& p, const aot_cuda::Strides& qs, Shared& sh) {
  constexpr int KS = D / 16, DN = D / 8, KT = Mma::KT;
  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int L = p.seq_len, G = p.n_q_heads / p.n_kv_heads, R = G * L;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const Keys keys = block_keys(p, kv_len, kv_end, b, hk, split);
  const float inv_cap = CAP ? 1.f / p.softcap : 0.f;
  const float qscale = CAP ? p.scale : p.scale * LOG2E;   // applied to S in fp32: Q enters the mma exact
  for (int r0 = 0; r0 < R; r0 += MMA_ROWS) {
    const int row = r0 + g;
    const bool real = row < R;
    const int tq = real ? row % L : 0;
    const int hi = real ? keys.n - L + tq : -1;          // the keys row sees: [lo, hi]
    const int lo = p.window > 0 ? hi - p.window + 1 : 0;
    if (warp == 0) {                                     // Q's fragments, the same for every warp
      const long long base = static_cast<long long>(b) * qs.s[0] +
                             static_cast<long long>(hk * G + (real ? row / L : 0)) * qs.s[1] +
                             static_cast<long long>(tq) * qs.s[2];
      const T zero = aot_cuda::Cvt<T>::store(0.f);
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int d = 32 * (ks / 2) + 8 * t;
          const T e0 = real ? q[base + static_cast<long long>(d + Mma::k_phys(ks & 1, r, 0)) * qs.s[3]] : zero;
          const T e1 = real ? q[base + static_cast<long long>(d + Mma::k_phys(ks & 1, r, 1)) * qs.s[3]] : zero;
          (r ? sh.q_frag[ks][lane].y : sh.q_frag[ks][lane].x) = raw_pair<T>(e0, e1);
        }
      }
    }
    __syncthreads();
    float o[DN][2], m = -INFINITY, l = 0.f;
#pragma unroll
    for (int n = 0; n < DN; ++n) o[n][0] = o[n][1] = 0.f;
#pragma unroll 1
    for (int c0 = warp * KT; keys.k_lo + c0 * KC < keys.k_hi; c0 += WARPS * KT) {
      typename Mma::Chunk ch[KT];
      int key[KT][4];                                    // the thread's S keys (INT_MAX: none)
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {                  // every load first: latency overlaps
        const int cb = keys.k_lo + (c0 + kt) * KC;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) mma.load_k(ch[kt], nt, key_row(p, keys, table, b, hk, cb + nt * 8 + g), t);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = cb + 2 * t + (j & 1) + 8 * (j >> 1);
          const long long kr = key_row(p, keys, table, b, hk, i);
          mma.load_v(ch[kt], j, kr, g);
          key[kt][j] = kr >= 0 ? i : 0x7fffffff;
        }
      }
#pragma unroll
      for (int kt = 0; kt < KT; ++kt) {
        float s[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
#pragma unroll
          for (int nt = 0; nt < 2; ++nt) {
            uint32_t b0, b1;
            Mma::k_frag(ch[kt], nt, ks, b0, b1);
            mma_rows8<T>(s[nt][0], s[nt][1], sh.q_frag[ks][lane].x, sh.q_frag[ks][lane].y, b0, b1);
          }
        }
        float mt = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          float& x = s[j >> 1][j & 1];
          x = seen_score<CAP, MASKED>(x * qscale, key[kt][j], lo, hi, p, inv_cap);
          mt = fmaxf(mt, x);
        }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
        const float mn = fmaxf(m, mt);
        const float base = mn == -INFINITY ? 0.f : mn;   // nothing seen yet: every 2^(-inf - 0) is 0
        const float a = fast_exp2(m - base);
        m = mn;
        l *= a;
#pragma unroll
        for (int n = 0; n < DN; ++n) {
          o[n][0] *= a;
          o[n][1] *= a;
        }
        uint32_t pa[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          pa[nt] = pack_pair<T>(fast_exp2(s[nt][0] - base), fast_exp2(s[nt][1] - base));
          const float2 pr = unpack_pair<T>(pa[nt]);       // the sum of the weights P V uses, as rounded
          l += pr.x + pr.y;
        }
#pragma unroll
        for (int n = 0; n < DN; ++n) {
          uint32_t b0, b1;
          Mma::v_frag(ch[kt], n, b0, b1);
          mma_rows8<T>(o[n][0], o[n][1], pa[0], pa[1], b0, b1);
        }
      }
    }
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    float* part = sh.mma_part[warp][g];
#pragma unroll
    for (int n = 0; n < DN; ++n) {
      part[2 * t * DN + n] = o[n][0];
      part[(2 * t + 1) * DN + n] = o[n][1];
    }
    if (t == 0) {
      part[MMA_DIM] = m;
      part[MMA_DIM + 1] = l;
    }
    __syncthreads();
    store_pass<T>(out, workspace, p, &sh.mma_part[0][0][0], MMA_ROWS, MMA_DIM, b, hk, split, r0);
  }
  if (p.n_splits > 1) combine_splits<T>(out, workspace, locks, p, sh, b, hk);
}

template <typename T, int D, typename Mma>
__device__ __forceinline__ void attend_mma(const T* q, T* out, const Mma mma, const int32_t* kv_len,
                                           const int32_t* kv_end, const int32_t* table, float* workspace,
                                           int32_t* locks, const Shape& p, const aot_cuda::Strides& qs, Shared& sh) {
  const bool masked = p.seq_len > 1 || p.window > 0;
  if (p.softcap > 0.f) {
    masked ? attend_mma_block<T, D, true, true>(q, out, mma, kv_len, kv_end, table, workspace, locks, p, qs, sh)
           : attend_mma_block<T, D, true, false>(q, out, mma, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  } else {
    masked ? attend_mma_block<T, D, false, true>(q, out, mma, kv_len, kv_end, table, workspace, locks, p, qs, sh)
           : attend_mma_block<T, D, false, false>(q, out, mma, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  }
}

// A kernel's attention: 2-byte types at head_dim 64 or 128 on the tensor cores (Rows::mma<D>(), the
// rows policy of that path), everything else on the SIMT path with LPK lanes per key (at least 8:
// LPK * EPL >= head_dim) as a compile-time choice. `sh`: the kernel's one Shared, declared in its
// entry, so an entry that calls attend for several Rows types holds one copy.
template <typename T, typename Rows>
__device__ void attend(const T* q, T* out, const Rows rows, const int32_t* kv_len, const int32_t* kv_end,
                       const int32_t* table, float* workspace, int32_t* locks, const Shape& p,
                       const aot_cuda::Strides& qs, Shared& sh) {
  if constexpr (sizeof(T) == 2) {
    if (p.head_dim == 128) {
      attend_mma<T, 128>(q, out, rows.template mma<128>(), kv_len, kv_end, table, workspace, locks, p, qs, sh);
      return;
    }
    if (p.head_dim == 64) {
      attend_mma<T, 64>(q, out, rows.template mma<64>(), kv_len, kv_end, table, workspace, locks, p, qs, sh);
      return;
    }
  }
  if (p.head_dim <= 8 * EPL) {
    attend_block_of<T, 8>(q, out, rows, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  } else if (p.head_dim <= 16 * EPL) {
    attend_block_of<T, 16>(q, out, rows, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  } else {
    attend_block_of<T, 32>(q, out, rows, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  }
}

}  // namespace aot_attn
