// rope_pool_fused, CPU entry points (docs/kernel-abi.md): RoPE on q and k, k and v stored into the
// slot-indexed pools, in one pass per token. Built by `python -m build_tools compile --target cpu`
// into a shared library that the MLX extension (csrc/) dlopens; args[i] points at argument i.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#define AOT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

// float16 through the compiler's IEEE half type; bfloat16 by bit manipulation with
// round-to-nearest-even (NaN kept quiet), matching how MLX rounds fp32 results.
struct F16 {
  using storage = _Float16;
  static float load(storage x) { return static_cast<float>(x); }
  static storage store(float x) { return static_cast<_Float16>(x); }
};
struct BF16 {
  using storage = uint16_t;
  static float load(storage x) {
    uint32_t bits = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  static storage store(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<storage>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<storage>(bits >> 16);
  }
};
struct F32 {
  using storage = float;
  static float load(storage x) { return x; }
  static storage store(float x) { return x; }
};

template <typename C>
void rotate_row(const typename C::storage* in, typename C::storage* out, const float* cs, const float* sn,
                int head_dim, int rotary_dims, bool traditional, float mscale) {
  const int half = rotary_dims / 2;
  for (int i = 0; i < half; ++i) {
    const int a = traditional ? 2 * i : i;
    const int b = traditional ? 2 * i + 1 : i + half;
    const float x1 = C::load(in[a]) * mscale;
    const float x2 = C::load(in[b]) * mscale;
    out[a] = C::store(x1 * cs[i] - x2 * sn[i]);
    out[b] = C::store(x1 * sn[i] + x2 * cs[i]);
  }
  if (rotary_dims < head_dim)  // pass-through features: an exact copy
    std::memcpy(out + rotary_dims, in + rotary_dims, sizeof(*in) * (head_dim - rotary_dims));
}

template <typename C>
void run(void** args) {
  using T = typename C::storage;
  const T* q = *static_cast<const T**>(args[0]);
  const T* k = *static_cast<const T**>(args[1]);
  const T* v = *static_cast<const T**>(args[2]);
  T* q_out = *static_cast<T**>(args[3]);
  T* k_out = *static_cast<T**>(args[4]);
  T* k_pool = *static_cast<T**>(args[5]);
  T* v_pool = *static_cast<T**>(args[6]);
  const int32_t* positions = *static_cast<const int32_t**>(args[7]);
  const int32_t* slots = *static_cast<const int32_t**>(args[8]);
  const float* inv_freq = *static_cast<const float**>(args[9]);
  const int n_tokens = *static_cast<const int32_t*>(args[10]);
  const int pool_size = *static_cast<const int32_t*>(args[11]);
  const int n_q_heads = *static_cast<const int32_t*>(args[12]);
  const int n_kv_heads = *static_cast<const int32_t*>(args[13]);
  const int head_dim = *static_cast<const int32_t*>(args[14]);
  const int rotary_dims = *static_cast<const int32_t*>(args[15]);
  const bool traditional = *static_cast<const int32_t*>(args[16]) != 0;
  // args[17] (heads_per_thread) shapes GPU launches only.
  const float pos_scale = *static_cast<const float*>(args[18]);
  const float mscale = *static_cast<const float*>(args[19]);

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
    const bool write = slot >= 0 && slot < pool_size;  // slot < 0: rotate only; >= pool_size: never written
    for (int h = 0; h < n_kv_heads; ++h) {
      const size_t off = (static_cast<size_t>(t) * n_kv_heads + h) * row;
      rotate_row<C>(k + off, k_out + off, cs.data(), sn.data(), head_dim, rotary_dims, traditional, mscale);
      if (write) {
        const size_t dst = (static_cast<size_t>(slot) * n_kv_heads + h) * row;
        std::memcpy(k_pool + dst, k_out + off, sizeof(T) * row);
        std::memcpy(v_pool + dst, v + off, sizeof(T) * row);
      }
    }
  }
}

}  // namespace

AOT_EXPORT void rope_pool_fused_f16(void** args) { run<F16>(args); }
AOT_EXPORT void rope_pool_fused_bf16(void** args) { run<BF16>(args); }
AOT_EXPORT void rope_pool_fused_f32(void** args) { run<F32>(args); }
