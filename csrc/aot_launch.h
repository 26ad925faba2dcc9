// The generic AOT launcher: one MLX primitive that runs a named entry function of a compiled
// artifact (cubin/PTX on CUDA, metallib on Metal, shared library on CPU) with the argument layout
// of a kernels.yaml signature (docs/kernel-abi.md). Nothing here names a kernel.
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

namespace mlx_aot {

namespace mx = mlx::core;

enum Role : int { kInput = 0, kOutput = 1, kInplace = 2 };
enum ScalarType : int { kInt32 = 0, kFloat32 = 1 };

// What does not change between calls of one kernel on one artifact.
struct KernelBinary {
  std::string key;                 // unique per artifact (kernel name + content sha): library/module cache key
  std::string path;                // the artifact file, for messages only: it is never read here
  std::string image;               // the artifact's bytes, verified by registry/artifacts.py; what is loaded
  std::string target;              // "cpu" | "cuda" | "metal"
  std::vector<int> roles;          // per buffer, signature order
  std::vector<int> like;           // per buffer: outputs -> buffer index giving shape/dtype, else -1
  std::vector<int> strided;        // per buffer: 1 = `strided: true` (taken as is; strides passed at eval)
  std::vector<int> scalar_types;   // per scalar
  std::vector<int> specialize;     // per scalar: 1 = Metal function constant
  int n_inputs = 0;                // buffers with role input or inplace
  int n_outputs = 0;               // buffers with role output or inplace
  std::vector<int> input_of;       // per buffer: index among the primitive's inputs, or -1
  std::vector<int> output_of;      // per buffer: index among the primitive's outputs, or -1

  // Entry points loaded from this binary, per (entry, device): see loaded_entry.
  struct Loaded {
    std::string entry;
    int device;
    void* fn;
  };
  mutable std::mutex loaded_mu;
  mutable std::vector<Loaded> loaded;
};

// The function of `entry` on `device` (a CUfunction, a CPU entry point): `load()` on first use, then
// kept with the binary, so a launch neither builds a key string nor searches a global map.
void* loaded_entry(const KernelBinary& bin, const std::string& entry, int device, const std::function<void*()>& load);

// Whether `a` is lazy with the MLX primitive of this name: by name, since libmlx exports no
// typeinfo for its primitives (the checks that take a lazy array as it is, by how it is made).
inline bool is_primitive(const mx::array& a, const char* name) {
  return a.has_primitive() && std::strcmp(a.primitive().name(), name) == 0;
}

// Per call: entry symbol (per dtype), scalar values (raw 32-bit patterns) and launch geometry.
struct LaunchArgs {
  std::string entry;
  std::string dtype;               // the entry's key: "<act>" or "<act>/<pool>" (kernels.yaml entries)
  std::vector<uint32_t> scalars;
  std::array<int, 3> grid{1, 1, 1};   // threads per axis
  std::array<int, 3> group{1, 1, 1};  // threads per threadgroup / block
  std::vector<std::string> buffer_dtypes;  // per buffer: the dtype the entry expects (from its key)
  // Per input array (launch order): the shape the plan's scalars and geometry were computed for;
  // empty = not checked. A plan launched on other shapes would index out of bounds.
  std::vector<std::vector<int>> input_shapes;
};

class AotLaunch : public mx::Primitive {
 public:
  AotLaunch(mx::Stream stream, std::shared_ptr<const KernelBinary> bin, std::shared_ptr<const LaunchArgs> args)
      : mx::Primitive(stream), bin_(std::move(bin)), args_ptr_(std::move(args)), args_(*args_ptr_) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "AotLaunch"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

  const KernelBinary& binary() const { return *bin_; }
  const LaunchArgs& launch_args() const { return args_; }

 private:
  // Outputs get their buffers: fresh allocations from `alloc` (the backend's allocator for its
  // kernels' outputs), or the aliased input's buffer for in-place roles.
  void prepare_outputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                       const std::function<mx::allocator::Data(size_t)>& alloc);
  std::shared_ptr<const KernelBinary> bin_;
  std::shared_ptr<const LaunchArgs> args_ptr_;  // shared by every launch of one plan
  const LaunchArgs& args_;
};

// An in-place input the launch may not write where it lies goes through a copy-on-write guard;
// `copied` (optional) receives (buffer index, why) for each.
struct Copied {
  int buffer;
  std::string reason;
};

// Build the lazy launch: validates counts and dtypes, makes inputs row-contiguous, and gives every
// in-place input either its own buffer (aliased, see decide_inplace) or a copy-on-write guard
// (cow_guard). `inputs` holds one copy of each array the caller passes, and the caller holds one
// handle of its own (its mx.array object): decide_inplace counts on exactly that. Returns the
// outputs in signature order.
std::vector<mx::array> launch(std::shared_ptr<const KernelBinary> bin, std::shared_ptr<const LaunchArgs> args,
                              std::vector<mx::array> inputs, mx::StreamOrDevice s = {},
                              std::vector<Copied>* copied = nullptr);

// The in-place policy (inplace.cpp; docs/native.md): may in-place input i be written where it lies?
struct InplaceDecision {
  bool alias;
  const char* reason;  // why not, when !alias
};
InplaceDecision decide_inplace(const std::vector<mx::array>& inputs, int i, mx::StreamOrDevice s);
// At evaluation: the pool buffer is now the launcher's (later calls need no first-use check).
void record_inplace_write(const mx::array& pool);
void count_launch(int aliased, int copies);
// A fresh output allocated on the device (malloc) or a device buffer of one freed: the CUDA
// launcher's free list missed or evicted (aot_launch_cuda.cpp).
void count_output_buffer(bool malloc);
struct InplaceStats {
  uint64_t launches, aliased, copies, first_use_checks, syncs, output_mallocs, output_frees;
  size_t owned_pools;  // live buffers the launcher has written in place
};
InplaceStats inplace_stats();
void reset_inplace_stats();
// (descriptor owners, buffer owners or -1 when not computed): for probes and tests.
std::pair<long, long> owner_counts(const mx::array& a);

// MLX's copy-on-write for an in-place input that is not provably exclusive: a scatter of zero rows.
// When it runs, MLX hands it the input's buffer if nothing else can still read the input (no
// pending reader, view or live handle: array::is_donatable), else it copies the input into a fresh
// row-contiguous buffer. Either way the result is a buffer that only the launch sees.
mx::array cow_guard(const mx::array& a, mx::StreamOrDevice s);

// "float16", "int32", ... (MLX's own dtype_to_string is not exported from libmlx).
const char* dtype_name(mx::Dtype d);

// The int32[4] a strided buffer's kernel receives (docs/kernel-abi.md, "Strided buffers"): the
// array's element strides right-aligned, leading ones 0. Throws when a stride exceeds int32 or the
// array has more than 4 dimensions.
std::array<int32_t, 4> kernel_strides(const mx::array& a, const std::string& entry, int buffer);
// The strides of every strided buffer of a launch, in buffer order, flattened.
std::vector<int32_t> launch_strides(const KernelBinary& bin, const std::string& entry,
                                    const std::vector<mx::array>& inputs, const std::vector<mx::array>& outputs);

// Fill n_inputs/n_outputs and the buffer -> input/output index maps from the roles (once, at load).
void index_buffers(KernelBinary& bin);

// Device compute capability as "sm_XY" for CUDA builds, "" elsewhere.
std::string cuda_device_arch(int device);
// Where an evaluated array's buffer lives on CUDA: "device", "managed" or "host" ("" in other builds).
std::string memory_kind(const mx::array& a);
bool built_with_cuda();
bool built_with_metal();

}  // namespace mlx_aot
