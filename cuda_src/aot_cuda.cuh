// Storage types of the CUDA kernels (docs/kernel-abi.md): Cvt<T>::load to fp32, Cvt<T>::store from
// fp32 with one rounding to nearest even; Vec<T, W>, W elements moved by one aligned access.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

}  // namespace aot_cuda
