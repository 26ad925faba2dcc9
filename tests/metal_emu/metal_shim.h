// Host C++ stand-ins for the part of the Metal Shading Language our kernels use, so that a
// metal_src/*.metal kernel compiles with g++/clang++ and runs thread by thread on the CPU
// (tests/metal_emu/emulator.py translates the source; runtime.h drives it).
//
// What is here is all that is supported. Anything else fails to compile, and emulator.py turns the
// compiler's error into "unsupported Metal feature: <name>"; features that compile but cannot be
// emulated faithfully (SIMD-group functions, atomics, textures, ...) are refused by name before.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

// Address spaces: one flat host memory. `constant` is read-only, as on the GPU. Threadgroup
// *declarations* are rewritten by emulator.py into metal_emu::tg_var (storage shared by the threads
// of one threadgroup); the qualifier left on pointers and references means nothing more.
#define device
#define constant const
#define thread
#define threadgroup

// ---------------------------------------------------------------------------- scalar types
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
// IEEE binary16 with round-to-nearest-even conversions, like Metal's half. Arithmetic on two
// halves may keep float precision inside one expression on the host (g++ evaluates _Float16 in
// float); Metal rounds each operation to half. Keep half math in float, as our kernels do.
#if defined(__FLT16_MAX__) && !defined(METAL_EMU_SOFT_HALF)
typedef _Float16 half;
#else
#define METAL_EMU_HALF_IS_STRUCT 1
// Compilers without _Float16 on this target (clang < 15 on x86-64): the same conversions in software.
struct half {
  uint16_t bits;
  half() = default;
  half(float f) : bits(from_float(f)) {}
  half(double d) : half(static_cast<float>(d)) {}
  half(int i) : half(static_cast<float>(i)) {}
  half(unsigned int i) : half(static_cast<float>(i)) {}
  operator float() const {
    const uint32_t sign = (bits & 0x8000u) << 16, exp = (bits >> 10) & 0x1fu, mant = bits & 0x3ffu;
    if (exp == 0) {  // zero or subnormal: mant * 2^-24
      const float f = std::ldexp(static_cast<float>(mant), -24);
      return sign ? -f : f;
    }
    const uint32_t u = sign | (exp == 31 ? 0x7f800000u : (exp + 112) << 23) | (mant << 13);
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | ((a >> 13) & 0x3ffu);  // NaN stays (quiet) NaN
    if (a >= 0x477ff000u) return sign | 0x7c00u;                        // >= 65520 rounds to infinity
    if (a < 0x38800000u) {                                               // below 2^-14: subnormal half
      float m;
      std::memcpy(&m, &a, 4);
      return sign | static_cast<uint16_t>(std::nearbyint(m * 16777216.0f));  // exact scaling, then RNE
    }
    a += 0xc8000fffu + ((a >> 13) & 1u);  // rebias the exponent by -112 and round to nearest even
    return sign | static_cast<uint16_t>(a >> 13);
  }
};
inline half operator-(half a) { half r = a; r.bits ^= 0x8000u; return r; }
#endif
static_assert(sizeof(half) == 2, "half must be 2 bytes like Metal's");

// Metal's bfloat (MSL 3.1): the top 16 bits of an IEEE float; conversion from float rounds to
// nearest even, NaN stays NaN. Arithmetic runs in float and rounds once, like the GPU.
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN, sign and payload top kept
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);
      bits = static_cast<uint16_t>(u >> 16);
    }
  }
  bfloat(double d) : bfloat(static_cast<float>(d)) {}
  bfloat(int i) : bfloat(static_cast<float>(i)) {}
  bfloat(uint i) : bfloat(static_cast<float>(i)) {}
  bfloat(half h) : bfloat(static_cast<float>(h)) {}
  operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
static_assert(sizeof(bfloat) == 2, "bfloat must be 2 bytes like Metal's");

// bfloat op bfloat -> bfloat (and the software half alike). Templates, so that bfloat op float is
// the builtin float operation (Metal promotes the same way) instead of an ambiguous overload.
template <typename T> struct metal_emu_soft_float : std::false_type {};
template <> struct metal_emu_soft_float<bfloat> : std::true_type {};
#ifdef METAL_EMU_HALF_IS_STRUCT
template <> struct metal_emu_soft_float<half> : std::true_type {};
#endif
#define METAL_EMU_BF_OP(OP)                                                                   \
  template <typename B, typename = std::enable_if_t<metal_emu_soft_float<B>::value>>         \
  inline B operator OP(B a, B b) { return B(float(a) OP float(b)); }                         \
  template <typename B, typename = std::enable_if_t<metal_emu_soft_float<B>::value>>         \
  inline B& operator OP##=(B& a, B b) { return a = B(float(a) OP float(b)); }
METAL_EMU_BF_OP(+)
METAL_EMU_BF_OP(-)
METAL_EMU_BF_OP(*)
METAL_EMU_BF_OP(/)
#undef METAL_EMU_BF_OP
inline bfloat operator-(bfloat a) { bfloat r = a; r.bits ^= 0x8000u; return r; }

// ---------------------------------------------------------------------------- vector types
// vec<T, N> with Metal's sizes and alignments (a 3-vector occupies 4 elements), so reinterpreting
// device memory as vectors has Metal's layout, and UBSan's alignment check reports a misaligned
// vector access as the GPU would fault on it. Declared in metal::, usable unqualified like Metal's.
namespace metal {
template <typename T, int N>
struct vec;

// Copies go member by member (not the implicit memcpy): clang's UBSan checks the alignment of
// member accesses, not of trivial aggregate copies, so a misaligned vector load or store through a
// reinterpreted device pointer is reported by clang as by g++.
#define METAL_EMU_VEC_OPS(N)                                                                   \
  vec(const vec& o) { for (int i = 0; i < N; ++i) (*this)[i] = o.at(i); }                     \
  vec& operator=(const vec& o) { for (int i = 0; i < N; ++i) (*this)[i] = o.at(i); return *this; } \
  T at(int i) const { return (&x)[i]; }                                                        \
  T& operator[](int i) { return (&x)[i]; }                                                    \
  const T& operator[](int i) const { return (&x)[i]; }                                        \
  friend vec operator+(vec a, const vec& b) { for (int i = 0; i < N; ++i) a[i] = a[i] + b[i]; return a; } \
  friend vec operator-(vec a, const vec& b) { for (int i = 0; i < N; ++i) a[i] = a[i] - b[i]; return a; } \
  friend vec operator*(vec a, const vec& b) { for (int i = 0; i < N; ++i) a[i] = a[i] * b[i]; return a; } \
  friend vec operator/(vec a, const vec& b) { for (int i = 0; i < N; ++i) a[i] = a[i] / b[i]; return a; } \
  friend vec operator*(vec a, T s) { for (int i = 0; i < N; ++i) a[i] = a[i] * s; return a; }             \
  friend vec operator*(T s, vec a) { for (int i = 0; i < N; ++i) a[i] = s * a[i]; return a; }

template <typename T>
struct alignas(2 * sizeof(T)) vec<T, 2> {
  T x, y;
  vec() = default;
  explicit vec(T s) : x(s), y(s) {}
  vec(T x_, T y_) : x(x_), y(y_) {}
  template <typename U>
  explicit vec(const vec<U, 2>& o) : x(T(o.x)), y(T(o.y)) {}
  METAL_EMU_VEC_OPS(2)
};
template <typename T>
struct alignas(4 * sizeof(T)) vec<T, 3> {
  T x, y, z;
  vec() = default;
  explicit vec(T s) : x(s), y(s), z(s) {}
  vec(T x_, T y_, T z_) : x(x_), y(y_), z(z_) {}
  template <typename U>
  explicit vec(const vec<U, 3>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)) {}
  METAL_EMU_VEC_OPS(3)
};
template <typename T>
struct alignas(4 * sizeof(T)) vec<T, 4> {
  T x, y, z, w;
  vec() = default;
  explicit vec(T s) : x(s), y(s), z(s), w(s) {}
  vec(T x_, T y_, T z_, T w_) : x(x_), y(y_), z(z_), w(w_) {}
  template <typename U>
  explicit vec(const vec<U, 4>& o) : x(T(o.x)), y(T(o.y)), z(T(o.z)), w(T(o.w)) {}
  METAL_EMU_VEC_OPS(4)
};
#undef METAL_EMU_VEC_OPS

}  // namespace metal
using metal::vec;
#define METAL_EMU_VEC_TYPES(T)     \
  typedef metal::vec<T, 2> T##2;   \
  typedef metal::vec<T, 3> T##3;   \
  typedef metal::vec<T, 4> T##4;
METAL_EMU_VEC_TYPES(float)
METAL_EMU_VEC_TYPES(half)
METAL_EMU_VEC_TYPES(bfloat)
METAL_EMU_VEC_TYPES(int)
METAL_EMU_VEC_TYPES(uint)
METAL_EMU_VEC_TYPES(short)
METAL_EMU_VEC_TYPES(ushort)
#undef METAL_EMU_VEC_TYPES
static_assert(sizeof(float3) == 16 && alignof(half2) == 4, "Metal vector layout");

// ---------------------------------------------------------------------------- metal:: math
namespace metal {
template <typename T>
inline T min(T a, T b) { return a < b ? a : b; }
template <typename T>
inline T max(T a, T b) { return a > b ? a : b; }
template <typename T>
inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
template <typename T>
inline T select(T a, T b, bool c) { return c ? b : a; }
inline int abs(int x) { return x < 0 ? -x : x; }

// The float functions, once per namespace. precise:: and fast:: are both libm here: on the host
// they differ in nothing, so only a Mac checks fast:: accuracy (docs/metal.md).
#define METAL_EMU_MATH                                                                   \
  inline float cos(float x) { return std::cos(x); }                                      \
  inline float sin(float x) { return std::sin(x); }                                      \
  inline float tan(float x) { return std::tan(x); }                                      \
  inline float sincos(float x, float& c) { c = std::cos(x); return std::sin(x); }        \
  inline float exp(float x) { return std::exp(x); }                                      \
  inline float exp2(float x) { return std::exp2(x); }                                    \
  inline float log(float x) { return std::log(x); }                                      \
  inline float log2(float x) { return std::log2(x); }                                    \
  inline float pow(float x, float y) { return std::pow(x, y); }                          \
  inline float sqrt(float x) { return std::sqrt(x); }                                    \
  inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }                            \
  inline float fabs(float x) { return std::fabs(x); }                                    \
  inline float abs(float x) { return std::fabs(x); }                                     \
  inline float floor(float x) { return std::floor(x); }                                  \
  inline float ceil(float x) { return std::ceil(x); }                                    \
  inline float round(float x) { return std::round(x); }                                  \
  inline float rint(float x) { return std::rint(x); }                                    \
  inline float trunc(float x) { return std::trunc(x); }                                  \
  inline float fmod(float x, float y) { return std::fmod(x, y); }                        \
  inline float fmin(float x, float y) { return std::fmin(x, y); }                        \
  inline float fmax(float x, float y) { return std::fmax(x, y); }                        \
  inline float tanh(float x) { return std::tanh(x); }                                    \
  inline float divide(float x, float y) { return x / y; }
METAL_EMU_MATH
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline bool isnan(float x) { return std::isnan(x); }
inline bool isinf(float x) { return std::isinf(x); }
inline bool isfinite(float x) { return std::isfinite(x); }
namespace precise {
METAL_EMU_MATH
}  // namespace precise
namespace fast {
METAL_EMU_MATH
}  // namespace fast
#undef METAL_EMU_MATH

// Barriers: threadgroup_barrier synchronises the threads of a threadgroup (runtime.h runs them as
// fibers); mem_flags only order memory on a GPU, which one host thread does not need.
enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
}  // namespace metal

// ---------------------------------------------------------------------------- runtime hooks
namespace metal_emu {

// Function constants: `constant T NAME [[function_constant(i)]];` becomes
// METAL_EMU_FUNCTION_CONSTANT(T, NAME, i): a global the runtime sets before each launch from the
// launch's values by index, like MTLFunctionConstantValues. Registration happens at static
// initialisation; the runtime refuses duplicate indices and launches that leave one unset.
template <typename T> const char* type_name();
template <> inline const char* type_name<int>() { return "int"; }
template <> inline const char* type_name<uint>() { return "uint"; }
template <> inline const char* type_name<short>() { return "short"; }
template <> inline const char* type_name<ushort>() { return "ushort"; }
template <> inline const char* type_name<bool>() { return "bool"; }
template <> inline const char* type_name<float>() { return "float"; }
template <> inline const char* type_name<half>() { return "half"; }

struct FunctionConstant {
  int index;
  const char* name;
  const char* type;
  void* ptr;
  int size;
};
constexpr int kMaxFunctionConstants = 64;
inline FunctionConstant* function_constants() {
  static FunctionConstant table[kMaxFunctionConstants];
  return table;
}
inline int& n_function_constants() {
  static int n = 0;
  return n;
}
struct RegisterConstant {
  RegisterConstant(int index, const char* name, const char* type, void* ptr, int size) {
    if (n_function_constants() == kMaxFunctionConstants) {
      std::fprintf(stderr, "metal_emu: more than %d function constants\n", kMaxFunctionConstants);
      std::exit(2);
    }
    function_constants()[n_function_constants()++] = {index, name, type, ptr, size};
  }
};

// Storage of a `threadgroup` declaration (id: one per declaration site), shared by the threads of
// the running threadgroup and filled with 0xFF bytes (NaN, -1) when each threadgroup starts: reading
// it before any thread wrote it shows up instead of silently reading the previous group's data.
void* threadgroup_storage(int id, size_t size, size_t align);
template <typename T>
inline T& tg_var(int id) {
  return *static_cast<T*>(threadgroup_storage(id, sizeof(T), alignof(T)));
}

// threadgroup_barrier(flags), rewritten by emulator.py to barrier(<call site>, flags): suspends the
// calling thread until every thread of its threadgroup reached the same call site.
void barrier(int site, metal::mem_flags flags);

// The position attributes of the running thread.
struct ThreadIds {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid,
      threads_per_threadgroup, threads_per_grid, threadgroups_per_grid;
  uint thread_index_in_threadgroup;
};

template <typename T> struct Pos;
template <> struct Pos<uint3> { static uint3 get(const uint3& v) { return v; } };
template <> struct Pos<uint2> { static uint2 get(const uint3& v) { return uint2(v.x, v.y); } };
template <> struct Pos<uint> { static uint get(const uint3& v) { return v.x; } };
template <> struct Pos<ushort3> {
  static ushort3 get(const uint3& v) { return ushort3(ushort(v.x), ushort(v.y), ushort(v.z)); }
};
template <> struct Pos<ushort2> { static ushort2 get(const uint3& v) { return ushort2(ushort(v.x), ushort(v.y)); } };
template <> struct Pos<ushort> { static ushort get(const uint3& v) { return ushort(v.x); } };
template <typename T>
inline T pos_as(const uint3& v) { return Pos<T>::get(v); }

}  // namespace metal_emu

#define METAL_EMU_FUNCTION_CONSTANT(T, NAME, INDEX) \
  static T NAME;                                    \
  static metal_emu::RegisterConstant NAME##_registration(INDEX, #NAME, metal_emu::type_name<T>(), &NAME, sizeof(T))

