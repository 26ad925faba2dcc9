// eval_gpu on MLX's Metal backend. Built on macOS; on Linux, CI type-checks it against MLX 0.32.4's
// macOS headers and runs it with MLX's Metal calls recorded (docs/metal.md). The metallib is built
// once per (artifact, device) from the verified bytes; pipelines are specialised by function
// constants and cached under a name that encodes every constant's bits.
#include "aot_launch.h"

#include <dispatch/dispatch.h>

#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "mlx/backend/metal/device.h"

namespace mlx_aot {

namespace {

// The library is built from the bytes registry/artifacts.py verified (never re-read from bin.path),
// once per (artifact, device); intentionally never released.
MTL::Library* library_from_image(mx::metal::Device& d, const KernelBinary& bin) {
  static std::mutex mu;
  static std::unordered_map<std::string, MTL::Library*> libs;
  std::lock_guard<std::mutex> lock(mu);
  std::ostringstream key;
  key << bin.key << "@" << static_cast<const void*>(d.mtl_device());
  MTL::Library*& lib = libs[key.str()];
  if (lib == nullptr) {
    if (bin.image.empty()) {
      libs.erase(key.str());
      throw std::runtime_error("[mlx_aot] Metal artifact " + bin.path + " came without its verified bytes");
    }
    // DISPATCH_DATA_DESTRUCTOR_DEFAULT copies the bytes.
    dispatch_data_t data = dispatch_data_create(bin.image.data(), bin.image.size(), nullptr,
                                                DISPATCH_DATA_DESTRUCTOR_DEFAULT);
    NS::Error* error = nullptr;
    lib = d.mtl_device()->newLibrary(data, &error);
    dispatch_release(data);
    if (lib == nullptr) {
      libs.erase(key.str());
      std::string why = error && error->localizedDescription() ? error->localizedDescription()->utf8String() : "?";
      throw std::runtime_error("[mlx_aot] cannot load Metal artifact " + bin.path + ": " + why +
                               "; rebuild it with `python -m build_tools compile --target metal`");
    }
  }
  return lib;
}

}  // namespace

void AotLaunch::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  if (bin_->target != "metal") {
    throw std::runtime_error("[mlx_aot] " + args_.entry + ": artifact " + bin_->path + " is for " + bin_->target +
                             ", not Metal");
  }
  prepare_outputs(inputs, outputs, [](size_t n) { return mx::allocator::malloc(n); });  // unified memory
  auto& d = mx::metal::device(stream().device);
  MTL::Library* lib = library_from_image(d, *bin_);

  mx::metal::MTLFCList constants;
  std::ostringstream hash;
  hash << args_.entry;
  int fc_index = 0;
  for (size_t i = 0; i < args_.scalars.size(); ++i) {
    if (!bin_->specialize[i]) continue;
    auto type = bin_->scalar_types[i] == kFloat32 ? MTL::DataType::DataTypeFloat : MTL::DataType::DataTypeInt;
    constants.emplace_back(&args_.scalars[i], type, fc_index++);
    hash << "_" << std::hex << args_.scalars[i];  // exact bits: 0.1f and 0.10000001f differ
  }
  auto* kernel = d.get_kernel(args_.entry, lib, hash.str(), constants);

  auto& enc = mx::metal::get_command_encoder(stream());
  enc.set_compute_pipeline_state(kernel);
  const auto& input_of = bin_->input_of;
  const auto& output_of = bin_->output_of;
  const int n_buffers = static_cast<int>(bin_->roles.size());
  for (int b = 0; b < n_buffers; ++b) {
    if (output_of[b] >= 0) {
      enc.set_output_array(outputs[output_of[b]], b);
    } else {
      enc.set_input_array(inputs[input_of[b]], b);
    }
  }
  int slot = n_buffers;
  for (size_t i = 0; i < args_.scalars.size(); ++i) {
    if (bin_->specialize[i]) continue;
    enc.set_bytes(args_.scalars[i], slot++);  // 4 bytes: int32 or float32 bit pattern
  }
  // Then one int32[4] per strided buffer, in buffer order (the kernel's `constant int4&`): the
  // element strides of the array as bound, known only now for a lazy input (docs/kernel-abi.md).
  const std::vector<int32_t> strides = launch_strides(*bin_, args_.entry, inputs, outputs);
  for (size_t i = 0; i < strides.size(); i += 4) enc.set_bytes(strides.data() + i, 4, slot++);  // 16 bytes
  if (args_.grid[0] == 0 || args_.grid[1] == 0 || args_.grid[2] == 0) return;
  enc.dispatch_threads(MTL::Size(args_.grid[0], args_.grid[1], args_.grid[2]),
                       MTL::Size(args_.group[0], args_.group[1], args_.group[2]));
}

std::string cuda_device_arch(int) { return ""; }
std::string memory_kind(const mx::array&) { return ""; }
bool built_with_cuda() { return false; }
bool built_with_metal() { return true; }

}  // namespace mlx_aot
