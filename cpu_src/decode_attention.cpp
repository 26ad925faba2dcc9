// decode_attention, CPU entry points (docs/kernel-abi.md): attention of a few query tokens per
// sequence over K/V read in place (head-major cache or slot-major pool through a table), each row's
// valid range as data. Per (batch row, kv head): the scores of every query row of the kv head
// (grouped heads x L tokens) against each visible key, one softmax per query row, then the values;
// fp32 math, one rounding to the output type (cpu_src/aot_attention.h). The workspace and locks
// (CUDA's flash-decoding) are not used: the CPU entry runs the whole problem in one call.
#include <cstdint>

#include "aot_attention.h"
#include "aot_cpu.h"

#define AOT_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using aot_cpu::buffer;
using aot_cpu::scalar;

template <typename T>
void run(void** args) {
  using S = typename T::storage;
  const S* k_pool = buffer<const S>(args, 2);
  const S* v_pool = buffer<const S>(args, 3);
  // args[7], args[8]: workspace, locks (CUDA only); args[20], args[21]: n_splits, split_len (CUDA only)
  const aot_cpu::Attention a{scalar<int32_t>(args, 9),  scalar<int32_t>(args, 10), scalar<int32_t>(args, 11),
                             scalar<int32_t>(args, 12), scalar<int32_t>(args, 13), scalar<int32_t>(args, 14),
                             scalar<int32_t>(args, 15), scalar<int32_t>(args, 16), scalar<int32_t>(args, 17),
                             scalar<float>(args, 18),   scalar<float>(args, 19),   static_cast<const int32_t*>(args[22])};
  const int64_t D = a.D;
  aot_cpu::attend<T>(buffer<const S>(args, 0), buffer<S>(args, 1), buffer<const int32_t>(args, 4),
                     buffer<const int32_t>(args, 5), buffer<const int32_t>(args, 6), a,
                     [&](int64_t row, float* kf, float* vf) {
                       for (int64_t d = 0; d < D; ++d) {
                         kf[d] = T::load(k_pool[row * D + d]);
                         vf[d] = T::load(v_pool[row * D + d]);
                       }
                     });
}

}  // namespace

#define DA_ENTRY(NAME, T) \
  AOT_EXPORT void NAME(void** args) { run<aot_cpu::T>(args); }

DA_ENTRY(decode_attention_f16, F16)
DA_ENTRY(decode_attention_bf16, BF16)
DA_ENTRY(decode_attention_f32, F32)
