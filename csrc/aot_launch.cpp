// Backend-independent part of the AOT launcher, and its CPU evaluation.
#include "aot_launch.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"

namespace mlx_aot {

void index_buffers(KernelBinary& bin) {
  bin.input_of.assign(bin.roles.size(), -1);
  bin.output_of.assign(bin.roles.size(), -1);
  int ni = 0, no = 0;
  for (size_t b = 0; b < bin.roles.size(); ++b) {
    if (bin.roles[b] == kInput || bin.roles[b] == kInplace) bin.input_of[b] = ni++;
    if (bin.roles[b] == kOutput || bin.roles[b] == kInplace) bin.output_of[b] = no++;
  }
  bin.n_inputs = ni;
  bin.n_outputs = no;
}

std::vector<mx::Shape> AotLaunch::output_shapes(const std::vector<mx::array>& inputs) {
  const auto& input_of = bin_->input_of;
  const auto& output_of = bin_->output_of;
  std::vector<mx::Shape> shapes;
  for (size_t b = 0; b < bin_->roles.size(); ++b) {
    if (bin_->roles[b] == kOutput) shapes.push_back(inputs[input_of[bin_->like[b]]].shape());
    if (bin_->roles[b] == kInplace) shapes.push_back(inputs[input_of[b]].shape());
  }
  return shapes;
}

bool AotLaunch::is_equivalent(const mx::Primitive& other) const {
  const auto& o = static_cast<const AotLaunch&>(other);
  // Scalars compare as raw bits: two launches are the same only if every constant is identical.
  return bin_->key == o.bin_->key && bin_->path == o.bin_->path && args_.entry == o.args_.entry &&
         args_.scalars == o.args_.scalars && args_.grid == o.args_.grid && args_.group == o.args_.group;
}

void AotLaunch::prepare_outputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  const auto& input_of = bin_->input_of;
  const auto& output_of = bin_->output_of;
  for (size_t b = 0; b < bin_->roles.size(); ++b) {
    if (bin_->roles[b] == kOutput) {
      auto& out = outputs[output_of[b]];
      out.set_data(mx::allocator::malloc(out.nbytes()));
    } else if (bin_->roles[b] == kInplace) {
      const auto& in = inputs[input_of[b]];
      if (!in.flags().row_contiguous) {
        std::ostringstream msg;
        msg << "[mlx_aot] in-place buffer " << b << " of " << args_.entry
            << " is not row-contiguous at evaluation time; pass a contiguous array (e.g. mx.contiguous(pool))";
        throw std::invalid_argument(msg.str());
      }
      // The deliberate alias: the output *is* the pool buffer, registered as an output below so that
      // MLX orders every later reader after this kernel.
      outputs[output_of[b]].copy_shared_buffer(in);
    }
  }
}

// ----------------------------------------------------------------------------- launch (op level)

std::vector<mx::array> launch(std::shared_ptr<const KernelBinary> bin, std::shared_ptr<const LaunchArgs> args,
                              std::vector<mx::array> inputs, mx::StreamOrDevice s) {
  if (static_cast<int>(inputs.size()) != bin->n_inputs) {
    throw std::invalid_argument("[mlx_aot] " + args->entry + ": expected " + std::to_string(bin->n_inputs) +
                                " input arrays, got " + std::to_string(inputs.size()));
  }
  if (args->scalars.size() != bin->scalar_types.size()) {
    throw std::invalid_argument("[mlx_aot] " + args->entry + ": expected " +
                                std::to_string(bin->scalar_types.size()) + " scalars, got " +
                                std::to_string(args->scalars.size()));
  }
  const auto& input_of = bin->input_of;
  for (size_t b = 0; b < bin->roles.size(); ++b) {
    if (input_of[b] < 0) continue;
    auto& a = inputs[input_of[b]];
    if (bin->roles[b] == kInplace) {
      // Aliasing is safe only when this array is the buffer's sole owner. An evaluated array that
      // shares its buffer (a view such as pool[:n], or another alias) would see the writes: write
      // into a real copy instead. (mx::copy shares buffers; x * 1 is an exact, materialised copy.)
      if (a.is_available() && (!a.flags().row_contiguous || a.data_shared_ptr().use_count() > 1)) {
        a = mx::multiply(a, mx::array(1, a.dtype()), s);
      } else if (!a.is_available()) {
        a = mx::contiguous(a, false, s);
      }
    } else if (!a.is_available() || !a.flags().row_contiguous) {
      a = mx::contiguous(a, false, s);  // shares the buffer when already row-contiguous
    }
  }
  std::vector<mx::Shape> shapes;
  std::vector<mx::Dtype> dtypes;
  for (size_t b = 0; b < bin->roles.size(); ++b) {
    if (bin->roles[b] == kOutput) {
      const auto& src = inputs[input_of[bin->like[b]]];
      shapes.push_back(src.shape());
      dtypes.push_back(src.dtype());
    } else if (bin->roles[b] == kInplace) {
      shapes.push_back(inputs[input_of[b]].shape());
      dtypes.push_back(inputs[input_of[b]].dtype());
    }
  }
  auto stream = mx::to_stream(s);
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<AotLaunch>(stream, std::move(bin), std::move(args)),
                                std::move(inputs));
}

// ----------------------------------------------------------------------------- CPU

namespace {

using CpuEntry = void (*)(void**);

CpuEntry cpu_entry(const std::string& path, const std::string& entry) {
  static std::mutex mu;
  static std::unordered_map<std::string, void*> libs;
  static std::unordered_map<std::string, CpuEntry> fns;
  std::lock_guard<std::mutex> lock(mu);
  const std::string key = path + "\n" + entry;
  auto it = fns.find(key);
  if (it != fns.end()) return it->second;
  void*& lib = libs[path];
  if (lib == nullptr) {
    lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* err = dlerror();
      libs.erase(path);
      throw std::runtime_error("[mlx_aot] cannot load CPU artifact " + path + ": " + (err ? err : "?") +
                               "; rebuild it with `python -m build_tools compile --target cpu`");
    }
  }
  auto fn = reinterpret_cast<CpuEntry>(dlsym(lib, entry.c_str()));
  if (fn == nullptr) {
    throw std::runtime_error("[mlx_aot] " + path + " has no entry " + entry);
  }
  fns[key] = fn;
  return fn;
}

}  // namespace

void AotLaunch::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  if (bin_->target != "cpu") {
    throw std::runtime_error("[mlx_aot] " + args_.entry + ": artifact " + bin_->path + " is for " + bin_->target +
                             ", not the CPU");
  }
  prepare_outputs(inputs, outputs);
  auto& enc = mx::cpu::get_command_encoder(stream());
  const auto& input_of = bin_->input_of;
  const auto& output_of = bin_->output_of;
  std::vector<void*> ptrs(bin_->roles.size());
  for (size_t b = 0; b < bin_->roles.size(); ++b) {
    if (output_of[b] >= 0) {
      enc.set_output_array(outputs[output_of[b]]);
      ptrs[b] = outputs[output_of[b]].data<void>();
    } else {
      enc.set_input_array(inputs[input_of[b]]);
      ptrs[b] = const_cast<void*>(inputs[input_of[b]].data<void>());
    }
  }
  CpuEntry fn = cpu_entry(bin_->path, args_.entry);
  // The task owns copies of the pointers and scalars; MLX's CPU eval keeps the input buffers alive
  // until the task has run.
  enc.dispatch([fn, ptrs = std::move(ptrs), scalars = args_.scalars]() mutable {
    std::vector<void*> argv(ptrs.size() + scalars.size());
    for (size_t i = 0; i < ptrs.size(); ++i) argv[i] = &ptrs[i];
    for (size_t i = 0; i < scalars.size(); ++i) argv[ptrs.size() + i] = &scalars[i];
    fn(argv.data());
  });
}

}  // namespace mlx_aot
