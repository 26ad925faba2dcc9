// The decode attention of the CPU entries (docs/kernel-abi.md, decode_attention and
// decode_attention_quantized): a few query tokens per sequence over the keys of each row's valid range,
// read in place from a head-major cache (ring order) or a slot-major pool through a table. Per
// (batch row, kv head): every query row of the kv head (grouped heads x L tokens) against each key it
// sees, an online softmax per query row, fp32 math, one rounding to the output type. How a key's row
// becomes fp32 features is the caller's (a float row's load, a quantized row's dequantization).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "aot_cpu.h"

namespace aot_cpu {

struct Attention {
  int batch, L, Hq, Hkv, D, pool_layout, pool_rows, table_cols, window;
  float scale, softcap;
  const int32_t* q_strides;   // the strided q's four element strides
};

// Query rows of q [B, Hq, L, D] (strided) attend; `load(row, kf, vf)` fills the D fp32 features of
// key and value row `row` (a row index of the pool seen as [rows, D]: head-major (b * Hkv + hk) * S +
// buffer row, slot-major slot * Hkv + hk). Inconsistent scalars compute nothing.
template <typename T, typename Load>
void attend(const typename T::storage* q, typename T::storage* out, const int32_t* kv_len, const int32_t* kv_end,
            const int32_t* table, const Attention& a, Load load) {
  const int L = a.L, Hq = a.Hq, Hkv = a.Hkv, D = a.D;
  if (L < 1 || Hkv < 1 || D < 1 || Hq % Hkv || (a.pool_layout == 0 ? a.table_cols < 0 : a.pool_rows < 1)) return;
  const int32_t* qs = a.q_strides;
  const int G = Hq / Hkv, R = G * L;
  const int rows = a.pool_layout == 0 ? a.table_cols : a.pool_rows;
  std::vector<float> qf(static_cast<size_t>(R) * D), acc(static_cast<size_t>(R) * D), kf(D), vf(D);
  std::vector<float> m(R), l(R);
  for (int b = 0; b < a.batch; ++b) {
    int n = kv_len[b];
    n = n < 0 ? 0 : (n > rows ? rows : n);
    const int end = kv_end[b];
    for (int hk = 0; hk < Hkv; ++hk) {
      for (int r = 0; r < R; ++r) {
        const int hq = hk * G + r / L, t = r % L;
        const int64_t base = int64_t(b) * qs[0] + int64_t(hq) * qs[1] + int64_t(t) * qs[2];
        for (int d = 0; d < D; ++d) qf[size_t(r) * D + d] = T::load(q[base + int64_t(d) * qs[3]]) * a.scale;
        m[r] = -INFINITY;
        l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int lo_all = a.window > 0 ? std::max(0, n - L - a.window + 1) : 0;
      for (int i = lo_all; i < n; ++i) {
        int64_t row;
        if (a.pool_layout == 0) {
          const int slot = table[int64_t(b) * a.table_cols + i];
          if (slot < 0 || slot >= a.pool_rows) continue;   // outside the pool: never read
          row = int64_t(slot) * Hkv + hk;
        } else {
          int64_t phys = (int64_t(end) - n + i) % rows;     // 64-bit: any int32 kv_end
          if (phys < 0) phys += rows;
          row = (int64_t(b) * Hkv + hk) * rows + phys;
        }
        load(row, kf.data(), vf.data());
        for (int r = 0; r < R; ++r) {
          const int hi = n - L + r % L;                   // the last key query r sees
          if (i > hi || (a.window > 0 && i <= hi - a.window)) continue;
          const float* qr = &qf[size_t(r) * D];
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += qr[d] * kf[d];
          if (a.softcap > 0.f) s = a.softcap * std::tanh(s / a.softcap);
          // online softmax: rescale the running sum and output when the maximum grows
          float* acc_r = &acc[size_t(r) * D];
          if (s > m[r]) {
            const float f = m[r] == -INFINITY ? 0.f : std::exp(m[r] - s);
            l[r] *= f;
            for (int d = 0; d < D; ++d) acc_r[d] *= f;
            m[r] = s;
          }
          const float p = std::exp(s - m[r]);
          l[r] += p;
          for (int d = 0; d < D; ++d) acc_r[d] += p * vf[d];
        }
      }
      for (int r = 0; r < R; ++r) {
        const int hq = hk * G + r / L, t = r % L;
        typename T::storage* o = out + ((int64_t(b) * Hq + hq) * L + t) * D;
        for (int d = 0; d < D; ++d) o[d] = T::store(l[r] > 0.f ? acc[size_t(r) * D + d] / l[r] : 0.f);
      }
    }
  }
}

}  // namespace aot_cpu
