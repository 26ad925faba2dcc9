// rope_pool_fused, CPU entry points (docs/kernel-abi.md): RoPE on q and k, k and v stored into the
// slot-indexed pools (slot-major [S, Hkv, D] or head-major [B, Hkv, S, D]), in one pass per token.
// The pools may hold another float type than q/k/v: rows are converted on the store. Built by `python -m build_tools compile --target cpu`
// into a shared library that the MLX extension (csrc/) dlopens; args[i] points at argument i.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#define AOT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// float16 by bit manipulation: x86-64 has no half arithmetic without -mf16c, and the compiler's
// _Float16 conversions would be library calls per element (slower than MLX's own path). Exact:
// subnormals, infinities and NaN are kept; stores round to nearest even. ARM has the conversions
// in hardware, so there the compiler's type is used.
struct F16 {
  using storage = uint16_t;
  static float load(storage h) {
#if defined(__aarch64__)
    _Float16 x;
    std::memcpy(&x, &h, 2);
    return static_cast<float>(x);
#else
    // Every case computed, one selected: branch-free, so the row loops vectorise.
    const uint32_t magnitude = static_cast<uint32_t>(h & 0x7fffu) << 13;  // exponent + mantissa in fp32 place
    const uint32_t exponent = magnitude & (0x1fu << 23);
    const uint32_t normal = magnitude + (112u << 23);                     // rebias 15 -> 127
    const uint32_t special = magnitude + (224u << 23);                    // inf / NaN: exponent all ones
    const uint32_t subnormal = bits_of(float_of(magnitude + (113u << 23)) - float_of(113u << 23));  // exact
    const uint32_t r = exponent == (0x1fu << 23) ? special : (exponent == 0 ? subnormal : normal);
    return float_of(r | (static_cast<uint32_t>(h & 0x8000u) << 16));
#endif
  }
  static storage store(float x) {
#if defined(__aarch64__)
    const _Float16 y = static_cast<_Float16>(x);
    storage h;
    std::memcpy(&h, &y, 2);
    return h;
#else
    uint32_t u = bits_of(x);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    const uint32_t special = u > (255u << 23) ? 0x7e00u : 0x7c00u;          // NaN stays NaN, else inf
    const uint32_t subnormal = bits_of(float_of(u) + float_of(126u << 23)) - (126u << 23);  // FPU rounds
    const uint32_t normal = (u + 0xfffu + ((u >> 13) & 1u) - (112u << 23)) >> 13;  // nearest even
    const uint32_t h = u >= (143u << 23) ? special : (u < (113u << 23) ? subnormal : normal);
    return static_cast<storage>(h | sign);
#endif
  }
};

// bfloat16: the top half of an fp32, rounded to nearest even (NaN kept quiet), as MLX rounds.
struct BF16 {
  using storage = uint16_t;
  static float load(storage x) { return float_of(static_cast<uint32_t>(x) << 16); }
  static storage store(float f) {
    const uint32_t bits = bits_of(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<storage>((bits >> 16) | 0x40);
    return static_cast<storage>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
};

struct F32 {
  using storage = float;
  static float load(storage x) { return x; }
  static storage store(float x) { return x; }
};

// One head's row: the rotary pairs, then the pass-through tail copied bit for bit. Half-split and
// traditional pairing are separate loops so each walks memory linearly.
template <typename C>
void rotate_row(const typename C::storage* __restrict in, typename C::storage* __restrict out,
                const float* __restrict cs, const float* __restrict sn, int head_dim, int rotary_dims,
                bool traditional, float mscale) {
  const int half = rotary_dims / 2;
  if (traditional) {
    for (int i = 0; i < half; ++i) {
      const float x1 = C::load(in[2 * i]) * mscale;
      const float x2 = C::load(in[2 * i + 1]) * mscale;
      out[2 * i] = C::store(x1 * cs[i] - x2 * sn[i]);
      out[2 * i + 1] = C::store(x1 * sn[i] + x2 * cs[i]);
    }
  } else {
    for (int i = 0; i < half; ++i) {
      const float x1 = C::load(in[i]) * mscale;
      const float x2 = C::load(in[i + half]) * mscale;
      out[i] = C::store(x1 * cs[i] - x2 * sn[i]);
      out[i + half] = C::store(x1 * sn[i] + x2 * cs[i]);
    }
  }
  if (rotary_dims < head_dim)  // pass-through features: an exact copy
    std::memcpy(out + rotary_dims, in + rotary_dims, sizeof(*in) * (head_dim - rotary_dims));
}

// Element offset of pool row (slot, h). Slot-major [S, Hkv, D]: slot is the row. Head-major
// [B, Hkv, S, D] (mlx-lm's KVCache): slot = b * S + s. 64-bit: pools can exceed 2^31 elements.
inline size_t pool_offset(int slot, int h, int n_kv_heads, int pool_rows, int head_dim, bool head_major) {
  if (!head_major) return (static_cast<size_t>(slot) * n_kv_heads + h) * head_dim;
  const int b = slot / pool_rows, s = slot % pool_rows;
  return ((static_cast<size_t>(b) * n_kv_heads + h) * pool_rows + s) * head_dim;
}

// One head row into the pool: a copy when the pool has the activations' type, else each element
// converted (the value k_out/v hold, rounded once more to the pool's type).
template <typename C, typename P>
void store_row(typename P::storage* __restrict dst, const typename C::storage* __restrict src, int n) {
  if constexpr (std::is_same_v<C, P>) {
    std::memcpy(dst, src, sizeof(*src) * n);
  } else {
    for (int i = 0; i < n; ++i) dst[i] = P::store(C::load(src[i]));
  }
}

template <typename C, typename P = C>
void run(void** args) {
  using T = typename C::storage;
  using TP = typename P::storage;
  const T* q = *static_cast<const T**>(args[0]);
  const T* k = *static_cast<const T**>(args[1]);
  const T* v = *static_cast<const T**>(args[2]);
  T* q_out = *static_cast<T**>(args[3]);
  T* k_out = *static_cast<T**>(args[4]);
  TP* k_pool = *static_cast<TP**>(args[5]);
  TP* v_pool = *static_cast<TP**>(args[6]);
  const int32_t* positions = *static_cast<const int32_t**>(args[7]);
  const int32_t* slots = *static_cast<const int32_t**>(args[8]);
  const float* inv_freq = *static_cast<const float**>(args[9]);
  const int n_tokens = *static_cast<const int32_t*>(args[10]);
  const int pool_size = *static_cast<const int32_t*>(args[11]);
  const int pool_rows = *static_cast<const int32_t*>(args[12]);
  const int n_q_heads = *static_cast<const int32_t*>(args[13]);
  const int n_kv_heads = *static_cast<const int32_t*>(args[14]);
  const int head_dim = *static_cast<const int32_t*>(args[15]);
  const int rotary_dims = *static_cast<const int32_t*>(args[16]);
  const bool traditional = *static_cast<const int32_t*>(args[17]) != 0;
  // args[18] (heads_per_thread) shapes GPU launches only.
  const float pos_scale = *static_cast<const float*>(args[19]);
  const float mscale = *static_cast<const float*>(args[20]);
  const bool head_major = *static_cast<const int32_t*>(args[21]) != 0;

  const int half = rotary_dims / 2;
  std::vector<float> cs(half), sn(half);
  const size_t row = static_cast<size_t>(head_dim);
  for (int t = 0; t < n_tokens; ++t) {
    // cos/sin once per (token, pair), shared by every q and k head of the token.
    const float p = static_cast<float>(positions[t]) * pos_scale;
    for (int i = 0; i < half; ++i) {
      const float angle = p * inv_freq[i];
      cs[i] = std::cos(angle);
      sn[i] = std::sin(angle);
    }
    for (int h = 0; h < n_q_heads; ++h) {
      const size_t off = (static_cast<size_t>(t) * n_q_heads + h) * row;
      rotate_row<C>(q + off, q_out + off, cs.data(), sn.data(), head_dim, rotary_dims, traditional, mscale);
    }
    const int slot = slots[t];
    // slot < 0: rotate only; >= pool_size: never written (nor with no rows to divide by).
    const bool write = slot >= 0 && slot < pool_size && (!head_major || pool_rows > 0);
    for (int h = 0; h < n_kv_heads; ++h) {
      const size_t off = (static_cast<size_t>(t) * n_kv_heads + h) * row;
      rotate_row<C>(k + off, k_out + off, cs.data(), sn.data(), head_dim, rotary_dims, traditional, mscale);
      if (write) {
        const size_t dst = pool_offset(slot, h, n_kv_heads, pool_rows, head_dim, head_major);
        store_row<C, P>(k_pool + dst, k_out + off, head_dim);
        store_row<C, P>(v_pool + dst, v + off, head_dim);
      }
    }
  }
}

}  // namespace

// Entries: rope_pool_fused_<act> (pools of the same type) and rope_pool_fused_<act>_<pool>.
AOT_EXPORT void rope_pool_fused_f16(void** args) { run<F16>(args); }
AOT_EXPORT void rope_pool_fused_bf16(void** args) { run<BF16>(args); }
AOT_EXPORT void rope_pool_fused_f32(void** args) { run<F32>(args); }
AOT_EXPORT void rope_pool_fused_f16_bf16(void** args) { run<F16, BF16>(args); }
AOT_EXPORT void rope_pool_fused_f16_f32(void** args) { run<F16, F32>(args); }
AOT_EXPORT void rope_pool_fused_bf16_f16(void** args) { run<BF16, F16>(args); }
AOT_EXPORT void rope_pool_fused_bf16_f32(void** args) { run<BF16, F32>(args); }
AOT_EXPORT void rope_pool_fused_f32_f16(void** args) { run<F32, F16>(args); }
AOT_EXPORT void rope_pool_fused_f32_bf16(void** args) { run<F32, BF16>(args); }
