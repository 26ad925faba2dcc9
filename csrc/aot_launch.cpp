// Backend-independent part of the AOT launcher, and its CPU evaluation.
#include "aot_launch.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cerrno>
#include <cstdlib>
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

void* loaded_entry(const KernelBinary& bin, const std::string& entry, int device, const std::function<void*()>& load) {
  std::lock_guard<std::mutex> lock(bin.loaded_mu);
  for (const auto& l : bin.loaded) {
    if (l.device == device && l.entry == entry) return l.fn;
  }
  void* fn = load();  // throws on failure: nothing is kept
  bin.loaded.push_back({entry, device, fn});
  return fn;
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

void AotLaunch::prepare_outputs(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs,
                                const std::function<mx::allocator::Data(size_t)>& alloc) {
  const auto& input_of = bin_->input_of;
  const auto& output_of = bin_->output_of;
  for (size_t b = 0; b < bin_->roles.size(); ++b) {
    if (bin_->roles[b] == kOutput) {
      auto& out = outputs[output_of[b]];
      out.set_data(alloc(out.nbytes()));
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
      record_inplace_write(in);
    }
  }
}

// ----------------------------------------------------------------------------- strided buffers

std::array<int32_t, 4> kernel_strides(const mx::array& a, const std::string& entry, int buffer) {
  if (a.ndim() > 4) {
    throw std::invalid_argument("[mlx_aot] " + entry + ": strided buffer " + std::to_string(buffer) + " has " +
                                std::to_string(a.ndim()) + " dimensions; at most 4");
  }
  std::array<int32_t, 4> out{0, 0, 0, 0};
  const auto& st = a.strides();
  const size_t lead = 4 - st.size();
  for (size_t i = 0; i < st.size(); ++i) {
    if (st[i] > INT32_MAX || st[i] < INT32_MIN) {
      throw std::invalid_argument("[mlx_aot] " + entry + ": strided buffer " + std::to_string(buffer) +
                                  " has a stride of " + std::to_string(st[i]) +
                                  " elements, beyond int32; pass a smaller or contiguous array");
    }
    out[lead + i] = static_cast<int32_t>(st[i]);
  }
  return out;
}

std::vector<int32_t> launch_strides(const KernelBinary& bin, const std::string& entry,
                                    const std::vector<mx::array>& inputs, const std::vector<mx::array>& outputs) {
  std::vector<int32_t> all;
  for (size_t b = 0; b < bin.roles.size(); ++b) {
    if (!bin.strided[b]) continue;
    const mx::array& a = bin.output_of[b] >= 0 ? outputs[bin.output_of[b]] : inputs[bin.input_of[b]];
    auto s = kernel_strides(a, entry, static_cast<int>(b));
    all.insert(all.end(), s.begin(), s.end());
  }
  return all;
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

// A lazy 1-D array made by mx.contiguous is row-contiguous once computed (in 1-D col-major is
// row-major), so it goes as it is rather than through a second Contiguous node per launch: the
// integrations' per-step index arrays (registry.native.device_indices), shared by every layer.
static bool dense_by_construction(const mx::array& a) {
  return !a.is_available() && a.ndim() <= 1 && is_primitive(a, "Contiguous");
}

std::vector<mx::array> launch(std::shared_ptr<const KernelBinary> bin, std::shared_ptr<const LaunchArgs> args,
                              std::vector<mx::array> inputs, mx::StreamOrDevice s, std::vector<Copied>* copied) {
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
  if (!args->input_shapes.empty()) {
    if (args->input_shapes.size() != inputs.size()) {
      throw std::invalid_argument("[mlx_aot] " + entry + ": the plan has shapes for " +
                                  std::to_string(args->input_shapes.size()) + " inputs, got " +
                                  std::to_string(inputs.size()));
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      const auto& want = args->input_shapes[i];
      const auto& got = inputs[i].shape();
      if (!std::equal(want.begin(), want.end(), got.begin(), got.end())) {
        auto str = [](const auto& v) {
          std::string s;
          for (size_t j = 0; j < v.size(); ++j) s += (j ? "x" : "") + std::to_string(v[j]);
          return s.empty() ? std::string("scalar") : s;
        };
        throw std::invalid_argument("[mlx_aot] " + entry + ": input " + std::to_string(i) + " has shape " + str(got) +
                                    ", the plan was made for " + str(want) + "; make a plan for these shapes");
      }
    }
  }
  // Decide every in-place input on the arrays as passed, before any is replaced by a guard.
  std::vector<bool> alias(inputs.size(), false);
  int n_alias = 0, n_copy = 0;
  for (size_t b = 0; b < bin->roles.size(); ++b) {
    if (bin->roles[b] != kInplace) continue;
    InplaceDecision d = decide_inplace(inputs, input_of[b], s);
    alias[input_of[b]] = d.alias;
    d.alias ? ++n_alias : ++n_copy;
    if (!d.alias && copied) copied->push_back({static_cast<int>(b), d.reason});
  }
  count_launch(n_alias, n_copy);
  for (size_t b = 0; b < bin->roles.size(); ++b) {
    if (input_of[b] < 0) continue;
    auto& a = inputs[input_of[b]];
    if (bin->roles[b] == kInplace) {
      if (!alias[input_of[b]]) a = cow_guard(a, s);
    } else if (!bin->strided[b] && !dense_by_construction(a) && (!a.is_available() || !a.flags().row_contiguous)) {
      a = mx::contiguous(a, false, s);  // shares the buffer when already row-contiguous
    }  // a strided buffer goes as it is: its kernel reads it through the strides passed at eval
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

bool write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// dlopen the verified bytes, not the artifact file: they go to an anonymous memfd (Linux) or, where
// that is missing or not executable, a private mkstemp file unlinked once loaded. A memfd stays open
// for the life of the process, so its /proc/self/fd name is never reused for other bytes (dlopen
// returns an already loaded library of the same name); a temp file's name carries the content key,
// so a reused name can only ever mean the same bytes.
void* dlopen_image(const KernelBinary& bin, std::string& error) {
  error.clear();
#ifdef __linux__
  int mfd = -1;
#ifdef MFD_EXEC
  mfd = memfd_create("mlx_aot", MFD_CLOEXEC | MFD_EXEC);  // vm.memfd_noexec=1 wants exec spelt out
#endif
  if (mfd < 0) mfd = memfd_create("mlx_aot", MFD_CLOEXEC);
  if (mfd >= 0) {
    if (write_all(mfd, bin.image)) {
      const std::string name = "/proc/self/fd/" + std::to_string(mfd);
      if (void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) return lib;  // mfd intentionally kept
      const char* err = dlerror();
      error = std::string("memfd: ") + (err ? err : "?") + "; ";
    }
    ::close(mfd);
  }
#endif
  std::string safe_key = bin.key;
  for (char& c : safe_key) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string name = std::string(tmp && *tmp ? tmp : "/tmp") + "/" + safe_key.substr(0, 120) + "_XXXXXX";
  int fd = mkstemp(name.data());
  if (fd < 0) {
    error += "cannot create a temp file in " + name + ": " + std::strerror(errno);
    return nullptr;
  }
  void* lib = nullptr;
  if (write_all(fd, bin.image) && ::fsync(fd) == 0) {
    lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* err = dlerror();
      error += err ? err : "?";
    }
  } else {
    error += "cannot write " + name + ": " + std::strerror(errno);
  }
  ::unlink(name.c_str());
  ::close(fd);
  return lib;
}

// Once per (binary, entry): loaded_entry keeps what it returns.
CpuEntry cpu_entry(const KernelBinary& bin, const std::string& entry) {
  static std::mutex mu;
  static std::unordered_map<std::string, void*> libs;  // by content key; intentionally never closed
  std::lock_guard<std::mutex> lock(mu);
  void*& lib = libs[bin.key];
  if (lib == nullptr) {
    std::string err;
    lib = bin.image.empty() ? nullptr : dlopen_image(bin, err);
    if (lib == nullptr) {
      libs.erase(bin.key);
      throw std::runtime_error("[mlx_aot] cannot load CPU artifact " + bin.path + " from its verified bytes: " +
                               (bin.image.empty() ? std::string("no bytes") : err) +
                               "; rebuild it with `python -m build_tools compile --target cpu`");
    }
  }
  auto fn = reinterpret_cast<CpuEntry>(dlsym(lib, entry.c_str()));
  if (fn == nullptr) {
    throw std::runtime_error("[mlx_aot] " + bin.path + " has no entry " + entry);
  }
  return fn;
}

}  // namespace

void AotLaunch::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  if (bin_->target != "cpu") {
    throw std::runtime_error("[mlx_aot] " + args_.entry + ": artifact " + bin_->path + " is for " + bin_->target +
                             ", not the CPU");
  }
  prepare_outputs(inputs, outputs, [](size_t n) { return mx::allocator::malloc(n); });
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
  auto fn = reinterpret_cast<CpuEntry>(
      loaded_entry(*bin_, args_.entry, -1, [this] { return reinterpret_cast<void*>(cpu_entry(*bin_, args_.entry)); }));
  std::vector<int32_t> strides = launch_strides(*bin_, args_.entry, inputs, outputs);
  // The task owns copies of the pointers, scalars and strides; MLX's CPU eval keeps the input
  // buffers alive until the task has run.
  enc.dispatch([fn, ptrs = std::move(ptrs), scalars = args_.scalars, strides = std::move(strides)]() mutable {
    std::vector<void*> argv(ptrs.size() + scalars.size() + strides.size() / 4);
    for (size_t i = 0; i < ptrs.size(); ++i) argv[i] = &ptrs[i];
    for (size_t i = 0; i < scalars.size(); ++i) argv[ptrs.size() + i] = &scalars[i];
    for (size_t k = 0; k < strides.size() / 4; ++k) argv[ptrs.size() + scalars.size() + k] = &strides[4 * k];
    fn(argv.data());
  });
}

}  // namespace mlx_aot
