// eval_gpu on MLX's CUDA backend: the cubin/PTX is loaded once per (artifact, device) with the driver
// API, and each launch becomes one kernel node of MLX's CUDA graph. Registering outputs (the pools
// included) before adding the node gives every later reader a graph edge to this kernel.
#include "aot_launch.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <deque>
#include <iterator>
#include <list>
#include <map>
#include <mutex>
#include <stdexcept>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mlx/backend/cuda/allocator.h"  // CudaBuffer
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

// Once per (binary, entry, device): loaded_entry keeps what it returns.
CUfunction cuda_function(const KernelBinary& bin, const std::string& entry, int device) {
  static std::mutex mu;
  static std::unordered_map<std::string, CUmodule> modules;   // intentionally never unloaded
  std::lock_guard<std::mutex> lock(mu);
  const std::string mkey = bin.key + "\n" + std::to_string(device);
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
  return fn;
}

// Fresh outputs (the rotated q and k) in device memory, as MLX's own CUDA ops allocate theirs with
// cu::malloc_async, which libmlx does not export. mx::allocator::malloc gives managed memory instead,
// and when its cache hands back a device buffer it first copies it to managed memory with a
// synchronous cudaMemcpy. A freed output goes to a free list per (stream, size) for the next launch on
// that stream, which stream order makes safe (as for MLX's own cache). The list keeps at most
// kCachedBytes and evicts the buffers given back longest ago, so after a large prefill it comes to
// hold the decode sizes instead of keeping the prefill's buffers and missing on every decode output.
// Frees go to a stream of their own, as MLX's allocator's do: a free enqueued on the compute stream
// while MLX captures an op there (cuBLAS, cuDNN) would land in the captured graph, which MLX then
// cannot add as a child node. MLX's memory counters do not see these buffers.
class OutputBuffers {
 public:
  mx::allocator::Data malloc(size_t nbytes, cudaStream_t stream, int device) {
    const size_t size = (nbytes + 255) / 256 * 256;
    mx::cu::CudaBuffer* buf = take(stream, size, device);
    if (buf == nullptr) {
      count_output_buffer(/*malloc=*/true);
      void* p = nullptr;
      cudaError_t e = cudaMallocAsync(&p, size, stream);
      if (e != cudaSuccess) {  // out of memory: give the cached buffers back and try once more
        cudaGetLastError();
        release_all();
        e = cudaMallocAsync(&p, size, stream);
      }
      if (e != cudaSuccess) {
        cudaGetLastError();
        throw std::runtime_error(std::string("[mlx_aot] cannot allocate ") + std::to_string(size) +
                                 " bytes of device memory for a kernel output: " + cudaGetErrorString(e));
      }
      buf = new mx::cu::CudaBuffer{p, size, device};
    }
    return mx::allocator::Data(mx::allocator::Buffer(buf), [this, stream](mx::allocator::Buffer b) {
      give_back(stream, static_cast<mx::cu::CudaBuffer*>(b.ptr()));
    });
  }

 private:
  static constexpr size_t kCachedBytes = size_t{256} << 20;
  using Key = std::pair<cudaStream_t, size_t>;
  struct Cached {
    Key key;
    mx::cu::CudaBuffer* buf;
  };
  using Age = std::list<Cached>::iterator;

  // Under mu_, on the thread that launches, with the device current (the first launch on each device).
  void make_free_stream(int device) {
    if (free_streams_.count(device)) return;
    cudaStream_t s = nullptr;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(std::string("[mlx_aot] cannot create a CUDA stream for freeing kernel outputs: ") +
                               cudaGetErrorString(e));
    }
    free_streams_[device] = s;
  }

  // Under mu_. Every buffer's device got its stream when the buffer was allocated.
  void free_device_buffer(mx::cu::CudaBuffer* buf) {
    count_output_buffer(/*malloc=*/false);
    auto it = free_streams_.find(buf->device);
    it != free_streams_.end() ? cudaFreeAsync(buf->data, it->second) : cudaFree(buf->data);
    cudaGetLastError();
    delete buf;
  }

  // Under mu_: takes the newest or the oldest entry of a key out of its list and of the age order;
  // returns its buffer.
  mx::cu::CudaBuffer* unlink(std::map<Key, std::deque<Age>>::iterator it, bool newest) {
    auto& same = it->second;
    const Age entry = newest ? same.back() : same.front();
    newest ? same.pop_back() : same.pop_front();
    mx::cu::CudaBuffer* buf = entry->buf;
    if (same.empty()) free_.erase(it);
    by_age_.erase(entry);
    cached_ -= buf->size;
    return buf;
  }

  // A cached buffer of `size` for `stream` (the one given back last), or nullptr; first makes the
  // device's free stream, under the same lock (one per launch output).
  mx::cu::CudaBuffer* take(cudaStream_t stream, size_t size, int device) {
    std::lock_guard<std::mutex> lock(mu_);
    make_free_stream(device);
    auto it = free_.find({stream, size});
    if (it == free_.end()) return nullptr;
    return unlink(it, /*newest=*/true);
  }

  // Runs wherever MLX drops the array's data (often its completion thread): never throws.
  void give_back(cudaStream_t stream, mx::cu::CudaBuffer* buf) {
    if (buf->device < 0) {  // a host read moved it to managed memory (MLX's Buffer::raw_ptr)
      cudaPointerAttributes attr{};
      bool host = cudaPointerGetAttributes(&attr, buf->data) == cudaSuccess && attr.type == cudaMemoryTypeHost;
      host ? cudaFreeHost(buf->data) : cudaFree(buf->data);
      cudaGetLastError();
      delete buf;
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (buf->size > kCachedBytes) {
      free_device_buffer(buf);
      return;
    }
    while (cached_ + buf->size > kCachedBytes) {  // evict the oldest first
      // The oldest entry of all is the oldest of its key.
      free_device_buffer(unlink(free_.find(by_age_.front().key), /*newest=*/false));
    }
    const Key key{stream, buf->size};
    by_age_.push_back({key, buf});
    free_[key].push_back(std::prev(by_age_.end()));
    cached_ += buf->size;
  }

  void release_all() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& entry : by_age_) free_device_buffer(entry.buf);
    by_age_.clear();
    free_.clear();
    cached_ = 0;
  }

  std::mutex mu_;
  std::list<Cached> by_age_;                   // every cached buffer, given back longest ago first
  std::map<Key, std::deque<Age>> free_;        // the same entries per key, in the same order
  std::map<int, cudaStream_t> free_streams_;   // per device; intentionally never destroyed
  size_t cached_ = 0;
};

// Intentionally leaked: arrays freed at process exit still give their buffers back here.
OutputBuffers& output_buffers() {
  static auto* buffers = new OutputBuffers();
  return *buffers;
}

}  // namespace

void AotLaunch::eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  if (bin_->target != "cuda") {
    throw std::runtime_error("[mlx_aot] " + args_.entry + ": artifact " + bin_->path + " is for " + bin_->target +
                             ", not CUDA");
  }
  auto& enc = mx::cu::get_command_encoder(stream());
  enc.device().make_current();
  prepare_outputs(inputs, outputs, [&enc](size_t n) {
    return output_buffers().malloc(n, enc.stream(), enc.device().cuda_device());
  });
  const int device = enc.device().cuda_device();
  auto load = [&] { return static_cast<void*>(cuda_function(*bin_, args_.entry, device)); };
  auto fn = static_cast<CUfunction>(loaded_entry(*bin_, args_.entry, device, load));
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
std::string memory_kind(const mx::array& a) {
  if (a.status() == mx::array::Status::unscheduled || a.data_shared_ptr() == nullptr || a.buffer().ptr() == nullptr)
    throw std::invalid_argument("memory_kind: the array has no buffer yet; evaluate it first");
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, mx::gpu_ptr<void>(a)) != cudaSuccess) {
    cudaGetLastError();
    return "host";  // memory CUDA does not know: pageable host memory
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice: return "device";
    case cudaMemoryTypeManaged: return "managed";
    default: return "host";
  }
}
bool built_with_cuda() { return true; }
bool built_with_metal() { return false; }

}  // namespace mlx_aot
