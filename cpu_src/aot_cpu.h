// Storage types of the CPU kernels (docs/kernel-abi.md): load to fp32, store from fp32 with one
// rounding to nearest even, as MLX rounds. Each has `storage`, `load` and `store`.
#pragma once
#include <cstdint>
#include <cstring>

// The entry points' linkage (every kernel source defines its entries with it).
#ifndef AOT_EXPORT
#define AOT_EXPORT extern "C" __attribute__((visibility("default")))
#endif

namespace aot_cpu {

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

// The argument array of a CPU entry: args[i] points at argument i (a buffer pointer, or a scalar).
template <typename T>
inline T* buffer(void** args, int i) { return *static_cast<T**>(args[i]); }
template <typename T>
inline T scalar(void** args, int i) { return *static_cast<const T*>(args[i]); }

// A strided activation buffer (docs/kernel-abi.md, "Strided buffers"): args[i] points at its four
// int32 strides, read through act_layout 0 ([T, H, D]) or 1 ([B, H, L, D], L = seq_len).
struct View {
  int64_t sb, sh, sl, sd;
  int L;
  // Element offset of the row (token t, head h); t = b * L + l.
  int64_t row(int t, int h) const {
    const int b = t / L, l = t - b * L;
    return b * sb + h * sh + l * sl;
  }
};
inline View view(void** args, int i, int act_layout, int seq_len) {
  const int32_t* s = static_cast<const int32_t*>(args[i]);
  if (act_layout == 0) return {s[1], s[2], 0, s[3], 1};
  return {s[0], s[1], s[2], s[3], seq_len > 0 ? seq_len : 1};
}
// Row (t, h) of a strided input as contiguous elements: the row itself when its features are
// adjacent, else gathered into `scratch` (n elements).
template <typename T>
inline const T* row_in(const T* base, const View& v, int t, int h, int n, T* scratch) {
  const T* p = base + v.row(t, h);
  if (v.sd == 1) return p;
  for (int i = 0; i < n; ++i) scratch[i] = p[static_cast<int64_t>(i) * v.sd];
  return scratch;
}

}  // namespace aot_cpu
