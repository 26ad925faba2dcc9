// Kernels that exercise the emulation itself (tests/test_metal_emulation.py): threadgroup memory
// and barriers, the position attributes, plain `kernel void` entries, and the faults the emulation
// must report rather than hide.
#include <metal_stdlib>
using namespace metal;

constant float SCALE [[function_constant(0)]];

// Per-threadgroup sums of in[0:n) * SCALE: a tree reduction in threadgroup memory. Edge groups of
// a non-uniform grid have fewer threads (threads_per_threadgroup says how many).
[[max_total_threads_per_threadgroup(64)]]
kernel void group_sum(const device float* in [[buffer(0)]], device float* out [[buffer(1)]],
                      constant uint& n [[buffer(2)]], uint gid [[thread_position_in_grid]],
                      uint lid [[thread_position_in_threadgroup]], uint tg [[threadgroup_position_in_grid]],
                      uint size [[threads_per_threadgroup]]) {
  threadgroup float partial[64];
  partial[lid] = gid < n ? in[gid] * SCALE : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = 32; stride > 0; stride /= 2) {
    if (lid < stride && lid + stride < size) {
      partial[lid] += partial[lid + stride];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) {
    out[tg] = partial[0];
  }
}

// Every position attribute of a 3-D launch, written per thread.
[[kernel]] void positions(device uint* out [[buffer(0)]], uint3 gid [[thread_position_in_grid]],
                          uint3 lid [[thread_position_in_threadgroup]], uint3 tg [[threadgroup_position_in_grid]],
                          uint3 tpg [[threads_per_threadgroup]], uint3 grid [[threads_per_grid]],
                          uint3 ngroups [[threadgroups_per_grid]], uint index [[thread_index_in_threadgroup]]) {
  const uint flat = (gid.z * grid.y + gid.y) * grid.x + gid.x;
  device uint* o = out + flat * 17;
  o[0] = gid.x; o[1] = gid.y; o[2] = gid.z;
  o[3] = lid.x; o[4] = lid.y; o[5] = lid.z;
  o[6] = tg.x; o[7] = tg.y; o[8] = tg.z;
  o[9] = tpg.x; o[10] = tpg.y; o[11] = tpg.z;
  o[12] = ngroups.x; o[13] = ngroups.y; o[14] = ngroups.z;
  o[15] = index;
  o[16] = grid.x * 1000000u + grid.y * 1000u + grid.z;
}

// Reads threadgroup memory no thread wrote: the emulation poisons it (NaN), not zeros.
[[kernel]] void read_before_write(device float* out [[buffer(0)]], uint gid [[thread_position_in_grid]],
                                  uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float scratch[4];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = scratch[lid % 4];
}

// A barrier only some threads reach: undefined on a GPU, an error in the emulation.
[[kernel]] void divergent_barrier(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid < 8) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = 1.0f;
}

// Threads of one group at two different barriers: also undefined.
[[kernel]] void split_barrier(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid % 2 == 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_device);
  }
  out[lid] = 1.0f;
}

// Every thread writes one location: the result depends on thread order (a write race).
[[kernel]] void last_writer(device uint* out [[buffer(0)]], uint gid [[thread_position_in_grid]]) {
  out[0] = gid;
}

// half and bfloat conversions: round to nearest even, as Metal converts float.
[[kernel]] void convert(const device float* in [[buffer(0)]], device half* h [[buffer(1)]],
                        device bfloat* b [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  h[i] = half(in[i]);
  b[i] = bfloat(in[i]);
}
