// Host C++ stand-ins for the part of the Metal Shading Language our kernels use, so that
// metal_src/*.metal compiles with g++ and runs thread by thread on the CPU (tests/metal_emu/).
// What is here is all that is supported: anything else fails to compile, and emulator.py turns
// that error into "unsupported Metal feature: <name>".
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Address spaces: one flat host memory.
#define device
#define thread
#define constant

// ---------------------------------------------------------------------------- scalar types
typedef _Float16 half;

// bfloat: storage of the top 16 bits of an IEEE float; float -> bfloat rounds to nearest even.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40);
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(bfloat) == 2, "bfloat must be 2 bytes like Metal's");

typedef unsigned int uint;

template <typename T>
struct vec3 {
  T x, y, z;
};
typedef vec3<uint> uint3;
typedef vec3<int> int3;
template <typename T>
struct vec2 {
  T x, y;
};
typedef vec2<float> float2;
typedef vec2<uint> uint2;

// ---------------------------------------------------------------------------- metal:: math
namespace metal {
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
inline float exp2(float x) { return std::exp2(x); }
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
namespace precise {
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
}  // namespace precise
namespace fast {
// Metal's fast:: variants trade accuracy for speed on the GPU; on the host they are the precise
// functions, so only a Mac run checks their precision (docs/metal.md).
inline float cos(float x) { return std::cos(x); }
inline float sin(float x) { return std::sin(x); }
}  // namespace fast
}  // namespace metal

// ---------------------------------------------------------------------------- function constants
// `constant T NAME [[function_constant(i)]];` becomes AOT_FUNCTION_CONSTANT(T, NAME, i): a global
// the launcher sets per launch by index, like MTLFunctionConstantValues.
namespace metal_emu {
struct FunctionConstant {
  int index;
  void* ptr;
  int size;
};
inline std::vector<FunctionConstant>& function_constants() {
  static std::vector<FunctionConstant> table;
  return table;
}
struct RegisterConstant {
  RegisterConstant(int index, void* ptr, int size) { function_constants().push_back({index, ptr, size}); }
};
}  // namespace metal_emu

#define AOT_FUNCTION_CONSTANT(T, NAME, INDEX) \
  static T NAME;                              \
  static metal_emu::RegisterConstant NAME##_registration(INDEX, &NAME, sizeof(T))
