// Backend-independent part of the AOT launcher, and its CPU evaluation.
#include "aot_launch.h"

#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <typeinfo>
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
         args_.dtype == o.args_.dtype &&
         args_.scalars == o.args_.scalars && args_.grid == o.args_.grid && args_.group == o.args_.group;
}

// ----------------------------------------------------------------------------- pool lineage

namespace {

// Every buffer this launcher has aliased, mapped to the array that was its in-place input the last
// time. Between two launches on one pool, that previous input may still be alive: the caller may
// hold it (the documented contract: it shares storage with the returned pool) and MLX keeps a
// launch's inputs until its work has run. Holding it here too makes that owner permanent, so the
// buffer's owner count is predictable: the pool + its previous input, + 1 per view. An entry whose
// pool its user dropped (the entry is the last owner) is released at the next launch.
// Intentionally leaked: at process exit its arrays must not be freed after MLX's allocator is gone.
std::mutex pools_mu;
auto& pools = *new std::unordered_map<const mx::allocator::Data*, mx::array>();

void prune_pools_locked() {
  for (auto it = pools.begin(); it != pools.end();) {
    it = it->second.data_shared_ptr().use_count() == 1 ? pools.erase(it) : std::next(it);
  }
}

}  // namespace

void remember_pool(const mx::array& in) {
  std::lock_guard<std::mutex> lock(pools_mu);
  pools.insert_or_assign(in.data_shared_ptr().get(), in);
}

bool computed_pool_alias_ok(const mx::array& a) {
  const auto& data = a.data_shared_ptr();
  std::lock_guard<std::mutex> lock(pools_mu);
  prune_pools_locked();
  auto it = pools.find(data.get());
  const bool lineage = it != pools.end();
  if (!a.is_available()) {
    // Still running (async_eval): MLX holds references to the buffer for the work in flight, which
    // cannot be told from views. A pool this launcher wrote before is trusted (the contract); any
    // other buffer is left to copy-on-write.
    return lineage;
  }
  if (data.use_count() <= (lineage ? 2 : 1)) return true;
  // Another owner: a view, an alias, or a reference MLX has not released yet. Copy-on-write decides
  // when the graph runs, exactly; forgetting the entry lets it take the buffer by donation if by then
  // nothing else holds it.
  if (lineage) pools.erase(it);
  return false;
}

size_t release_retired_pools() {
  std::lock_guard<std::mutex> lock(pools_mu);
  prune_pools_locked();
  return pools.size();
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
        // launch() aliases only row-contiguous arrays and guards the rest; this is the last line of defence.
        msg << "[mlx_aot] internal error: in-place buffer " << b << " of " << args_.entry
            << " is not row-contiguous at evaluation time";
        throw std::invalid_argument(msg.str());
      }
      // The deliberate alias: the output *is* the pool buffer, registered as an output below so that
      // MLX orders every later reader after this kernel.
      outputs[output_of[b]].copy_shared_buffer(in);
      remember_pool(in);
    }
  }
}

// ----------------------------------------------------------------------------- launch (op level)

const char* dtype_name(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return "bool";
    case mx::Dtype::Val::uint8: return "uint8";
    case mx::Dtype::Val::uint16: return "uint16";
    case mx::Dtype::Val::uint32: return "uint32";
    case mx::Dtype::Val::uint64: return "uint64";
    case mx::Dtype::Val::int8: return "int8";
    case mx::Dtype::Val::int16: return "int16";
    case mx::Dtype::Val::int32: return "int32";
    case mx::Dtype::Val::int64: return "int64";
    case mx::Dtype::Val::float16: return "float16";
    case mx::Dtype::Val::float32: return "float32";
    case mx::Dtype::Val::float64: return "float64";
    case mx::Dtype::Val::bfloat16: return "bfloat16";
    case mx::Dtype::Val::complex64: return "complex64";
  }
  return "?";
}

mx::array cow_guard(const mx::array& a, mx::StreamOrDevice s) {
  if (a.ndim() == 0 || a.size() == 0) return mx::contiguous(a, false, s);  // nothing the kernel can write
  // Zero indices along axis 0; updates of shape [0, 1, rest...]. Scatter::eval copies (or takes by
  // donation) its input and returns before its update kernel when there are no updates, on every
  // backend; the copy is bitwise and row-contiguous.
  mx::Shape upd_shape{0, 1};
  upd_shape.insert(upd_shape.end(), a.shape().begin() + 1, a.shape().end());
  mx::array idx(std::initializer_list<int32_t>{}, mx::int32);
  mx::array upd = mx::zeros(upd_shape, a.dtype(), s);
  return mx::scatter(a, {idx}, upd, {0}, s);
}

bool inplace_alias_ok(const std::vector<mx::array>& inputs, int i) {
  const mx::array& a = inputs[i];
  for (size_t j = 0; j < inputs.size(); ++j) {
    if (static_cast<int>(j) != i && inputs[j].id() == a.id()) return false;  // passed twice: two writers
  }
  if (a.status() == mx::array::Status::unscheduled) {
    // Not computed yet, so its buffer is unknown. The returned pool of an earlier launch (an engine
    // that evaluates once per several steps) will be that launch's in-place buffer: alias it, as the
    // evaluated case below would. Any other lazy array (a fresh mx.zeros, a lazy slice or view of
    // another array) goes through copy-on-write, which MLX resolves when it runs.
    if (!a.has_primitive() || typeid(a.primitive()) != typeid(AotLaunch)) return false;
    const auto& producer = static_cast<const AotLaunch&>(a.primitive()).binary();
    for (size_t b = 0; b < producer.roles.size(); ++b) {
      if (producer.output_of[b] == a.sibling_position()) return producer.roles[b] == kInplace;
    }
    return false;
  }
  // Computed: alias only a row-contiguous buffer that no other array shares (computed_pool_alias_ok).
  return a.flags().row_contiguous && computed_pool_alias_ok(a);
}

std::vector<mx::array> launch(std::shared_ptr<const KernelBinary> bin, std::shared_ptr<const LaunchArgs> args,
                              std::vector<mx::array> inputs, mx::StreamOrDevice s) {
  const std::string& entry = args->entry;
  if (static_cast<int>(inputs.size()) != bin->n_inputs) {
    throw std::invalid_argument("[mlx_aot] " + entry + ": expected " + std::to_string(bin->n_inputs) +
                                " input arrays, got " + std::to_string(inputs.size()));
  }
  if (args->scalars.size() != bin->scalar_types.size()) {
    throw std::invalid_argument("[mlx_aot] " + entry + ": expected " + std::to_string(bin->scalar_types.size()) +
                                " scalars, got " + std::to_string(args->scalars.size()));
  }
  const auto& input_of = bin->input_of;
  if (args->buffer_dtypes.size() != bin->roles.size()) {
    throw std::invalid_argument("[mlx_aot] " + entry + ": expected " + std::to_string(bin->roles.size()) +
                                " buffer dtypes, got " + std::to_string(args->buffer_dtypes.size()));
  }
  // The kernel indexes raw memory with the element size of its entry: a wrong dtype would read or
  // write out of bounds, so it is an error, never a conversion.
  for (size_t b = 0; b < bin->roles.size(); ++b) {
    if (input_of[b] < 0) continue;
    const std::string& want = args->buffer_dtypes[b];
    const char* got = dtype_name(inputs[input_of[b]].dtype());
    if (want != got) {
      throw std::invalid_argument("[mlx_aot] " + entry + ": buffer " + std::to_string(b) + " has dtype " + got +
                                  ", the entry expects " + want);
    }
  }
  // Decide every in-place input on the arrays as passed, before any is replaced by a guard.
  std::vector<bool> alias(inputs.size(), false);
  for (size_t b = 0; b < bin->roles.size(); ++b) {
    if (bin->roles[b] == kInplace) alias[input_of[b]] = inplace_alias_ok(inputs, input_of[b]);
  }
  for (size_t b = 0; b < bin->roles.size(); ++b) {
    if (input_of[b] < 0) continue;
    auto& a = inputs[input_of[b]];
    if (bin->roles[b] == kInplace) {
      if (!alias[input_of[b]]) a = cow_guard(a, s);
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
