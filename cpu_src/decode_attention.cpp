// decode_attention, CPU entry points (docs/kernel-abi.md): attention of a few query tokens per
// sequence over K/V read in place (head-major cache or slot-major pool through a table), each row's
// valid range as data. Per (batch row, kv head): the scores of every query row of the kv head
// (grouped heads x L tokens) against each visible key, one softmax per query row, then the values;
// fp32 math, one rounding to the output type. The workspace and locks (CUDA's flash-decoding) are
// not used: the CPU entry runs the whole problem in one call.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "aot_cpu.h"

#define AOT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using aot_cpu::buffer;
using aot_cpu::scalar;

template <typename T>
void run(void** args) {
  using S = typename T::storage;
  const S* q = buffer<const S>(args, 0);
  S* out = buffer<S>(args, 1);
  const S* k_pool = buffer<const S>(args, 2);
  const S* v_pool = buffer<const S>(args, 3);
  const int32_t* kv_len = buffer<const int32_t>(args, 4);
  const int32_t* kv_end = buffer<const int32_t>(args, 5);
  const int32_t* table = buffer<const int32_t>(args, 6);
  // args[7], args[8]: workspace, locks (CUDA only)
  const int batch = scalar<int32_t>(args, 9), L = scalar<int32_t>(args, 10);
  const int Hq = scalar<int32_t>(args, 11), Hkv = scalar<int32_t>(args, 12), D = scalar<int32_t>(args, 13);
  const int pool_layout = scalar<int32_t>(args, 14), pool_rows = scalar<int32_t>(args, 15);
  const int table_cols = scalar<int32_t>(args, 16), window = scalar<int32_t>(args, 17);
  const float scale = scalar<float>(args, 18), softcap = scalar<float>(args, 19);
  // args[20], args[21]: n_splits, split_len (CUDA only)
  const int32_t* qs = static_cast<const int32_t*>(args[22]);
  if (L < 1 || Hkv < 1 || D < 1 || Hq % Hkv || (pool_layout == 0 ? table_cols < 0 : pool_rows < 1)) return;
  const int G = Hq / Hkv, R = G * L;
  const int rows = pool_layout == 0 ? table_cols : pool_rows;
  std::vector<float> qf(static_cast<size_t>(R) * D), acc(static_cast<size_t>(R) * D), kf(D), vf(D);
  std::vector<float> m(R), l(R);
  for (int b = 0; b < batch; ++b) {
    int n = kv_len[b];
    n = n < 0 ? 0 : (n > rows ? rows : n);
    const int end = kv_end[b];
    for (int hk = 0; hk < Hkv; ++hk) {
      for (int r = 0; r < R; ++r) {
        const int hq = hk * G + r / L, t = r % L;
        const int64_t base = int64_t(b) * qs[0] + int64_t(hq) * qs[1] + int64_t(t) * qs[2];
        for (int d = 0; d < D; ++d) qf[size_t(r) * D + d] = T::load(q[base + int64_t(d) * qs[3]]) * scale;
        m[r] = -INFINITY;
        l[r] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int lo_all = window > 0 ? std::max(0, n - L - window + 1) : 0;
      for (int i = lo_all; i < n; ++i) {
        int64_t off;
        if (pool_layout == 0) {
          const int slot = table[int64_t(b) * table_cols + i];
          if (slot < 0 || slot >= pool_rows) continue;   // outside the pool: never read
          off = (int64_t(slot) * Hkv + hk) * D;
        } else {
          int64_t phys = (int64_t(end) - n + i) % rows;     // 64-bit: any int32 kv_end
          if (phys < 0) phys += rows;
          off = ((int64_t(b) * Hkv + hk) * rows + phys) * D;
        }
        for (int d = 0; d < D; ++d) {
          kf[d] = T::load(k_pool[off + d]);
          vf[d] = T::load(v_pool[off + d]);
        }
        for (int r = 0; r < R; ++r) {
          const int hi = n - L + r % L;                   // the last key query r sees
          if (i > hi || (window > 0 && i <= hi - window)) continue;
          const float* qr = &qf[size_t(r) * D];
          float s = 0.f;
          for (int d = 0; d < D; ++d) s += qr[d] * kf[d];
          if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
          // online softmax: rescale the running sum and output when the maximum grows
          float* a = &acc[size_t(r) * D];
          if (s > m[r]) {
            const float f = m[r] == -INFINITY ? 0.f : std::exp(m[r] - s);
            l[r] *= f;
            for (int d = 0; d < D; ++d) a[d] *= f;
            m[r] = s;
          }
          const float p = std::exp(s - m[r]);
          l[r] += p;
          for (int d = 0; d < D; ++d) a[d] += p * vf[d];
        }
      }
      for (int r = 0; r < R; ++r) {
        const int hq = hk * G + r / L, t = r % L;
        S* o = out + ((int64_t(b) * Hq + hq) * L + t) * D;
        for (int d = 0; d < D; ++d) o[d] = T::store(l[r] > 0.f ? acc[size_t(r) * D + d] / l[r] : 0.f);
      }
    }
  }
}

}  // namespace

#define DA_ENTRY(NAME, T) \
  AOT_EXPORT void NAME(void** args) { run<aot_cpu::T>(args); }

DA_ENTRY(decode_attention_f16, F16)
DA_ENTRY(decode_attention_bf16, BF16)
DA_ENTRY(decode_attention_f32, F32)
