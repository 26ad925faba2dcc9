// Storage types of the CUDA kernels (docs/kernel-abi.md): Cvt<T>::load to fp32, Cvt<T>::store from
// fp32 with one rounding to nearest even; Vec<T, W>, W elements moved by one aligned access; Strides
// and the addressing of strided activation buffers ("Strided buffers", act_layout).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace aot_cuda {

template <typename T> struct Cvt;
template <> struct Cvt<__half> {
  static __device__ __forceinline__ float load(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half store(float x) { return __float2half_rn(x); }
};
template <> struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
template <> struct Cvt<float> {
  static __device__ __forceinline__ float load(float x) { return x; }
  static __device__ __forceinline__ float store(float x) { return x; }
};

// A W-element vector moved with one aligned load/store (16 bytes for W * sizeof(T) == 16).
template <typename T, int W> struct alignas(sizeof(T) * W) Vec { T v[W]; };

// A strided buffer's element strides, right-aligned into 4 (a 3-D array: s[0] = 0), by value.
struct Strides { int s[4]; };

// Whether act_layout / seq_len name a layout the kernels know (1 needs seq_len >= 1: t / seq_len).
__host__ __device__ __forceinline__ bool act_layout_ok(int act_layout, int seq_len) {
  return act_layout == 0 || (act_layout == 1 && seq_len >= 1);
}

// Element offset of feature 0 of row (t, h) of an activation. act_layout 0: [T, H, D], at
// t*s[1] + h*s[2]; 1: [B, H, L, D] with token t = b*L + l (L = seq_len), at b*s[0] + h*s[1] + l*s[2].
// Feature d is a further d*s[3]. 64-bit: a view's offsets can exceed 2^31 elements.
__device__ __forceinline__ long long act_row(int t, int h, const Strides& st, int act_layout, int seq_len) {
  if (act_layout == 0) return static_cast<long long>(t) * st.s[1] + static_cast<long long>(h) * st.s[2];
  const int b = t / seq_len, l = t % seq_len;
  return static_cast<long long>(b) * st.s[0] + static_cast<long long>(h) * st.s[1] +
         static_cast<long long>(l) * st.s[2];
}

// Whether W-element units starting on feature multiples of W can use one Vec<T, W> access in the
// buffer at base: innermost stride 1, the others multiples of W, base aligned to the vector. Depends
// only on launch arguments, so every thread of a launch decides the same for a buffer (no divergence).
template <typename T, int W>
__device__ __forceinline__ bool vec_ok(const T* base, const Strides& st) {
  return st.s[3] == 1 && st.s[0] % W == 0 && st.s[1] % W == 0 && st.s[2] % W == 0 &&
         reinterpret_cast<uintptr_t>(base) % (sizeof(T) * W) == 0;
}

// The W elements p[0], p[step], ..., p[(W-1)*step] as one unit: one vector access when vec (then
// step is 1 and p aligned, vec_ok), else W element accesses.
template <typename T, int W>
__device__ __forceinline__ Vec<T, W> load_unit(const T* p, int step, bool vec) {
  if (vec) return *reinterpret_cast<const Vec<T, W>*>(p);
  Vec<T, W> x;
#pragma unroll
  for (int j = 0; j < W; ++j) x.v[j] = p[static_cast<long long>(j) * step];
  return x;
}
template <typename T, int W>
__device__ __forceinline__ void store_unit(T* p, int step, bool vec, const Vec<T, W>& x) {
  if (vec) {
    *reinterpret_cast<Vec<T, W>*>(p) = x;
    return;
  }
#pragma unroll
  for (int j = 0; j < W; ++j) p[static_cast<long long>(j) * step] = x.v[j];
}

// One rotary pair (y1, y2) rotated by `angle` in fp32, mscale applied to the inputs first (the input
// mscale of YaRN and SuScaled RoPE): x1' = m x1 cos - m x2 sin, x2' = m x1 sin + m x2 cos.
__device__ __forceinline__ void rotate_pair(float& y1, float& y2, float angle, float mscale) {
  float s, c;
  sincosf(angle, &s, &c);
  const float x1 = y1 * mscale, x2 = y2 * mscale;
  y1 = x1 * c - x2 * s;
  y2 = x1 * s + x2 * c;
}

}  // namespace aot_cuda
