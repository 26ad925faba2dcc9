// Runs the real csrc/aot_launch_metal.cpp eval_gpu on Linux and prints every Metal call it makes, so
// tests/test_metal_launcher_abi.py can compare the launcher's bindings with metal_src/ and
// docs/kernel-abi.md. Built against MLX 0.32.4's real macOS headers (metal-cpp included) and linked
// with the Linux libmlx (same headers) plus the launcher's other sources. What libmlx.dylib would provide on a
// Mac (mlx::core::metal's out-of-line device and encoder functions) and the Objective-C runtime are
// defined here as recorders: they print the call and return a token, nothing runs on a GPU.
//
// stdin: entry, dtype (the entry key), then one line each of roles, like, strided (0/1), scalar_types,
// specialize, scalar bits, buffer dtypes (the plan's, per buffer), grid (3) and threadgroup (3);
// every list starts with its length.
#include <dispatch/dispatch.h>

#include <Metal/Metal.hpp>

#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>

#include "aot_launch.h"
#include "mlx/backend/metal/device.h"
#include "mlx/ops.h"
#include "mlx/transforms.h"

namespace mx = mlx::core;

namespace {
// Raw storage standing for MLX's Device and CommandEncoder objects: every out-of-line member function
// eval_gpu reaches is defined below; the inline ones read zeroed fields (mtl_device() is null).
alignas(64) unsigned char device_storage[sizeof(mx::metal::Device)];
alignas(64) unsigned char encoder_storage[sizeof(mx::metal::CommandEncoder)];
alignas(64) unsigned char mtl_encoder_storage[64];   // the MTL::ComputeCommandEncoder (an ObjC object)
alignas(64) unsigned char mtl_library_storage[64];
alignas(64) unsigned char mtl_pipeline_storage[64];
std::vector<mx::array>* g_inputs = nullptr;
std::vector<mx::array>* g_outputs = nullptr;

int position_of(const std::vector<mx::array>& arrays, const mx::array& a) {
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (arrays[i].id() == a.id()) return static_cast<int>(i);
  }
  return -1;
}

// The input whose buffer `a` shares (an in-place output), or -1.
int buffer_of(const std::vector<mx::array>& arrays, const mx::array& a) {
  for (size_t i = 0; i < arrays.size(); ++i) {
    if (arrays[i].data<void>() == a.data<void>()) return static_cast<int>(i);
  }
  return -1;
}

// " <ndim> <strides...>": an array's element strides as MLX holds them.
std::string strides_of(const mx::array& a) {
  std::string out = " " + std::to_string(a.ndim());
  for (auto s : a.strides()) out += " " + std::to_string(s);
  return out;
}

std::vector<int> read_ints(std::istream& in) {
  size_t n = 0;
  in >> n;
  std::vector<int> v(n);
  for (auto& x : v) in >> x;
  return v;
}
}  // namespace

// ---- the Objective-C runtime (libobjc): selectors are their names, classes and protocols null
// (probe_selectors.cpp registers every metal-cpp selector through it.)
extern "C" SEL sel_registerName(const char* name) { return reinterpret_cast<SEL>(strdup(name)); }
extern "C" Class objc_lookUpClass(const char*) { return nullptr; }
extern "C" Protocol* objc_getProtocol(const char*) { return nullptr; }

// Called from probe_msgsend.cpp's objc_msgSend with the message's selector name. Messages to the
// compute encoder other than these two would bind or dispatch behind the ABI check's back: they are
// printed as such. Any other message gets a distinct object back (e.g. a library built from data).
extern "C" void* probe_message(const void* self, const char* sel, uintptr_t a, uintptr_t b, uintptr_t c) {
  static unsigned char objects[64][16];
  static int next_object = 0;
  const bool on_encoder = self == mtl_encoder_storage;
  if (on_encoder && std::strcmp(sel, "setComputePipelineState:") == 0) {
    std::printf("pipeline %d\n", reinterpret_cast<void*>(a) == mtl_pipeline_storage);
    return nullptr;
  }
  if (on_encoder && std::strcmp(sel, "setBytes:length:atIndex:") == 0) {
    // index, length, then the bytes as 32-bit words: one for a scalar, four for a strided buffer's
    // int32[4] (printed signed); any other length is printed without its contents.
    std::printf("bytes %lu %lu", static_cast<unsigned long>(c), static_cast<unsigned long>(b));
    if (b == 4) {
      uint32_t bits = 0;
      std::memcpy(&bits, reinterpret_cast<const void*>(a), 4);
      std::printf(" %u", bits);
    } else if (b == 16) {
      int32_t s[4];
      std::memcpy(s, reinterpret_cast<const void*>(a), 16);
      std::printf(" %d %d %d %d", s[0], s[1], s[2], s[3]);
    }
    std::printf("\n");
    return nullptr;
  }
  std::printf("message %d %s\n", on_encoder, sel);
  if (std::strncmp(sel, "newLibrary", 10) == 0) return mtl_library_storage;
  return objects[next_object++ % 64];
}

// ---- libdispatch, for a metallib loaded from memory (dispatch_data_create + newLibraryWithData:)
extern "C" dispatch_data_t dispatch_data_create(const void*, size_t size, dispatch_queue_t, dispatch_block_t) {
  std::printf("dispatch_data %zu\n", size);
  static dispatch_data_s data;
  return &data;
}
extern "C" void dispatch_release(dispatch_object_t) {}

// ---- libmlx.dylib's Metal backend, as far as eval_gpu reaches it
namespace mlx::core::metal {

Device& device(mlx::core::Device d) {
  std::printf("device %d %d\n", static_cast<int>(d.type), d.index);
  return *reinterpret_cast<Device*>(device_storage);
}

CommandEncoder& get_command_encoder(Stream s) {
  std::printf("encoder %d %d\n", s.index, static_cast<int>(s.device.type));
  return *reinterpret_cast<CommandEncoder*>(encoder_storage);
}

MTL::ComputePipelineState* Device::get_kernel(const std::string& base_name, MTL::Library* lib,
                                              const std::string& hash_name, const MTLFCList& func_consts,
                                              const std::vector<MTL::Function*>& linked_functions) {
  std::printf("kernel %s %s %d %zu %zu\n", base_name.c_str(), hash_name.c_str(),
              reinterpret_cast<void*>(lib) == mtl_library_storage, func_consts.size(), linked_functions.size());
  for (const auto& [value, type, index] : func_consts) {
    // Metal reads a constant's value with the size of its type: 4 bytes for int and float.
    uint32_t bits = 0;
    std::memcpy(&bits, value, 4);
    const char* t = type == MTL::DataTypeInt ? "int" : type == MTL::DataTypeFloat ? "float" : "other";
    std::printf("constant %lu %s %u %d\n", static_cast<unsigned long>(index), t, bits, static_cast<int>(type));
  }
  return reinterpret_cast<MTL::ComputePipelineState*>(mtl_pipeline_storage);
}

MTL::ComputeCommandEncoder* CommandEncoder::get_command_encoder() {
  return reinterpret_cast<MTL::ComputeCommandEncoder*>(mtl_encoder_storage);
}

void CommandEncoder::set_input_array(const array& a, int idx, int64_t offset) {
  std::printf("input %d %d %ld %s%s\n", idx, position_of(*g_inputs, a), static_cast<long>(offset),
              mlx_aot::dtype_name(a.dtype()), strides_of(a).c_str());
}

void CommandEncoder::set_output_array(array& a, int idx, int64_t offset) {
  std::printf("output %d %d %d %ld %s%s\n", idx, position_of(*g_outputs, a), buffer_of(*g_inputs, a),
              static_cast<long>(offset), mlx_aot::dtype_name(a.dtype()), strides_of(a).c_str());
}

void CommandEncoder::set_buffer(const MTL::Buffer*, int idx, int64_t offset) {
  std::printf("buffer %d %ld\n", idx, static_cast<long>(offset));
}

void CommandEncoder::dispatch_threads(MTL::Size grid, MTL::Size group) {
  std::printf("dispatch_threads %lu %lu %lu %lu %lu %lu\n", grid.width, grid.height, grid.depth, group.width,
              group.height, group.depth);
}

void CommandEncoder::dispatch_threadgroups(MTL::Size grid, MTL::Size group) {
  std::printf("dispatch_threadgroups %lu %lu %lu %lu %lu %lu\n", grid.width, grid.height, grid.depth, group.width,
              group.height, group.depth);
}

}  // namespace mlx::core::metal

// ---- one eval_gpu of a plan read from stdin
int main() {
  auto bin = std::make_shared<mlx_aot::KernelBinary>();
  auto args = std::make_shared<mlx_aot::LaunchArgs>();
  bin->key = "mlx_aot_probe.metallib";
  bin->path = "/probe/artifact.metallib";
  bin->target = "metal";
  bin->image = "verified metallib bytes";  // what the launcher builds its library from
  std::cin >> args->entry >> args->dtype;
  bin->roles = read_ints(std::cin);
  bin->like = read_ints(std::cin);
  bin->strided = read_ints(std::cin);
  size_t n = 0;
  bin->scalar_types = read_ints(std::cin);
  bin->specialize = read_ints(std::cin);
  std::cin >> n;
  args->scalars.resize(n);
  for (auto& s : args->scalars) std::cin >> s;
  std::cin >> n;
  args->buffer_dtypes.resize(n);
  for (auto& d : args->buffer_dtypes) std::cin >> d;
  for (auto& g : args->grid) std::cin >> g;
  for (auto& g : args->group) std::cin >> g;
  if (!std::cin) {
    std::fprintf(stderr, "probe: malformed plan on stdin\n");
    return 2;
  }
  mlx_aot::index_buffers(*bin);

  // Input i gets i + 1 elements of the plan's dtype for it, so every array is distinct; a strided one
  // is a [2, 3, i + 2, 4] transposed view (strides distinct per input, not row-contiguous). Outputs as
  // launch() makes them (an output has its `like` input's dtype and shape, row-contiguous).
  auto dtype_of = [&](const std::string& name) {
    for (auto d : {mx::float16, mx::bfloat16, mx::float32, mx::int32, mx::uint32})
      if (name == mlx_aot::dtype_name(d)) return d;
    std::fprintf(stderr, "probe: unknown dtype %s\n", name.c_str());
    std::exit(2);
  };
  std::vector<mx::array> inputs;
  for (size_t b = 0; b < bin->roles.size(); ++b) {
    if (bin->input_of[b] < 0) continue;
    mx::Dtype t = dtype_of(args->buffer_dtypes.at(b));
    const int i = static_cast<int>(inputs.size());
    if (bin->strided.at(b)) {
      inputs.push_back(mx::transpose(mx::zeros({2, i + 2, 3, 4}, t, mx::Device::cpu), {0, 2, 1, 3}, mx::Device::cpu));
    } else {
      inputs.push_back(mx::zeros({i + 1}, t, mx::Device::cpu));
    }
  }
  mx::eval(inputs);
  mx::Stream stream(0, mx::Device::gpu);
  auto prim = std::make_shared<mlx_aot::AotLaunch>(stream, bin, args);
  std::vector<mx::array> outputs;
  for (size_t b = 0; b < bin->roles.size(); ++b) {
    if (bin->output_of[b] < 0) continue;
    const auto& src = inputs[bin->input_of[bin->roles[b] == mlx_aot::kOutput ? bin->like[b] : b]];
    outputs.emplace_back(src.shape(), src.dtype(), nullptr, std::vector<mx::array>{});
  }
  g_inputs = &inputs;
  g_outputs = &outputs;
  std::printf("eval %zu %zu\n", inputs.size(), outputs.size());
  prim->eval_gpu(inputs, outputs);
  std::printf("done\n");
  std::fflush(stdout);
  return 0;
}
