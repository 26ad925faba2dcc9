// decode_attention_quantized, CPU entry points (docs/kernel-abi.md): decode_attention over mlx-lm's
// quantized K/V (packed uint32 words, scales, biases) read in place: each key and value row the
// attention reaches is dequantized once into fp32 (q * scale + bias) for every query row of its kv
// head, then decode_attention's loop (cpu_src/aot_attention.h). The workspace and locks (CUDA's
// flash-decoding) are not used.
#include <cstdint>

#include "aot_attention.h"
#include "aot_quant.h"

namespace {

template <typename T>
void run(void** args) {
  using aot_cpu::scalar;
  using S = typename T::storage;
  const auto kp = aot_cpu::quant_pool<T>(args, 2), vp = aot_cpu::quant_pool<T>(args, 5);
  // args[11], args[12]: workspace, locks (CUDA only); args[26], args[27]: n_splits, split_len (CUDA only)
  const int bits = scalar<int32_t>(args, 19), gs = scalar<int32_t>(args, 20);
  const aot_cpu::Attention a{scalar<int32_t>(args, 13), scalar<int32_t>(args, 14), scalar<int32_t>(args, 15),
                             scalar<int32_t>(args, 16), scalar<int32_t>(args, 17), scalar<int32_t>(args, 18),
                             scalar<int32_t>(args, 21), scalar<int32_t>(args, 22), scalar<int32_t>(args, 23),
                             scalar<float>(args, 24),   scalar<float>(args, 25),   static_cast<const int32_t*>(args[28])};
  // A format the kernel does not implement reads nothing (the wrapper never passes one).
  if ((bits != 4 && bits != 8) || (gs != 32 && gs != 64 && gs != 128) || a.D < gs || a.D % gs) return;
  const int64_t W = int64_t(a.D) * bits / 32, G = a.D / gs;
  aot_cpu::attend<T>(aot_cpu::buffer<const S>(args, 0), aot_cpu::buffer<S>(args, 1),
                     aot_cpu::buffer<const int32_t>(args, 8), aot_cpu::buffer<const int32_t>(args, 9),
                     aot_cpu::buffer<const int32_t>(args, 10), a,
                     [&](int64_t row, float* kf, float* vf) {
                       aot_cpu::dequantize_row<T>(kp.words + row * W, kp.scales + row * G, kp.biases + row * G, a.D,
                                                  bits, gs, kf);
                       aot_cpu::dequantize_row<T>(vp.words + row * W, vp.scales + row * G, vp.biases + row * G, a.D,
                                                  bits, gs, vf);
                     });
}

}  // namespace

#define DAQ_ENTRY(NAME, T) \
  AOT_EXPORT void NAME(void** args) { run<aot_cpu::T>(args); }

DAQ_ENTRY(decode_attention_quantized_f16, F16)
DAQ_ENTRY(decode_attention_quantized_bf16, BF16)
DAQ_ENTRY(decode_attention_quantized_f32, F32)
