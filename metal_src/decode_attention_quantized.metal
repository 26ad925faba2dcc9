// decode_attention_quantized, Metal entry points (docs/kernel-abi.md): decode_attention over mlx-lm's
// quantized K/V (packed uint32 words, scales, biases) read in place. decode_attention's Metal form:
// one threadgroup of 32 threads per query row (batch row, q head, token) of grid (32, n_q_heads *
// seq_len, batch), thread `lane` owning features lane, lane + 32, ...; each feature dequantized as it
// is read (q * scale + bias, fp32), each key's dot product summed in threadgroup memory, the softmax
// online, fp32 math, one rounding to T. The workspace and locks (CUDA's flash-decoding) are not used.
//
// Checked on Linux by tests/metal_emu (docs/metal.md); compiled with -std=metal3.1 (bfloat).
#include <metal_stdlib>
using namespace metal;

constant int N_Q_HEADS [[function_constant(0)]];
constant int N_KV_HEADS [[function_constant(1)]];
constant int HEAD_DIM [[function_constant(2)]];
constant int POOL_LAYOUT [[function_constant(3)]];
constant int BITS [[function_constant(4)]];
constant int GROUP_SIZE [[function_constant(5)]];

// Feature d of quantized row `row` (the pool seen as rows of HEAD_DIM features): q * scale + bias.
template <typename T>
inline float feature(const device uint* words, const device T* scales, const device T* biases, long row, int d) {
  const int per_word = 32 / BITS;
  const uint q = (words[row * (HEAD_DIM * BITS / 32) + d / per_word] >> uint((d % per_word) * BITS)) &
                 ((1u << uint(BITS)) - 1u);
  const long g = row * (HEAD_DIM / GROUP_SIZE) + d / GROUP_SIZE;
  return float(q) * float(scales[g]) + float(biases[g]);
}

template <typename T>
[[kernel]] void decode_attention_quantized(
    const device T* q [[buffer(0)]],
    device T* out [[buffer(1)]],
    const device uint* k_pool [[buffer(2)]],
    const device T* k_scales [[buffer(3)]],
    const device T* k_biases [[buffer(4)]],
    const device uint* v_pool [[buffer(5)]],
    const device T* v_scales [[buffer(6)]],
    const device T* v_biases [[buffer(7)]],
    const device int* kv_len [[buffer(8)]],
    const device int* kv_end [[buffer(9)]],
    const device int* table [[buffer(10)]],
    device float* workspace [[buffer(11)]],
    device int* locks [[buffer(12)]],
    constant int& batch [[buffer(13)]],
    constant int& seq_len [[buffer(14)]],
    constant int& pool_rows [[buffer(15)]],
    constant int& table_cols [[buffer(16)]],
    constant int& window [[buffer(17)]],
    constant float& scale [[buffer(18)]],
    constant float& softcap [[buffer(19)]],
    constant int& n_splits [[buffer(20)]],
    constant int& split_len [[buffer(21)]],
    constant int4& q_strides [[buffer(22)]],
    uint3 gid [[thread_position_in_grid]],
    uint3 lid [[thread_position_in_threadgroup]]) {
  threadgroup float partial[32];
  const int lane = int(lid.x);
  const int L = seq_len;
  const int row = int(gid.y);              // q head * L + token
  const int b = int(gid.z);
  // Uniform per threadgroup (the whole group returns together, before any barrier).
  if (L < 1 || N_KV_HEADS < 1 || HEAD_DIM < 1 || HEAD_DIM > 256 || N_Q_HEADS % N_KV_HEADS != 0 ||
      row >= N_Q_HEADS * L || b >= batch || (POOL_LAYOUT == 0 ? table_cols < 0 : pool_rows < 1) ||
      (BITS != 4 && BITS != 8) || (GROUP_SIZE != 32 && GROUP_SIZE != 64 && GROUP_SIZE != 128) ||
      HEAD_DIM % GROUP_SIZE != 0) {
    return;
  }
  const int hq = row / L, t = row % L, hk = hq / (N_Q_HEADS / N_KV_HEADS);
  const int rows = POOL_LAYOUT == 0 ? table_cols : pool_rows;
  const int n = clamp(kv_len[b], 0, rows);
  const int end = kv_end[b];
  const int hi = n - L + t;                // the last key this query sees
  const int lo = window > 0 ? max(0, hi - window + 1) : 0;
  const long qbase = long(b) * q_strides.x + long(hq) * q_strides.y + long(t) * q_strides.z;
  float qv[8];
  float acc[8];
  for (int j = 0; j < 8; ++j) {
    const int d = lane + 32 * j;
    qv[j] = d < HEAD_DIM ? float(q[qbase + long(d) * q_strides.w]) * scale : 0.0f;
    acc[j] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int i = lo; i <= hi && i < n; ++i) {
    long key = -1;                         // the key's row of the pool seen as [rows, HEAD_DIM]
    if (POOL_LAYOUT == 0) {
      const int slot = table[long(b) * table_cols + i];
      if (slot >= 0 && slot < pool_rows) {
        key = long(slot) * N_KV_HEADS + hk;
      }
    } else {
      long phys = (long(end) - n + i) % rows;   // 64-bit: any int32 kv_end
      if (phys < 0) {
        phys += rows;
      }
      key = (long(b) * N_KV_HEADS + hk) * rows + phys;
    }
    if (key < 0) {
      continue;                            // a slot outside the pool: never read (uniform)
    }
    float part = 0.0f;
    for (int j = 0; j < 8; ++j) {
      const int d = lane + 32 * j;
      if (d < HEAD_DIM) {
        part += qv[j] * feature<T>(k_pool, k_scales, k_biases, key, d);
      }
    }
    partial[lane] = part;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    float s = 0.0f;
    for (int x = 0; x < 32; ++x) {
      s += partial[x];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (softcap > 0.0f) {
      s = softcap * tanh(s / softcap);
    }
    if (s > m) {
      const float f = m == -INFINITY ? 0.0f : exp(m - s);
      l *= f;
      for (int j = 0; j < 8; ++j) {
        acc[j] *= f;
      }
      m = s;
    }
    const float p = exp(s - m);
    l += p;
    for (int j = 0; j < 8; ++j) {
      const int d = lane + 32 * j;
      if (d < HEAD_DIM) {
        acc[j] += p * feature<T>(v_pool, v_scales, v_biases, key, d);
      }
    }
  }
  const long obase = ((long(b) * N_Q_HEADS + hq) * L + t) * HEAD_DIM;
  for (int j = 0; j < 8; ++j) {
    const int d = lane + 32 * j;
    if (d < HEAD_DIM) {
      out[obase + d] = T(l > 0.0f ? acc[j] / l : 0.0f);
    }
  }
}

#define INSTANTIATE(NAME, T)                                                                          \
  template [[host_name(NAME)]] [[kernel]] void decode_attention_quantized<T>(                         \
      const device T* q [[buffer(0)]], device T* out [[buffer(1)]],                                   \
      const device uint* k_pool [[buffer(2)]], const device T* k_scales [[buffer(3)]],                \
      const device T* k_biases [[buffer(4)]], const device uint* v_pool [[buffer(5)]],                \
      const device T* v_scales [[buffer(6)]], const device T* v_biases [[buffer(7)]],                 \
      const device int* kv_len [[buffer(8)]], const device int* kv_end [[buffer(9)]],                 \
      const device int* table [[buffer(10)]], device float* workspace [[buffer(11)]],                 \
      device int* locks [[buffer(12)]], constant int& batch [[buffer(13)]],                           \
      constant int& seq_len [[buffer(14)]], constant int& pool_rows [[buffer(15)]],                   \
      constant int& table_cols [[buffer(16)]], constant int& window [[buffer(17)]],                   \
      constant float& scale [[buffer(18)]], constant float& softcap [[buffer(19)]],                   \
      constant int& n_splits [[buffer(20)]], constant int& split_len [[buffer(21)]],                  \
      constant int4& q_strides [[buffer(22)]], uint3 gid [[thread_position_in_grid]],                 \
      uint3 lid [[thread_position_in_threadgroup]]);

INSTANTIATE("decode_attention_quantized_f16", half)
INSTANTIATE("decode_attention_quantized_bf16", bfloat)
INSTANTIATE("decode_attention_quantized_f32", float)
