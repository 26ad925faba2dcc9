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
#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "aot_cuda.cuh"

namespace {

using aot_cuda::Cvt;
using aot_cuda::Strides;

constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int EPL = 8;         // elements of a row per lane
constexpr int RC = 4;          // query rows per pass over the keys (accumulators live in registers)
constexpr int TILE = 4;        // key steps loaded before any is used (latency)
constexpr int MAX_DIM = 256;   // EPL * 32 lanes
constexpr int MAX_SPLITS = 128;
constexpr float LOG2E = 1.4426950408889634f;

struct Params {
  int batch, seq_len, n_q_heads, n_kv_heads, head_dim, pool_layout, pool_rows, table_cols, window;
  float scale, softcap;
  int n_splits, split_len;
};

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

// tanh from exp2: CUDA's tanhf is an approximation (about 2^-11 relative) on this toolchain.
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

// Shared memory of a block, declared once (every instantiation of body shares it).
struct Shared {
  float part[WARPS][RC][MAX_DIM + 2];    // per warp: (max, sum, output) of the pass's rows
  float weight[WARPS][MAX_SPLITS];       // the split merge: each split's weight for a warp's row
  int last_block;
};

template <typename T, int LPK, bool CAP>
__device__ __forceinline__ void body(const T* __restrict__ q, T* __restrict__ out, const T* __restrict__ k_pool,
                     const T* __restrict__ v_pool, const int32_t* __restrict__ kv_len,
                     const int32_t* __restrict__ kv_end, const int32_t* __restrict__ table, float* workspace,
                     int32_t* locks, const Params& p, const Strides& qs, Shared& sh) {
  auto& part = sh.part;
  auto& weight = sh.weight;
  int& last_block = sh.last_block;
  const int split = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
  const int D = p.head_dim, L = p.seq_len, G = p.n_q_heads / p.n_kv_heads, R = G * L;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  constexpr int lpk = LPK;                              // lanes per key: LPK * EPL >= D
  const int kpi = 32 / lpk, grp = lane / lpk, sub = lane % lpk;
  const int d0 = sub * EPL;                             // this lane's first feature
  const bool dims = d0 < D;                             // D % 8 == 0: all EPL features or none

  const int rows = p.pool_layout == 0 ? p.table_cols : p.pool_rows;
  const int n = min(max(kv_len[b], 0), rows);          // valid keys of this row
  int first = 0;                                        // head-major: buffer row of logical key 0
  if (p.pool_layout != 0) {
    first = static_cast<int>((static_cast<long long>(kv_end[b]) - n) % rows);   // 64-bit: any int32 kv_end
    if (first < 0) first += rows;
  }
  const int lo_win = p.window > 0 ? max(0, n - L - p.window + 1) : 0;
  const int k_lo = max(split * p.split_len, lo_win);
  const int k_hi = min((split + 1) * p.split_len, n);
  const long long head_rows = (static_cast<long long>(b) * p.n_kv_heads + hk) * rows;   // head-major
  const bool split_out = p.n_splits > 1;

  // Scores in base 2: q carries scale * log2(e), or scale alone when soft-capping comes first.
  const float qscale = CAP ? p.scale : p.scale * LOG2E;
  const float inv_cap = CAP ? 1.f / p.softcap : 0.f;
  for (int r0 = 0; r0 < R; r0 += RC) {
    float qv[RC][EPL], acc[RC][EPL], m[RC], l[RC];
    int hi_r[RC], lo_r[RC];                             // the keys query row r sees: [lo_r, hi_r]
#pragma unroll
    for (int r = 0; r < RC; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.f;
      const int row = r0 + r, g = row / L, t = row % L, hq = hk * G + g;
      hi_r[r] = row < R ? n - L + t : -1;
      lo_r[r] = p.window > 0 ? hi_r[r] - p.window + 1 : 0;
      const long long base = static_cast<long long>(b) * qs.s[0] + static_cast<long long>(hq) * qs.s[1] +
                             static_cast<long long>(t) * qs.s[2];
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        acc[r][e] = 0.f;
        const bool ok = row < R && dims;
        qv[r][e] = ok ? Cvt<T>::load(q[base + static_cast<long long>(d0 + e) * qs.s[3]]) * qscale : 0.f;
      }
    }
    for (int step0 = warp; k_lo + step0 * kpi < k_hi; step0 += WARPS * TILE) {
      Raw<T> kr[TILE], vr[TILE];
      int key[TILE];
#pragma unroll
      for (int j = 0; j < TILE; ++j) {               // every load of the tile first: latency overlaps
        const int i = k_lo + (step0 + j * WARPS) * kpi + grp;
        long long off = -1;
        if (i < k_hi) {
          if (p.pool_layout == 0) {
            const int slot = table[static_cast<long long>(b) * p.table_cols + i];
            if (slot >= 0 && slot < p.pool_rows) off = (static_cast<long long>(slot) * p.n_kv_heads + hk) * D;
          } else {
            const int phys = first + i < rows ? first + i : first + i - rows;   // ring order
            off = (head_rows + phys) * D;
          }
        }
        key[j] = off >= 0 ? i : 0x7fffffff;             // a key never seen: past every hi_r
        if (off >= 0 && dims) {
          load_raw<T>(k_pool + off + d0, kr[j]);
          load_raw<T>(v_pool + off + d0, vr[j]);
        } else {
          zero_raw<T>(kr[j]);
          zero_raw<T>(vr[j]);
        }
      }
      float s[RC][TILE];
#pragma unroll
      for (int j = 0; j < TILE; ++j) {
        float kf[EPL];
        unpack<T>(kr[j], kf);
#pragma unroll
        for (int r = 0; r < RC; ++r) {
          float dot = 0.f;
#pragma unroll
          for (int e = 0; e < EPL; ++e) dot = fmaf(qv[r][e], kf[e], dot);
          dot = group_sum<LPK>(dot);
          if constexpr (CAP) dot = p.softcap * LOG2E * tanh_precise(dot * inv_cap);
          s[r][j] = key[j] <= hi_r[r] && key[j] >= lo_r[r] ? dot : -INFINITY;
        }
      }
      float pr[RC][TILE];
#pragma unroll
      for (int r = 0; r < RC; ++r) {
        float mt = -INFINITY;
#pragma unroll
        for (int j = 0; j < TILE; ++j) mt = fmaxf(mt, s[r][j]);
        const float mn = fmaxf(m[r], mt);
        const float a = m[r] == -INFINITY ? 0.f : fast_exp2(m[r] - mn);   // rescale what came before
        l[r] *= a;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[r][e] *= a;
#pragma unroll
        for (int j = 0; j < TILE; ++j) {
          pr[r][j] = s[r][j] == -INFINITY ? 0.f : fast_exp2(s[r][j] - mn);
          l[r] += pr[r][j];
        }
        m[r] = mn;
      }
#pragma unroll
      for (int j = 0; j < TILE; ++j) {
        float vf[EPL];
        unpack<T>(vr[j], vf);
#pragma unroll
        for (int r = 0; r < RC; ++r) {
#pragma unroll
          for (int e = 0; e < EPL; ++e) acc[r][e] = fmaf(pr[r][j], vf[e], acc[r][e]);
        }
      }
    }
    // Lane groups of a warp hold the same features of different keys: merge them.
#pragma unroll
    for (int r = 0; r < RC; ++r) {
      for (int o = lpk; o < 32; o *= 2) {
        float acco[EPL];
        const float mo = __shfl_xor_sync(0xffffffffu, m[r], o);
        const float lo = __shfl_xor_sync(0xffffffffu, l[r], o);
#pragma unroll
        for (int e = 0; e < EPL; ++e) acco[e] = __shfl_xor_sync(0xffffffffu, acc[r][e], o);
        merge(m[r], l[r], acc[r], mo, lo, acco);
      }
      if (grp == 0 && dims) {
#pragma unroll
        for (int e = 0; e < EPL; ++e) part[warp][r][d0 + e] = acc[r][e];
      }
      if (lane == 0) {
        part[warp][r][MAX_DIM] = m[r];
        part[warp][r][MAX_DIM + 1] = l[r];
      }
    }
    __syncthreads();
    // Warps: each thread combines features of the pass's rows.
    const int rows_here = min(RC, R - r0);
    for (int idx = threadIdx.x; idx < rows_here * D; idx += THREADS) {
      const int r = idx / D, d = idx % D, row = r0 + r;
      float mx = -INFINITY;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, part[w][r][MAX_DIM]);
      float sum = 0.f, val = 0.f;
      if (mx != -INFINITY) {
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
          const float mw = part[w][r][MAX_DIM];
          const float f = mw == -INFINITY ? 0.f : fast_exp2(mw - mx);
          sum += part[w][r][MAX_DIM + 1] * f;
          val += part[w][r][d] * f;
        }
      }
      const int g = row / L, t = row % L, hq = hk * G + g;
      if (!split_out) {
        const long long o = ((static_cast<long long>(b) * p.n_q_heads + hq) * L + t) * D + d;
        out[o] = Cvt<T>::store(sum > 0.f ? val / sum : 0.f);
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
  if (!split_out) return;
  // Flash-decoding: the last block of this (row, kv head) to finish combines every split.
  __threadfence();
  __syncthreads();
  int32_t* lock = locks + b * p.n_kv_heads + hk;
  if (threadIdx.x == 0) last_block = atomicAdd(lock, 1) == p.n_splits - 1;
  __syncthreads();
  if (!last_block) return;
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
      weight[warp][s] = f;
      sum += f * __ldcg(w + D + 1);
    }
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    __syncwarp();
    const int g = row / L, t = row % L, hq = hk * G + g;
    T* o = out + ((static_cast<long long>(b) * p.n_q_heads + hq) * L + t) * D;
    for (int d = lane; d < D; d += 32) {
      float val = 0.f;
#pragma unroll 8
      for (int s = 0; s < S; ++s) val = fmaf(__ldcg(ws + (static_cast<long long>(s) * R + row) * (D + 2) + d), weight[warp][s], val);
      o[d] = Cvt<T>::store(sum > 0.f ? val / sum : 0.f);
    }
    __syncwarp();
  }
  __syncthreads();
  if (threadIdx.x == 0) atomicExch(lock, 0);   // zero at rest, for the next launch
}

// Lanes per key (the row's 16-byte units, at least 8 lanes) and soft-capping, as compile-time
// choices: the per-key loop then has no runtime loop or branch for either.
template <typename T>
__device__ void dispatch(const T* q, T* out, const T* k_pool, const T* v_pool, const int32_t* kv_len,
                         const int32_t* kv_end, const int32_t* table, float* workspace, int32_t* locks,
                         const Params& p, const Strides& qs) {
  __shared__ Shared sh;
  const bool cap = p.softcap > 0.f;
  if (p.head_dim <= 8 * EPL) {
    cap ? body<T, 8, true>(q, out, k_pool, v_pool, kv_len, kv_end, table, workspace, locks, p, qs, sh)
        : body<T, 8, false>(q, out, k_pool, v_pool, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  } else if (p.head_dim <= 16 * EPL) {
    cap ? body<T, 16, true>(q, out, k_pool, v_pool, kv_len, kv_end, table, workspace, locks, p, qs, sh)
        : body<T, 16, false>(q, out, k_pool, v_pool, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  } else {
    cap ? body<T, 32, true>(q, out, k_pool, v_pool, kv_len, kv_end, table, workspace, locks, p, qs, sh)
        : body<T, 32, false>(q, out, k_pool, v_pool, kv_len, kv_end, table, workspace, locks, p, qs, sh);
  }
}

}  // namespace

// Scalars the wrapper validates; an inconsistent set launches nothing rather than reading out of bounds.
#define DA_ENTRY(NAME, T)                                                                                 \
  extern "C" __global__ void __launch_bounds__(THREADS, 3) NAME(                                             \
      const T* q, T* out, const T* k_pool, const T* v_pool, const int32_t* kv_len, const int32_t* kv_end,  \
      const int32_t* table, float* workspace, int32_t* locks, int batch, int seq_len, int n_q_heads,       \
      int n_kv_heads, int head_dim, int pool_layout, int pool_rows, int table_cols, int window,             \
      float scale, float softcap, int n_splits, int split_len, Strides q_strides) {                        \
    const Params p{batch,     seq_len, n_q_heads, n_kv_heads, head_dim, pool_layout, pool_rows,            \
                   table_cols, window, scale,     softcap,    n_splits, split_len};                        \
    if (head_dim < 8 || head_dim > MAX_DIM || head_dim % 8 || n_kv_heads < 1 || n_q_heads % n_kv_heads ||  \
        seq_len < 1 || n_splits < 1 || n_splits > MAX_SPLITS || split_len < 1 || blockDim.x != THREADS ||                           \
        static_cast<int>(gridDim.x) != n_splits || static_cast<int>(gridDim.y) != n_kv_heads ||            \
        static_cast<int>(gridDim.z) != batch || (pool_layout == 0 ? table_cols < 0 : pool_rows < 1) ||      \
        static_cast<long long>(n_splits) * split_len < (pool_layout == 0 ? table_cols : pool_rows))        \
      return;                                                                                             \
    dispatch<T>(q, out, k_pool, v_pool, kv_len, kv_end, table, workspace, locks, p, q_strides);            \
  }

DA_ENTRY(decode_attention_f16, __half)
DA_ENTRY(decode_attention_bf16, __nv_bfloat16)
DA_ENTRY(decode_attention_f32, float)
