// registry._ext: the Python face of the generic launcher (registry/native.py builds on it).
#include <nanobind/nanobind.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "aot_launch.h"

namespace nb = nanobind;
using namespace nb::literals;
using mlx_aot::KernelBinary;
using mlx_aot::LaunchArgs;

namespace {

// The Python objects own C++ shared pointers, and each launch's primitive takes a copy of them (an
// atomic increment). nanobind's own shared_ptr<T> of a Python object would give every launch a new
// control block whose deleter takes the GIL to drop a Python reference when MLX frees the primitive,
// which it does inside mx.eval with the GIL released: twice per launch.
struct BinaryHandle {
  std::shared_ptr<const KernelBinary> bin;
};
struct PlanHandle {
  std::shared_ptr<const LaunchArgs> args;
};

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "mlx-aot-kernels native launcher: runs AOT-compiled kernels as one MLX primitive";

  nb::class_<BinaryHandle>(m, "KernelBinary", nb::dynamic_attr())
      .def("__init__",
           [](BinaryHandle* self, std::string key, std::string path, std::string target, std::vector<int> roles,
              std::vector<int> like, std::vector<int> scalar_types, std::vector<int> specialize,
              std::vector<int> strided, nb::bytes image) {
             if (image.size() == 0)
               throw std::invalid_argument("image is empty: an artifact is loaded from its verified bytes");
             if (roles.size() != like.size() || roles.size() != strided.size())
               throw std::invalid_argument("roles, like and strided differ in length");
             if (scalar_types.size() != specialize.size())
               throw std::invalid_argument("scalar_types and specialize differ in length");
             auto b = std::make_shared<KernelBinary>();
             b->key = std::move(key);
             b->path = std::move(path);
             b->image.assign(image.c_str(), image.size());
             b->target = std::move(target);
             b->roles = std::move(roles);
             b->like = std::move(like);
             b->strided = std::move(strided);
             b->scalar_types = std::move(scalar_types);
             b->specialize = std::move(specialize);
             for (size_t i = 0; i < b->roles.size(); ++i) {
               int r = b->roles[i];
               if (r < 0 || r > 2) throw std::invalid_argument("role must be 0 (input), 1 (output) or 2 (inplace)");
               if (b->strided[i] && r == mlx_aot::kInplace)
                 throw std::invalid_argument("in-place buffer " + std::to_string(i) + " cannot be strided");
               if (r == mlx_aot::kOutput &&
                   (b->like[i] < 0 || b->like[i] >= static_cast<int>(i) || b->roles[b->like[i]] == mlx_aot::kOutput))
                 throw std::invalid_argument("output buffer " + std::to_string(i) + " needs `like` = an earlier input");
             }
             mlx_aot::index_buffers(*b);
             new (self) BinaryHandle{std::move(b)};
           },
           "key"_a, "path"_a, "target"_a, "roles"_a, "like"_a, "scalar_types"_a, "specialize"_a, "strided"_a,
           "image"_a)
      .def_prop_ro("key", [](const BinaryHandle& h) { return h.bin->key; })
      .def_prop_ro("path", [](const BinaryHandle& h) { return h.bin->path; })
      .def_prop_ro("target", [](const BinaryHandle& h) { return h.bin->target; });

  nb::class_<PlanHandle>(m, "LaunchArgs")
      .def("__init__",
           [](PlanHandle* self, std::string entry, std::vector<uint32_t> scalars, std::array<int, 3> grid,
              std::array<int, 3> group, std::string dtype, std::vector<std::string> buffer_dtypes,
              std::vector<std::vector<int>> input_shapes) {
             for (int i = 0; i < 3; ++i) {
               if (grid[i] < 0 || group[i] < 1)
                 throw std::invalid_argument("grid must be >= 0 and threadgroup >= 1 on every axis");
             }
             new (self) PlanHandle{std::make_shared<const LaunchArgs>(LaunchArgs{
                 std::move(entry), std::move(dtype), std::move(scalars), grid, group, std::move(buffer_dtypes),
                 std::move(input_shapes)})};
           },
           "entry"_a, "scalars"_a, "grid"_a, "threadgroup"_a, "dtype"_a, "buffer_dtypes"_a,
           "input_shapes"_a = std::vector<std::vector<int>>{},
           "A launch plan: entry symbol, its dtype key, scalar bit patterns, grid (threads), threadgroup, "
           "the dtype each buffer must have and (optionally) the shape of each input array.")
      .def_prop_ro("entry", [](const PlanHandle& h) { return h.args->entry; })
      .def_prop_ro("dtype", [](const PlanHandle& h) { return h.args->dtype; });

  m.def(
      "launch",
      [](nb::handle py_bin, const PlanHandle& plan, nb::sequence seq, mlx::core::StreamOrDevice s) {
        const BinaryHandle& bin = nb::cast<const BinaryHandle&>(py_bin);
        const size_t n = nb::len(seq);
        std::vector<mlx::core::array> inputs;
        inputs.reserve(n);
        for (size_t i = 0; i < n; ++i) {
          nb::object item = seq[i];
          mlx::core::array* a = nullptr;
          if (!nb::try_cast<mlx::core::array*>(item, a) || a == nullptr)
            throw nb::type_error(("inputs[" + std::to_string(i) + "] must be an mx.array, got " +
                                  nb::type_name(item.type()).c_str()).c_str());
          inputs.push_back(*a);  // the one copy launch() counts on
        }
        std::vector<mlx_aot::Copied> copied;
        auto out = mlx_aot::launch(bin.bin, plan.args, std::move(inputs), s, &copied);
        // Copy-on-write is never expected in steady state: tell the binary's owner (registry/native.py).
        if (!copied.empty() && nb::hasattr(py_bin, "on_copy")) {
          for (const auto& c : copied) py_bin.attr("on_copy")(c.buffer, c.reason);
        }
        return out;
      },
      "binary"_a, "args"_a, "inputs"_a, "stream"_a = nb::none(),
      "Lazily launch a plan on the artifact; returns the outputs in signature order. A binary with an "
      "`on_copy(buffer, reason)` attribute is told of every in-place buffer written through a copy.");

  m.def(
      "rebind", [](mlx::core::array& dst, const mlx::core::array& src) { dst.overwrite_descriptor(src); },
      "dst"_a, "src"_a,
      "Make the array object `dst` the array `src` (the same graph node, no new one): how the integrations "
      "give the attention's placeholder its value.");
  m.def(
      "array_ids",
      [](nb::args arrays) {
        nb::list ids;
        for (nb::handle h : arrays) {
          mlx::core::array* a = nullptr;
          if (!nb::try_cast<mlx::core::array*>(h, a) || a == nullptr)
            throw nb::type_error(("array_ids takes mx.array arguments, got " +
                                  std::string(nb::type_name(h.type()).c_str())).c_str());
          ids.append(a->id());
        }
        return nb::tuple(ids);
      },
      "The identities of the arrays' descriptors, as a tuple: equal for two array objects of one MLX array, "
      "new after an update in place (`a[...] = x` gives the Python object another descriptor). Unique only "
      "while the descriptor lives: hold the array to keep it (registry.kernels._base.DerivedArray).");
  m.def("cuda_device_arch", &mlx_aot::cuda_device_arch, "device"_a = 0,
        "Compute capability of a CUDA device as 'sm_XY' ('' without CUDA).");
  m.def("memory_kind", &mlx_aot::memory_kind, "a"_a,
        "Where the evaluated array's buffer lives on CUDA: 'device', 'managed' or 'host' ('' in builds "
        "without CUDA): the launcher gives its fresh outputs device memory, as MLX's own CUDA ops do.");
  m.def(
      "owner_counts", &mlx_aot::owner_counts, "a"_a,
      "(array objects and pending ops referring to `a`, arrays and in-flight work holding its buffer or -1 "
      "when not computed): the first is what the in-place policy counts, the second depends on timing.");
  m.def(
      "stats",
      []() {
        auto st = mlx_aot::inplace_stats();
        nb::dict d;
        d["launches"] = st.launches;
        d["aliased"] = st.aliased;
        d["copies"] = st.copies;
        d["first_use_checks"] = st.first_use_checks;
        d["syncs"] = st.syncs;
        d["output_mallocs"] = st.output_mallocs;
        d["output_frees"] = st.output_frees;
        d["owned_pools"] = st.owned_pools;
        return d;
      },
      "Process-wide launcher counters (registry.native.stats() documents them).");
  m.def("reset_stats", &mlx_aot::reset_inplace_stats, "Zero the launcher counters.");
  m.def("built_with_cuda", &mlx_aot::built_with_cuda);
  m.def("built_with_metal", &mlx_aot::built_with_metal);
}
