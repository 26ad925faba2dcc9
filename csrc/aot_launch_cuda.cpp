// eval_gpu on MLX's CUDA backend: the cubin/PTX is loaded once per (artifact, device) with the driver
// API, and each launch becomes one kernel node of MLX's CUDA graph. Registering outputs (the pools
// included) before adding the node gives every later reader a graph edge to this kernel.
#include "aot_launch.h"

#include <cuda.h>

#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "mlx/backend/cuda/device.h"

namespace mlx_aot {

namespace {

void check(CUresult r, const std::string& what) {
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    cuGetErrorName(r, &name);
    throw std::runtime_error("[mlx_aot] " + what + " failed: " + (name ? name : std::to_string(r)));
  }
}

CUfunction cuda_function(const KernelBinary& bin, const std::string& entry, int device) {
  static std::mutex mu;
  static std::unordered_map<std::string, CUmodule> modules;   // intentionally never unloaded
  static std::unordered_map<std::string, CUfunction> functions;
  std::lock_guard<std::mutex> lock(mu);
  const std::string mkey = bin.key + "\n" + std::to_string(device);
  const std::string fkey = mkey + "\n" + entry;
  if (auto it = functions.find(fkey); it != functions.end()) return it->second;
  CUmodule& mod = modules[mkey];
  if (mod == nullptr) {
    // The bytes registry/artifacts.py verified, never the file again. std::string keeps a NUL after
    // its last byte, which PTX needs (harmless for a cubin).
    if (bin.image.empty()) {
      modules.erase(mkey);
      throw std::runtime_error("[mlx_aot] CUDA artifact " + bin.path + " came without its verified bytes");
    }
    CUresult r = cuModuleLoadData(&mod, bin.image.c_str());
    if (r != CUDA_SUCCESS) {
      modules.erase(mkey);
      check(r, "cuModuleLoadData(" + bin.path + ")");
    }
  }
  CUfunction fn = nullptr;
  check(cuModuleGetFunction(&fn, mod, entry.c_str()), "cuModuleGetFunction(" + entry + " in " + bin.path + ")");
  functions[fkey] = fn;
  return fn;
}

}  // namespace

void AotLaunch::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  if (bin_->target != "cuda") {
    throw std::runtime_error("[mlx_aot] " + args_.entry + ": artifact " + bin_->path + " is for " + bin_->target +
                             ", not CUDA");
  }
  prepare_outputs(inputs, outputs);
  auto& enc = mx::cu::get_command_encoder(stream());
  enc.device().make_current();
  CUfunction fn = cuda_function(*bin_, args_.entry, enc.device().cuda_device());
  const auto& input_of = bin_->input_of;
  const auto& output_of = bin_->output_of;
  std::vector<void*> ptrs(bin_->roles.size());
  for (size_t b = 0; b < bin_->roles.size(); ++b) {
    if (output_of[b] < 0) {
      enc.set_input_array(inputs[input_of[b]]);
      ptrs[b] = const_cast<void*>(mx::gpu_ptr<void>(inputs[input_of[b]]));
    }
  }
  for (size_t b = 0; b < bin_->roles.size(); ++b) {
    if (output_of[b] >= 0) {
      if (input_of[b] >= 0) enc.set_input_array(inputs[input_of[b]]);  // in-place: read and written
      enc.set_output_array(outputs[output_of[b]]);
      ptrs[b] = mx::gpu_ptr<void>(outputs[output_of[b]]);  // device pointer (data<>() would be host-side)
    }
  }
  std::vector<uint32_t> scalars = args_.scalars;
  std::vector<int32_t> strides = launch_strides(*bin_, args_.entry, inputs, outputs);  // int32[4] each
  std::vector<void*> params(ptrs.size() + scalars.size() + strides.size() / 4);
  for (size_t i = 0; i < ptrs.size(); ++i) params[i] = &ptrs[i];
  for (size_t i = 0; i < scalars.size(); ++i) params[ptrs.size() + i] = &scalars[i];
  for (size_t k = 0; k < strides.size() / 4; ++k) params[ptrs.size() + scalars.size() + k] = &strides[4 * k];
  dim3 block(args_.group[0], args_.group[1], args_.group[2]);
  dim3 grid((args_.grid[0] + block.x - 1) / block.x, (args_.grid[1] + block.y - 1) / block.y,
            (args_.grid[2] + block.z - 1) / block.z);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;  // nothing to do (e.g. zero tokens)
  // The node copies the parameter values when it is added, so the locals may go.
  enc.add_kernel_node_raw(fn, grid, block, dim3(1, 1, 1), 0, params.data());
}

std::string cuda_device_arch(int device) {
  auto& d = mx::cu::device(device);
  return "sm_" + std::to_string(d.compute_capability_major()) + std::to_string(d.compute_capability_minor());
}
bool built_with_cuda() { return true; }
bool built_with_metal() { return false; }

}  // namespace mlx_aot
