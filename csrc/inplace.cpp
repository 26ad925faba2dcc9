// The in-place policy for `inplace` buffers (the KV pools): may a launch write the pool where it
// lies, or must it write a copy (copy-on-write)? docs/native.md, "In-place outputs", states the rule.
//
// Why it never depends on timing: MLX keeps buffers alive for work in flight by holding their
// `array::Data` (CUDA CommandEncoder::add_temporary, the Metal and CPU completion handlers), never
// the array descriptors. So the descriptor's owner count is exactly "how many array objects and
// pending ops refer to this array", whenever it is read; the buffer's owner count is not (it also
// counts in-flight work until MLX's completion handlers have run). The policy therefore counts
// descriptors at every call, and counts buffer owners only the first time it takes a buffer, after
// waiting for the stream so that no in-flight reference is left.
#include <atomic>
#include <cstring>
#include <mutex>
#include <typeinfo>
#include <unordered_map>

#include "aot_launch.h"
#include "mlx/primitives.h"  // Primitive::name
#include "mlx/transforms.h"

namespace mlx_aot {

namespace {

// MLX exposes no descriptor owner count (array::is_donatable() folds it with the buffer's). An
// explicit instantiation may name a private member (C++ [temp.spec]/6), which reads it without
// changing MLX: `desc_of(a)` is a's std::shared_ptr<ArrayDesc>.
struct DescTag {};
auto desc_member(DescTag);
template <auto Member>
struct DescAccess {
  friend auto desc_member(DescTag) { return Member; }
};
template struct DescAccess<&mx::array::array_desc_>;

long desc_owners(const mx::array& a) { return (a.*desc_member(DescTag{})).use_count(); }

// Buffers this launcher has written in place, keyed by their Data; weak, so a pool its user drops is
// freed as usual (no leak) and a reused address is never mistaken for it. The region recorded is the
// pool's own (offset, size): a view of part of the pool is not the pool.
struct Owned {
  std::weak_ptr<mx::array::Data> data;
  int64_t offset;
  size_t size;
};
std::mutex owned_mu;
// Intentionally leaked: must outlive any array freed at process exit.
auto& owned = *new std::unordered_map<const void*, Owned>();

std::atomic<uint64_t> n_launches{0}, n_aliased{0}, n_copies{0}, n_first_checks{0}, n_syncs{0}, n_mallocs{0},
    n_frees{0};

bool owned_by_launcher(const mx::array& a) {
  std::lock_guard<std::mutex> lock(owned_mu);
  auto it = owned.find(a.data_shared_ptr().get());
  if (it == owned.end()) return false;
  auto live = it->second.data.lock();
  return live == a.data_shared_ptr() && it->second.offset == a.offset() && it->second.size == a.data_size();
}

bool is_inplace_output_of_launch(const mx::array& a) {
  if (!a.has_primitive()) return false;
  const mx::Primitive& prim = a.primitive();
  if (typeid(prim) != typeid(AotLaunch)) return false;
  const auto& producer = static_cast<const AotLaunch&>(prim).binary();
  for (size_t b = 0; b < producer.roles.size(); ++b) {
    if (producer.output_of[b] == static_cast<int>(a.sibling_position())) return producer.roles[b] == kInplace;
  }
  return false;
}

// A lazy array whose evaluation allocates a new row-contiguous buffer that only it holds, on every
// backend (MLX 0.32.4: Concatenate, Gather and GatherAxis always malloc their output; Full copies a
// one-element value as a Scalar copy into a fresh buffer): mx.concatenate, mx.zeros / mx.full(shape,
// scalar), a[indices] and mx.take_along_axis, what the caches grow, filter and roll their buffers
// with. Such a buffer can be taken without computing it first: only array objects and pending ops (its
// descriptor's owners) could ever reach it.
bool allocates_fresh(const mx::array& a) {
  if (is_primitive(a, "Concatenate") || is_primitive(a, "Gather") || is_primitive(a, "GatherAxis")) return true;
  if (!is_primitive(a, "Full") || a.inputs().size() != 1) return false;
  const mx::array& value = a.inputs()[0];   // broadcast_to(scalar) for mx.zeros / mx.full(shape, x)
  if (!value.has_primitive()) return value.data_size() == 1;
  return value.size() == 1 ||
         (is_primitive(value, "Broadcast") && value.inputs().size() == 1 && value.inputs()[0].size() == 1);
}

// allocates_fresh, or Squeezes / Reshapes of such an array that nothing else refers to (a[indices] is
// Squeeze(Gather), x.reshape(...) of it a Reshape over that): each view's buffer is then the fresh
// one, row-contiguous, reached only through it.
bool fresh_by_construction(const mx::array& a) {
  const mx::array* x = &a;
  for (int depth = 0; depth < 4 && (is_primitive(*x, "Squeeze") || is_primitive(*x, "Reshape")); ++depth) {
    if (x->inputs().size() != 1) return false;
    const mx::array& in = x->inputs()[0];
    if (in.status() != mx::array::Status::unscheduled || desc_owners(in) != 1) return false;
    x = &in;
  }
  return allocates_fresh(*x);
}

}  // namespace

InplaceDecision decide_inplace(const std::vector<mx::array>& inputs, int i, mx::StreamOrDevice s) {
  const mx::array& a = inputs[i];
  for (size_t j = 0; j < inputs.size(); ++j) {
    if (static_cast<int>(j) != i && inputs[j].id() == a.id()) return {false, "it is passed as another buffer too"};
  }
  // The caller's own mx.array object + the copy in `inputs` (launch() documents this).
  long expected = 2;
  if (a.status() == mx::array::Status::unscheduled) {
    if (is_inplace_output_of_launch(a)) {
      // Several calls, one evaluation: it will be that launch's pool. Its sibling outputs hold it
      // until it runs.
      expected += static_cast<long>(a.siblings().size());
      if (desc_owners(a) != expected) return {false, "another array object or a pending op refers to it"};
      return {true, ""};
    }
    if (fresh_by_construction(a)) {
      // A new buffer nothing else can share (the caches' growth): no wait, no first-use check.
      if (desc_owners(a) != expected) return {false, "another array object or a pending op refers to it"};
      return {true, ""};
    }
    // Any other lazy pool: compute it now, once, and decide as for a computed one. Its pending
    // readers still hold it, so they are seen below.
    n_syncs++;
    mx::eval(const_cast<mx::array&>(a));
  }
  if (!a.flags().row_contiguous) return {false, "it is not row-contiguous"};
  if (desc_owners(a) != expected) {
    return {false, "another array object refers to it (an alias such as pool.astype(pool.dtype), "
                   "pool.reshape(pool.shape) or pool[...]) or an op not yet evaluated reads it"};
  }
  if (owned_by_launcher(a)) return {true, ""};
  // First time this buffer is seen: nothing else may share it (a view of it, or the array it is a
  // view of). Wait for in-flight work only if its references could be what the count sees.
  n_first_checks++;
  if (a.data_shared_ptr().use_count() > 1) {
    n_syncs++;
    mx::synchronize(mx::to_stream(s));
  }
  if (a.data_shared_ptr().use_count() > 1) {
    return {false, "its buffer is shared with another array (a view of it, or the array it is a view of)"};
  }
  return {true, ""};
}

void record_inplace_write(const mx::array& pool) {
  std::lock_guard<std::mutex> lock(owned_mu);
  if (owned.size() > 4096) {  // drop entries of freed pools now and then
    for (auto it = owned.begin(); it != owned.end();) it = it->second.data.expired() ? owned.erase(it) : std::next(it);
  }
  owned.insert_or_assign(pool.data_shared_ptr().get(),
                         Owned{pool.data_shared_ptr(), pool.offset(), pool.data_size()});
}

void count_launch(int aliased, int copies) {
  n_launches++;
  n_aliased += aliased;
  n_copies += copies;
}

void count_output_buffer(bool malloc) { malloc ? n_mallocs++ : n_frees++; }

InplaceStats inplace_stats() {
  size_t live = 0;
  {
    std::lock_guard<std::mutex> lock(owned_mu);
    for (const auto& [key, entry] : owned) live += entry.data.expired() ? 0 : 1;
  }
  return {n_launches.load(), n_aliased.load(), n_copies.load(), n_first_checks.load(), n_syncs.load(),
          n_mallocs.load(), n_frees.load(), live};
}

void reset_inplace_stats() {
  n_launches = n_aliased = n_copies = n_first_checks = n_syncs = n_mallocs = n_frees = 0;
}

std::pair<long, long> owner_counts(const mx::array& a) {
  return {desc_owners(a), a.status() == mx::array::Status::unscheduled ? -1 : a.data_shared_ptr().use_count()};
}

}  // namespace mlx_aot
